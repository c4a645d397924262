"""The harvest worker against the real embedded engine: safetensors shards, stats, manifest,
progress, cancellation between batches, retries and the stuck-job sweep."""

import json
import subprocess
import sys
from datetime import timedelta

import httpx
import numpy as np
import pytest
from django.core.files.storage import default_storage
from django.utils import timezone
from safetensors import deserialize, safe_open
from tokenizers import Tokenizer

from acs_client.codec import decode
from acs_client.downloads import load_activations
from acs_client.protocol import in_vllm_xargs
from api.jobs import selectors
from api.jobs.models import HarvestJob
from api.jobs.services import harvests
from infra.lifecycle import WorkStatus
from metering import windows
from metering.models import UsagePeriod, UsageRecord

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Interpretability research reads the residual stream.",
    "Paris",
]
LAYERS = [0, 7, 29]


def _submit(api_key, prompts=PROMPTS, layers=LAYERS):
    job, _ = harvests.harvest_job_submit(
        key=api_key, model="smollm2-135m", prompts=prompts, layers=layers, add_special_tokens=True
    )
    return job


def _tensors(path):
    """name → float32 (bf16 widened) or int32 array, parsed by the safetensors library."""
    loaded = {}
    for name, spec in deserialize(default_storage.open(path).read()):
        if spec["dtype"] == "BF16":
            words = np.frombuffer(bytes(spec["data"]), dtype="<u2").astype(np.uint32)
            loaded[name] = (words << 16).view(np.float32).reshape(spec["shape"])
        else:
            assert spec["dtype"] == "I32", name
            loaded[name] = np.frombuffer(bytes(spec["data"]), dtype="<i4").reshape(spec["shape"])
    return loaded


def assert_same_rows(harvested: np.ndarray, captured: np.ndarray, engine_dtype: str) -> None:
    """Each [layer, position] row harvested is the row one completion captured for the prompt.

    In float32 they are equal to the bfloat16 rounding of the wire. A bfloat16 engine computes
    a prompt's rows with other kernels when it is prefilled in a batch (products of more rows
    than its kernel plan's `half_rows` skip the float16-weight kernel), which moves a row by
    up to ~4% of its norm by the last layer (measured on an AVX-512 BF16 CPU: median 2.5%,
    max 3.7% at layer 29): held to the engine fidelity suite's bfloat16 bounds against float32
    (median 5%, max 25%). A row of the wrong position or prompt is off by ~50% or more."""
    if engine_dtype == "float32":
        np.testing.assert_allclose(harvested, captured, rtol=2**-7, atol=1e-2)
        return
    error = np.linalg.norm(harvested - captured, axis=-1) / np.linalg.norm(captured, axis=-1)
    assert np.median(error) <= 0.05 and error.max() <= 0.25, error


@pytest.mark.django_db
def test_harvest_shards_equal_the_completions_capture_of_each_prompt(
    engine_model, engine_url, api_key, settings, redis_client
):
    settings.ACS_HARVEST_BATCH_SIZE = 2
    job = _submit(api_key)
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert job.status == WorkStatus.SUCCEEDED, job.error
    assert job.prompts_done == job.n_prompts == 3
    assert job.files[-1] == "manifest.json"
    manifest = json.loads(default_storage.open(job.storage_prefix + "manifest.json").read())
    assert manifest["model"] == "smollm2-135m"
    assert manifest["layers"] == LAYERS
    assert manifest["dtype"] == "bfloat16"
    assert manifest["n_prompts"] == 3
    assert [shard["tensors"] for shard in manifest["shards"]] == [
        ["prompt_0", "tokens_0", "prompt_1", "tokens_1"],
        ["prompt_2", "tokens_2"],
    ]
    tensors = {}
    for shard in manifest["shards"]:
        path = default_storage.path(job.storage_prefix + shard["name"])
        with safe_open(path, framework="np") as handle:
            assert handle.get_slice("prompt_" + shard["tensors"][0][7:]).get_dtype() == "BF16"
        tensors.update(_tensors(job.storage_prefix + shard["name"]))

    engine_dtype = httpx.get(f"{engine_url}/health").json()["dtype"]
    for index, prompt in enumerate(PROMPTS):
        tokens = httpx.post(f"{engine_url}/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert tensors[f"tokens_{index}"].dtype == np.int32
        assert tensors[f"tokens_{index}"].tolist() == tokens
        body = {
            "model": "smollm2-135m",
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "output_residual_stream": LAYERS,
        }
        reply = httpx.post(
            f"{engine_url}/v1/completions", json=in_vllm_xargs(body), timeout=60
        ).json()
        expected = decode(reply["activations"]["residual_stream"])
        assert tensors[f"prompt_{index}"].shape == (len(LAYERS), len(tokens), 576)
        assert_same_rows(tensors[f"prompt_{index}"], expected, engine_dtype)


@pytest.mark.django_db
def test_harvest_stats_are_the_mean_and_std_over_all_positions_but_the_first(
    engine_model, api_key, redis_client
):
    job = _submit(api_key)
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.SUCCEEDED, job.error
    captures = []
    for shard in json.loads(default_storage.open(job.storage_prefix + "manifest.json").read())[
        "shards"
    ]:
        loaded = _tensors(job.storage_prefix + shard["name"])
        captures += [loaded[name] for name in shard["tensors"] if name.startswith("prompt_")]
    positions = np.concatenate([c[:, 1:, :] for c in captures], axis=1).astype(np.float64)

    with safe_open(default_storage.path(job.storage_prefix + "stats.safetensors"), "np") as f:
        mean, std, norm_mean = f.get_tensor("mean"), f.get_tensor("std"), f.get_tensor("norm_mean")
        assert f.get_tensor("positions").tolist() == [positions.shape[1]]
    assert mean.dtype == std.dtype == np.float32
    assert mean.shape == std.shape == (len(LAYERS), 576)
    np.testing.assert_allclose(mean, positions.mean(axis=1), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(std, positions.std(axis=1), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(norm_mean, np.linalg.norm(positions, axis=2).mean(axis=1), rtol=1e-4)


@pytest.mark.django_db
def test_a_job_cancelled_midway_stops_before_its_next_batch_and_keeps_its_shards(
    engine_model, api_key, settings, monkeypatch, redis_client
):
    settings.ACS_HARVEST_BATCH_SIZE = 1
    job = _submit(api_key)
    real_capture = harvests.capture_batch
    batches = []

    async def capture_then_cancel(*args, **kwargs):
        batches.append(kwargs["first_index"])
        result = await real_capture(*args, **kwargs)
        await HarvestJob.objects.filter(pk=job.pk).aupdate(status=WorkStatus.CANCELLED)
        return result

    monkeypatch.setattr(harvests, "capture_batch", capture_then_cancel)
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert batches == [0]
    assert job.status == WorkStatus.CANCELLED
    assert job.files == ["shard_00000.safetensors", "stats.safetensors", "manifest.json"]
    assert job.lease_expires_at is None and not job.is_stopping  # the worker has stopped
    assert job.prompts_done == 1
    manifest = json.loads(default_storage.open(job.storage_prefix + "manifest.json").read())
    assert manifest["prompts_captured"] == 1
    assert [shard["tensors"] for shard in manifest["shards"]] == [["prompt_0", "tokens_0"]]
    assert set(_tensors(job.storage_prefix + "shard_00000.safetensors")) == {
        "prompt_0",
        "tokens_0",
    }
    links = selectors.harvest_download_links(job=job)
    assert len(links["shard_urls"]) == 1


@pytest.mark.django_db
def test_a_job_cancelled_before_its_first_batch_keeps_no_files(
    engine_model, api_key, settings, monkeypatch, redis_client
):
    job = _submit(api_key)
    harvests.harvest_job_cancel(job=job)
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.CANCELLED
    assert job.files == []
    assert selectors.harvest_download_links(job=job) is None


@pytest.mark.django_db
def test_progress_is_recorded_after_every_batch(engine_model, api_key, settings, monkeypatch):
    settings.ACS_HARVEST_BATCH_SIZE = 1
    job = _submit(api_key)
    seen = []
    real_capture = harvests.capture_batch

    async def capture_and_look(*args, **kwargs):
        seen.append((await HarvestJob.objects.aget(pk=job.pk)).prompts_done)
        return await real_capture(*args, **kwargs)

    monkeypatch.setattr(harvests, "capture_batch", capture_and_look)
    harvests.harvest_job_execute(job_id=job.pk)
    assert seen == [0, 1, 2]
    job.refresh_from_db()
    assert (job.status, job.prompts_done, job.progress) == (WorkStatus.SUCCEEDED, 3, 1.0)


@pytest.mark.django_db
def test_a_prompt_longer_than_the_context_fails_the_job_with_a_message(
    engine_model, api_key, redis_client
):
    engine_model.max_model_len = 8
    engine_model.save(update_fields=["max_model_len"])
    job = _submit(api_key, prompts=["short", "one two three four five six seven eight nine"])
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "context_length_exceeded"
    assert "Prompt 1" in job.error["message"]


@pytest.mark.django_db
def test_a_capture_over_the_size_limit_fails_the_job_with_a_message(
    engine_model, api_key, redis_client, monkeypatch
):
    monkeypatch.setattr("api.jobs.capture.CAPTURE_MAX_VALUES", 3 * 4 * 576)
    job = _submit(api_key, prompts=["one two", "one two three four five six"])
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "activation_prompt_too_long"
    assert "prompt 1" in job.error["message"]


@pytest.mark.django_db
def test_an_unreachable_upstream_puts_the_job_back_to_pending_until_attempts_run_out(
    engine_model, api_key, settings, sent_tasks, redis_client
):
    engine_model.activation_upstream_urls = ["http://127.0.0.1:9"]
    engine_model.save(update_fields=["activation_upstream_urls"])
    job = _submit(api_key, prompts=["Paris"])
    for attempt in range(1, settings.ACS_JOB_MAX_ATTEMPTS + 1):
        harvests.harvest_job_execute(job_id=job.pk)
        job.refresh_from_db()
        assert job.attempts == attempt
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "upstream_unreachable"
    retries = [c for name, _, c in sent_tasks if name.endswith("harvest_job_run_task") and c]
    assert len(retries) == settings.ACS_JOB_MAX_ATTEMPTS - 1


@pytest.mark.django_db
def test_the_sweep_requeues_a_job_whose_worker_died_then_fails_it(api_key, settings, sent_tasks):
    job = _submit(api_key)
    now = timezone.now()
    HarvestJob.objects.filter(pk=job.pk).update(
        status=WorkStatus.RUNNING, attempts=1, prompts_done=2, lease_expires_at=now
    )
    assert harvests.harvest_jobs_recover_stuck(now=now - timedelta(seconds=1)) == 0
    assert harvests.harvest_jobs_recover_stuck(now=now + timedelta(seconds=1)) == 1
    job.refresh_from_db()
    # Its progress is kept: the next attempt resumes after the shards it recorded.
    assert (job.status, job.prompts_done) == (WorkStatus.QUEUED, 2)
    assert sent_tasks.ids("api.jobs.tasks.harvest_job_run_task")[-1] == str(job.pk)

    HarvestJob.objects.filter(pk=job.pk).update(
        status=WorkStatus.RUNNING,
        attempts=settings.ACS_JOB_MAX_ATTEMPTS,
        lease_expires_at=now,
    )
    harvests.harvest_jobs_recover_stuck(now=now + timedelta(seconds=1))
    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "worker_lost"


@pytest.mark.django_db
def test_harvest_shards_carry_their_tokens_and_metadata_for_the_loader(
    engine_model, engine_url, api_key, settings, redis_client
):
    settings.ACS_HARVEST_BATCH_SIZE = 2
    job = _submit(api_key)
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    tokenizer = Tokenizer.from_str(httpx.get(f"{engine_url}/tokenizer.json").text)
    path = default_storage.path(job.storage_prefix + "shard_00000.safetensors")
    shard = load_activations(path)
    assert shard.model == "smollm2-135m" and shard.layers == LAYERS
    assert shard.metadata["kind"] == "harvest_shard" and shard.metadata["job_id"] == str(job.pk)
    assert shard.metadata["capture"] == "output of decoder block k, before the final norm"
    assert shard.steering == []
    raw = _tensors(job.storage_prefix + "shard_00000.safetensors")
    assert [capture.index for capture in shard.captures] == [0, 1]
    for capture, prompt in zip(shard.captures, PROMPTS, strict=False):
        encoding = tokenizer.encode(prompt)
        assert capture.token_ids.tolist() == encoding.ids
        # Each token's text, cut from the prompt by the tokenizer's offsets.
        assert capture.token_strings == [prompt[start:end] for start, end in encoding.offsets]
        assert capture.prompt_length == len(encoding.ids) and capture.is_prompt.all()
        assert capture.request_id == f"harvest-{job.pk.hex[:12]}-0"
        assert np.array_equal(capture.activations, raw[f"prompt_{capture.index}"])
        assert np.array_equal(capture.layer(LAYERS[1]), raw[f"prompt_{capture.index}"][1])
    # The runnable example of acs_client.downloads prints what the file holds.
    printed = subprocess.run(
        [sys.executable, "-m", "acs_client.downloads", path],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"harvest_shard of smollm2-135m, layers {LAYERS}" in printed
    assert f"capture 0: [{len(LAYERS)}, " in printed and "0='The' 1=' quick'" in printed


class WorkerDied(BaseException):
    """Ends an attempt as a killed worker would: nothing of the service catches it."""


@pytest.mark.django_db
def test_a_harvest_retried_after_its_worker_died_resumes_after_its_last_shard(
    engine_model, api_key, settings, monkeypatch, sent_tasks, redis_client
):
    settings.ACS_HARVEST_BATCH_SIZE = 1
    job = _submit(api_key)
    captured = []
    real_capture = harvests.capture_batch

    async def capture_until_the_worker_dies(*args, first_index, **kwargs):
        captured.append(first_index)
        if len(captured) == 3:
            raise WorkerDied
        return await real_capture(*args, first_index=first_index, **kwargs)

    monkeypatch.setattr(harvests, "capture_batch", capture_until_the_worker_dies)
    with pytest.raises(WorkerDied):
        harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert (job.status, job.prompts_done) == (WorkStatus.RUNNING, 2)

    lease = timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS + 1)
    assert harvests.harvest_jobs_recover_stuck(now=timezone.now() + lease) == 1
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert job.status == WorkStatus.SUCCEEDED, job.error
    assert job.attempts == 2
    # The second attempt captured only the prompt the first had not written.
    assert captured == [0, 1, 2, 2]
    manifest = json.loads(default_storage.open(job.storage_prefix + "manifest.json").read())
    assert [shard["tensors"] for shard in manifest["shards"]] == [
        [f"prompt_{i}", f"tokens_{i}"] for i in range(3)
    ]
    assert manifest["prompts_captured"] == 3
    # Billed once per batch: three usage records, three activation requests.
    records = UsageRecord.objects.filter(key=api_key, endpoint="harvest")
    assert sorted(r.request_id[-2:] for r in records) == ["-0", "-1", "-2"]
    month = UsagePeriod.objects.get(key=api_key, period=windows.MONTH.name)
    assert (month.activation_requests, month.reserved_tokens) == (3, 0)
    assert month.used_tokens == sum(r.prompt_tokens + r.completion_tokens for r in records)

    # The stats cover the resumed shards too: the same as an attempt that never died.
    monkeypatch.setattr(harvests, "capture_batch", real_capture)
    clean = _submit(api_key)
    harvests.harvest_job_execute(job_id=clean.pk)
    clean.refresh_from_db()
    assert clean.status == WorkStatus.SUCCEEDED, clean.error
    resumed_stats = _tensors_any(job.storage_prefix + "stats.safetensors")
    clean_stats = _tensors_any(clean.storage_prefix + "stats.safetensors")
    for name in ("mean", "std", "norm_mean", "positions"):
        np.testing.assert_array_equal(resumed_stats[name], clean_stats[name])


def _tensors_any(path):
    with safe_open(default_storage.path(path), framework="np") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
