"""The public API in front of a real vLLM-Lens answers as in front of the embedded engine.

Every request goes through the gateway twice, to the `vllm` model (vLLM-Lens) and to the
`engine` model, and the public answers are compared: status, shape and usage exactly; greedy
tokens until the first near tie (both compute in bfloat16), logprobs and residual rows within
twice the bfloat16 bounds of tests/tolerances.py (each answer lies within one bound of the
float32 model: tests/engine/test_fidelity.py for the engine, test_vllm_fidelity.py for
vLLM-Lens). Sampled requests are compared in shape and usage only.
"""

import json

import httpx
import numpy as np
import pytest

from acs_client.codec import decode, encode_vector
from acs_client.downloads import HarvestDownload
from api.jobs.models import CompletionJob, HarvestJob
from api.jobs.tasks import completion_job_run_task, harvest_job_run_task
from api.models import LanguageModel
from api.selectors import registry_clear
from api.upstream import map_upstream_error
from infra.lifecycle import WorkStatus
from metering import windows
from metering.models import UsagePeriod
from tests.gateway.conftest import wait_settled
from tests.tolerances import TOLERANCES, greedy_divergence_margins
from testsupport.vllm_lens import MODEL

pytestmark = pytest.mark.django_db(transaction=True)

BOUND = TOLERANCES["bfloat16"]
HIDDEN = 576
RNG = np.random.default_rng(35)
DIRECTION = RNG.normal(size=HIDDEN).astype(np.float32)
DIRECTION /= np.linalg.norm(DIRECTION)


def steering(rows: np.ndarray, layers: list[int], **fields) -> list[dict]:
    return [{"activations": encode_vector(rows), "layer_indices": layers, **fields}]


# The cheatsheet's examples (../shared/reference/api-cheatsheet.txt), for this model: its
# hidden size is 576, its layers 0-29.
CHEATSHEET = {
    "first completion": {"prompt": "The capital of France is", "max_tokens": 8},
    "sampler": {
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["\n"],
    },
    "many completions": {
        "prompt": ["Once upon a time", "The capital of France is"],
        "max_tokens": 16,
        "n": 2,
    },
    "logprobs": {"prompt": "The capital of France is", "max_tokens": 1, "logprobs": 5},
    "prompt logprobs": {
        "prompt": "The capital of France is",
        "max_tokens": 1,
        "prompt_logprobs": 5,
    },
    "full-vocabulary prompt logprobs": {
        "prompt": "The capital of France is",
        "max_tokens": 1,
        "prompt_logprobs": -1,
    },
    "echo": {"prompt": "Once upon a time", "max_tokens": 8, "echo": True},
    "capture": {
        "prompt": "The capital of France is",
        "max_tokens": 1,
        "temperature": 0,
        "output_residual_stream": [15, 20],
    },
    "steering": {
        "prompt": "I think that",
        "max_tokens": 32,
        "temperature": 0,
        "apply_steering_vectors": steering(DIRECTION[None] * 8.0, [16]),
    },
}


def answer_pair(client, models, body: dict) -> tuple[dict, dict]:
    """The same body through the gateway to vLLM-Lens and to the engine: both 200. A greedy
    body is sent with logprobs (2 unless it asks for more): both sides' top 2 tell a near tie."""
    if greedy(body) and (body.get("logprobs") or 0) < 2:
        body = {**body, "logprobs": 2}
    answers = []
    for name in (models["vllm"], models["engine"]):
        response = client.post("/v1/completions", json={"model": name, **body})
        assert response.status_code == 200, (name, response.text)
        answers.append(response.json())
    return answers[0], answers[1]


def greedy(body: dict) -> bool:
    return body.get("temperature") == 0


def assert_same_answer(vllm: dict, engine: dict, body: dict) -> None:
    assert vllm["object"] == engine["object"] == "text_completion"
    assert [c["index"] for c in vllm["choices"]] == [c["index"] for c in engine["choices"]]
    assert vllm["usage"]["prompt_tokens"] == engine["usage"]["prompt_tokens"]
    agreed = None
    for got, expected in zip(vllm["choices"], engine["choices"], strict=True):
        if body.get("echo"):
            prompt = body["prompt"]
            assert got["text"].startswith(prompt) and expected["text"].startswith(prompt)
        assert_same_prompt_logprobs(got.get("prompt_logprobs"), expected.get("prompt_logprobs"))
        if greedy(body):
            agreed = assert_same_generation(got, expected)
        elif body.get("logprobs") is not None:
            assert_same_first_distribution(got["logprobs"], expected["logprobs"])
    if greedy(body) and agreed == len(engine["choices"][0]["logprobs"]["tokens"]):
        assert vllm["usage"]["completion_tokens"] == engine["usage"]["completion_tokens"]
    if "output_residual_stream" in body:
        assert_same_rows(vllm, engine, rows=vllm["usage"]["prompt_tokens"] + agreed)


def assert_same_generation(got: dict, expected: dict) -> int:
    """Greedy tokens equal until the two had a near tie there, told from both sides' top 2
    (both compute in bfloat16, each within the greedy bound of the float32 model); each
    reported logprob of the same token within twice the bound. Returns how many generated
    tokens agree."""
    ours, theirs = got["logprobs"], expected["logprobs"]
    for step, (token, other) in enumerate(zip(ours["tokens"], theirs["tokens"], strict=False)):
        if token != other:
            top = ours["top_logprobs"][step], theirs["top_logprobs"][step]
            margins = greedy_divergence_margins(*top, token, other)
            assert max(margins) <= 2 * BOUND.greedy_margin, (step, token, other, top)
            return step
        if ours["token_logprobs"][step] is None:  # an echoed prompt's first token
            assert theirs["token_logprobs"][step] is None
            continue
        difference = abs(ours["token_logprobs"][step] - theirs["token_logprobs"][step])
        assert difference <= 2 * BOUND.logprob, (step, token, difference)
    assert len(ours["tokens"]) == len(theirs["tokens"])
    return len(ours["tokens"])


def assert_same_first_distribution(ours: dict, theirs: dict) -> None:
    """Sampled tokens differ, but the first one is drawn from the prompt's distribution: its
    top logprobs agree (with echo, those of the prompt's second token, the first listed).
    Entries are keyed by token string; byte-fallback tokens of an unfinished character share
    the key "" on both sides, so such an entry's logprob is whichever came last: not
    compared."""
    first, other = (next(top for top in side["top_logprobs"] if top) for side in (ours, theirs))
    shared = [token for token in first if token in other]
    assert shared, (first, other)
    for token in shared:
        if token:
            assert abs(first[token] - other[token]) <= 2 * BOUND.logprob, (token, first, other)


def assert_same_prompt_logprobs(got, expected) -> None:
    """Entries of the same tokens agree, their names too (a byte-fallback token that decodes
    to part of a character alone is "" on both, or the character its previous tokens
    complete)."""
    if expected is None:
        assert got is None
        return
    assert len(got) == len(expected) and got[0] is None and expected[0] is None
    for ours, theirs in zip(got[1:], expected[1:], strict=True):
        assert ours.keys() & theirs.keys()
        for token in ours.keys() & theirs.keys():
            assert abs(ours[token]["logprob"] - theirs[token]["logprob"]) <= 2 * BOUND.logprob
            assert ours[token]["decoded_token"] == theirs[token]["decoded_token"], token


def assert_same_rows(vllm: dict, engine: dict, *, rows: int, same_shape: bool = True) -> None:
    """The captures' first `rows` positions (those whose tokens agree) within twice the
    bounds of a row and of a layer's median row; the same shape unless the two generated
    different numbers of tokens (`same_shape` False)."""
    ours = decode(vllm["activations"]["residual_stream"])
    theirs = decode(engine["activations"]["residual_stream"])
    assert ours.shape == theirs.shape or not same_shape, (ours.shape, theirs.shape)
    ours, theirs = ours[:, :rows], theirs[:, :rows]
    errors = np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)
    assert np.median(errors, axis=1).max() <= 2 * BOUND.row_median, np.median(errors, axis=1)
    assert errors.max() <= 2 * BOUND.row_max, errors.max()


@pytest.mark.parametrize("example", list(CHEATSHEET))
def test_every_cheatsheet_example_gets_the_engines_answer(client, models, example):
    body = CHEATSHEET[example]
    literal = client.post("/v1/completions", json={"model": models["vllm"], **body})
    assert literal.status_code == 200, literal.text
    vllm, engine = answer_pair(client, models, body)
    assert_same_answer(vllm, engine, body)


def test_a_stream_gets_the_engines_frames(client, models):
    body = {
        "prompt": "Five reasons to learn Rust:\n1.",
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    streams = []
    for name in (models["vllm"], models["engine"]):
        frames = streamed(client, {"model": name, **body})
        assert frames[-1]["choices"] == [] and frames[-1]["model"] == name
        streams.append(frames)
    ours, theirs = (frames[-1]["usage"] for frames in streams)
    assert ours["prompt_tokens"] == theirs["prompt_tokens"]
    vllm, engine = ({"logprobs": streamed_logprobs(frames)} for frames in streams)
    if assert_same_generation(vllm, engine) == len(engine["logprobs"]["tokens"]):
        assert ours["completion_tokens"] == theirs["completion_tokens"]


def stream_answer(client, body: dict) -> tuple[int, list[dict] | dict]:
    """The status of a stream of `body` through the gateway, and its frames up to its [DONE]
    (none an error), or the error body of a refusal."""
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, response.json()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    frames = [json.loads(line[6:]) for line in lines[:-1]]
    assert not any("error" in frame for frame in frames), frames
    return 200, frames


def streamed(client, body: dict) -> list[dict]:
    """The frames of a stream of `body` that must be answered 200."""
    status, frames = stream_answer(client, body)
    assert status == 200, frames
    return frames


def streamed_logprobs(frames: list[dict]) -> dict:
    """A stream's logprobs, its frames' put together as a non-streamed answer has them."""
    fields = ("tokens", "token_logprobs", "top_logprobs")
    joined = {field: [] for field in fields}
    for frame in frames:
        for choice in frame["choices"]:
            for field in fields:
                joined[field] += choice["logprobs"][field]
    return joined


def test_a_capture_comes_back_in_the_requests_layer_order_and_counts_one_activation(
    client, models, api_key
):
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    vllm, engine = answer_pair(client, models, {**body, "output_residual_stream": [20, 7]})
    assert_same_answer(vllm, engine, {**body, "output_residual_stream": [20, 7]})
    ascending, _ = answer_pair(client, models, {**body, "output_residual_stream": [7, 20]})
    rows, reordered = (decode(a["activations"]["residual_stream"]) for a in (vllm, ascending))
    np.testing.assert_array_equal(rows, reordered[::-1])
    assert rows.shape == (2, 5 + 3 - 1, HIDDEN)
    wait_settled()
    month = UsagePeriod.objects.get(key=api_key, period=windows.MONTH.name)
    assert month.activation_requests == 4


@pytest.mark.parametrize(
    "vectors",
    [
        pytest.param(steering(DIRECTION[None] * 6.0, [10], scale=2.0), id="add"),
        pytest.param(steering(DIRECTION[None], [12], scale=1.0, norm_match=True), id="norm_match"),
        pytest.param(
            steering(np.stack([DIRECTION, -DIRECTION])[None] * 20.0, [5], position_indices=[2, 4]),
            id="3-D positions",
        ),
        pytest.param(
            steering(DIRECTION[None] * 20.0, [5], position_indices=[2, 4]),
            id="2-D positions",
        ),
    ],
)
def test_a_steered_run_gets_the_engines_answer(client, models, vectors):
    body = {
        "prompt": "My favourite recipe is for a cake that",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 2,
        "output_residual_stream": [5, 12, 29],
        "apply_steering_vectors": vectors,
    }
    vllm, engine = answer_pair(client, models, body)
    assert_same_answer(vllm, engine, body)
    plain, _ = answer_pair(
        client, models, {k: v for k, v in body.items() if k != "apply_steering_vectors"}
    )
    moved = decode(vllm["activations"]["residual_stream"]) - decode(
        plain["activations"]["residual_stream"]
    )
    assert np.abs(moved).max() > 1.0, "the steering was applied"


def test_steering_that_would_overflow_never_reaches_vllm_lens(client, models):
    """An infinite residual value left NaN in vLLM-Lens's KV cache, and every later request
    of anyone failed ("Out of range float values are not JSON compliant") until a restart:
    the gateway refuses it, and vLLM-Lens serves the next request."""
    overflow = steering(np.full((1, HIDDEN), 3e38, np.float32), [5], scale=1e30)
    body = {"prompt": "Hello there", "max_tokens": 4, "apply_steering_vectors": overflow}
    response = client.post("/v1/completions", json={"model": models["vllm"], **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    plain = {"model": models["vllm"], "prompt": "Hello there", "max_tokens": 4}
    assert client.post("/v1/completions", json=plain).status_code == 200


def test_a_completion_job_run_by_the_worker_gets_the_engines_result(client, models, sent_tasks):
    body = {"prompt": "Hello", "max_tokens": 16, "temperature": 0, "logprobs": 2}
    results = []
    for name in (models["vllm"], models["engine"]):
        submitted = client.post(
            "/v1/completion-jobs",
            json={"model": name, **body},
            headers={"Idempotency-Key": f"job-{name}"},
        )
        assert submitted.status_code in (200, 201, 202), submitted.text
        job_id = submitted.json()["id"]
        completion_job_run_task.apply(args=[job_id])
        job = CompletionJob.objects.get(pk=job_id)
        assert job.status == "succeeded", (job.error, job.result_body)
        result = client.get(f"/v1/completion-jobs/{job_id}/result")
        assert result.status_code == 200
        results.append(result.json())
    assert_same_answer(results[0], results[1], body)


def test_a_harvest_run_by_the_worker_gets_the_engines_rows_in_the_requests_order(
    client, models, sent_tasks, tmp_path, settings
):
    settings.MEDIA_ROOT = tmp_path / "media"
    prompts = ["The quick brown fox jumps over the lazy dog.", "Paris"]
    harvested = []
    for name in (models["vllm"], models["engine"]):
        submitted = client.post(
            "/v1/harvest", json={"model": name, "prompts": prompts, "layers": [15, 7]}
        )
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["job_id"]
        harvest_job_run_task.apply(args=[job_id])
        job = HarvestJob.objects.get(pk=job_id)
        assert job.status == WorkStatus.SUCCEEDED, job.error
        download = HarvestDownload.open(settings.MEDIA_ROOT / job.storage_prefix)
        assert download.manifest["layers"] == [15, 7]
        harvested.append(download.captures())
    for ours, theirs in zip(*harvested, strict=True):
        assert ours.token_ids.tolist() == theirs.token_ids.tolist()
        tokens = len(ours.token_ids)
        assert ours.activations.shape == theirs.activations.shape == (2, tokens, HIDDEN)
        for layer in (15, 7):
            got, expected = ours.layer(layer), theirs.layer(layer)
            errors = np.linalg.norm(got - expected, axis=-1) / np.linalg.norm(expected, axis=-1)
            assert np.median(errors) <= 2 * BOUND.row_median, (layer, np.median(errors))
            assert errors.max() <= 2 * BOUND.row_max, (layer, errors.max())


def test_vllm_context_refusals_are_vllm_context_length(client, models, vllm_lens):
    """A row that says the model takes more than vLLM serves (--max-model-len): the gateway's
    own check passes, and vLLM's refusals come back with the contract's code."""
    LanguageModel.objects.filter(name=models["vllm"]).update(max_model_len=16_384)
    registry_clear()
    for body in (
        {"prompt": "Hello", "max_tokens": 9_000},
        {"prompt": "hello " * 8_200, "max_tokens": 1},
    ):
        response = client.post("/v1/completions", json={"model": models["vllm"], **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "vllm_context_length"
        assert "8192" in error["message"]


@pytest.mark.parametrize(
    "fields, code",
    [
        ({"temperature": 1e9}, "vllm_invalid_request"),
        ({"stop": [""]}, "vllm_invalid_request"),
        ({"prompt_logprobs": 1, "stream": True}, "vllm_invalid_request"),
        ({"prompt": "hello " * 8_200}, "vllm_context_length"),
    ],
)
def test_vllms_own_error_bodies_map_to_the_contracts_codes(vllm_lens, fields, code):
    """vLLM's real 400 bodies (`{"error": {"code": 400, "type": "BadRequestError", ...}}`),
    as the gateway reads any it relays. The gateway refuses these requests itself first."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}
    answer = httpx.post(
        f"{vllm_lens.url}/v1/completions", json=body, headers=vllm_lens.headers(), timeout=60
    )
    assert answer.status_code == 400, answer.text
    error = map_upstream_error(answer.status_code, answer.content, answer.headers)
    assert (error.status, error.code) == (400, code)
    assert error.message == answer.json()["error"]["message"]


def test_token_ids_are_the_engines_as_vllm_returns_them(client, models, vllm_lens):
    """vLLM's own `return_token_ids`, which the playground labels every token from: the
    engine answers it the same way (prompt ids, generated ids). With echo, vLLM leaves the
    prompt out of `text` and of `token_ids`, where echo promises it in front: the gateway
    refuses the pair for every upstream."""
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    vllm, engine = answer_pair(client, models, body)
    ours, theirs = vllm["choices"][0], engine["choices"][0]
    assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
    agreed = assert_same_generation(ours, theirs)
    assert ours["token_ids"][:agreed] == theirs["token_ids"][:agreed]
    assert len(ours["token_ids"]) == len(theirs["token_ids"]) == 4
    echoed = {**body, "model": MODEL, "logprobs": None, "echo": True}
    direct = httpx.post(
        f"{vllm_lens.url}/v1/completions", json=echoed, headers=vllm_lens.headers(), timeout=60
    ).json()["choices"][0]
    assert not direct["text"].startswith(body["prompt"])
    assert direct["token_ids"] == ours["token_ids"]
    for model in models.values():
        refused = client.post("/v1/completions", json={**echoed, "model": model})
        assert refused.status_code == 400
        assert "'echo' with 'return_token_ids'" in refused.json()["error"]["message"]
