"""The client package as a researcher gets it: the wheel built from acs_client/, installed
into a fresh virtualenv (its dependencies from the package index, nothing from this
repository), and its example tour run with that virtualenv's Python against the whole running
system (engine, web, worker). What the tour prints is checked against the same requests sent
with plain httpx and decoded with numpy here.

uv builds and installs: it reads the same standard metadata (pyproject.toml's build backend
and dependencies) as pip, in seconds where pip took over a minute, and the virtualenv is the
standard library's own, as a researcher makes it."""

import base64
import json
import os
import re
import subprocess
import sys

import httpx
import numpy as np
import pytest
import zstandard
from django.db import connections
from safetensors import deserialize
from uv import find_uv_bin

from accounts.models import User
from accounts.services.keys import api_key_create
from tests.conftest import make_user

from .system import REPO_ROOT

pytestmark = pytest.mark.django_db

RESEARCHER = "client-package@example.org"
MODEL = "smollm2-135m"
# As acs_client/examples/tour.py sends them: the middle layer of the model's 30.
LAYER = 15
PROMPT = "The capital of France is"
STEERED_PROMPT = "I think that"
HARVEST_PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is in France."]


@pytest.fixture(scope="module")
def api_secret(system, django_db_blocker):
    """A key of a researcher of its own (created, committed, before any test's transaction)."""
    with django_db_blocker.unblock():
        user = User.objects.filter(email=RESEARCHER).first() or make_user(RESEARCHER)
        _, secret = api_key_create(user=user, name="client package", acting_user=user)
        connections.close_all()
    return secret


def run(command, *, cwd, timeout, env=None):
    result = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


def bfloat16_values(raw: bytes, shape) -> np.ndarray:
    """bfloat16 bit patterns (little-endian 16-bit words) widened to float32."""
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)


def decoded_capture(http: httpx.Client, prompt: str) -> np.ndarray:
    """The layer's residual stream of `prompt` [tokens, hidden], decoded by hand from the raw
    /v1 answer (base64, zstd, bfloat16 words)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    answer = http.post("/v1/completions", json={**body, "output_residual_stream": [LAYER]})
    captured = answer.json()["activations"]["residual_stream"]
    raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(captured["data"]))
    return bfloat16_values(raw, captured["shape"])[0]


def bfloat16_codec_object(values: np.ndarray) -> dict:
    """The API's codec object of `values`, rounded to bfloat16 (nearest, ties to even)."""
    bits = values.astype(np.float32).view(np.uint32)
    words = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return {
        "data": base64.b64encode(zstandard.ZstdCompressor().compress(words.tobytes())).decode(),
        "dtype": "int16",
        "original_dtype": "torch.bfloat16",
        "shape": list(values.shape),
        "compression": "zstd",
    }


def test_the_wheel_installs_in_a_fresh_virtualenv_and_its_tour_runs_on_the_system(
    system, api_secret, tmp_path
):
    wheels, venv, out = tmp_path / "wheels", tmp_path / "venv", tmp_path / "harvest"
    uv = find_uv_bin()
    run(
        [uv, "build", "-q", "--wheel", "--out-dir", wheels, "./acs_client"],
        cwd=REPO_ROOT,
        timeout=300,
    )
    [wheel] = wheels.glob("acs_client-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, timeout=120)
    python = venv / "bin" / "python"
    run([uv, "pip", "install", "-q", "--python", python, wheel], cwd=tmp_path, timeout=300)
    located = run(
        [python, "-c", "import acs_client; print(acs_client.__file__)"], cwd=tmp_path, timeout=60
    )
    assert located.stdout.startswith(str(venv))

    # The key from the environment, the URL as an option: both ways the tour documents.
    tour = run(
        [python, "-m", "acs_client.examples.tour", "--base-url", system.web_url, "--out", out],
        cwd=tmp_path,
        timeout=600,
        env={**os.environ, "ACS_API_KEY": api_secret},
    )
    printed = tour.stdout
    assert f"model: {MODEL}, 30 layers, hidden size 576" in printed
    # The harvest's progress bar ran to all its prompts; budgets say what they count.
    assert "2/2" in tour.stderr
    assert "budget Activation requests, this month: 4 used" in printed
    assert "budget Harvest jobs, this month: 1 used" in printed

    with httpx.Client(
        base_url=system.web_url, headers={"Authorization": f"Bearer {api_secret}"}, timeout=120
    ) as http:
        completion = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        ).json()
        assert f"{PROMPT!r} → {completion['choices'][0]['text']!r}" in printed

        capture = decoded_capture(http, PROMPT)
        norms = re.search(
            r"capture: layer 15, shape \[1, (\d+), 576\], norms \[([^\]]*)\]", printed
        )
        assert int(norms.group(1)) == capture.shape[0]
        printed_norms = np.array(norms.group(2).split(), dtype=float)
        np.testing.assert_allclose(printed_norms, np.linalg.norm(capture, axis=-1), atol=0.051)

        # The steered completion: the capture's mean direction over positions 1.., scaled
        # to the mean norm of those rows (rounded to a whole number), at layer 15.
        rows = capture[1:]
        direction = rows.mean(axis=0) / np.linalg.norm(rows.mean(axis=0))
        scale = float(np.round(np.linalg.norm(rows, axis=-1).mean()))
        steering = {
            "activations": bfloat16_codec_object(direction[None, :]),
            "layer_indices": [LAYER],
            "scale": scale,
        }
        body = {"model": MODEL, "prompt": STEERED_PROMPT, "max_tokens": 12, "temperature": 0}
        baseline = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        steered = http.post(
            "/v1/completions", json={**body, "apply_steering_vectors": [steering]}
        ).json()["choices"][0]["text"]
        assert steered != baseline
        assert f"baseline: {STEERED_PROMPT!r} → {baseline!r}" in printed
        assert f"steered:  {STEERED_PROMPT!r} → {steered!r} (layer 15, scale {scale})" in printed

        # The harvest's files, read with the safetensors library: each prompt's rows equal
        # its capture through /v1/completions (within bfloat16 rounding of batched work).
        manifest = json.loads((out / "manifest.json").read_text())
        assert (manifest["model"], manifest["layers"]) == (MODEL, [LAYER])
        tensors = {}
        for shard in manifest["shards"]:
            tensors.update(dict(deserialize((out / shard["name"]).read_bytes())))
        for index, prompt in enumerate(HARVEST_PROMPTS):
            entry = tensors[f"prompt_{index}"]
            harvested = bfloat16_values(bytes(entry["data"]), entry["shape"])[0]
            expected = decoded_capture(http, prompt)
            assert harvested.shape == expected.shape
            relative = np.linalg.norm(harvested - expected) / np.linalg.norm(expected)
            assert relative < 1e-2, (prompt, relative)
            assert f"prompt {index}: layer {LAYER} [{expected.shape[0]}, 576]" in printed
