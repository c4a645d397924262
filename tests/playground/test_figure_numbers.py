"""Every number the run, comparison and sweep pages draw, recomputed from the raw /v1
responses with numpy and compared with the figure data the pages embed.

The runs go through the real path: the worker (in this process) sends them with the user's
playground key to the live gateway in front of the real embedded engine; a recording
transport keeps every raw request and response. The expected numbers are computed here from
those raw bodies alone (base64 + zstd + bit shifts for the activations, the engine's own
tokenizer.json for the prompt's tokens), never with `playground.figures` or `scoring`.
"""

import base64
import csv
import html
import io
import json
import re
import subprocess
import sys

import httpx
import numpy as np
import pytest
import zstandard
from django.urls import reverse
from tokenizers import Tokenizer

from accounts.services.playground_key import playground_key_get_or_create
from acs_client.client import AcsClient
from acs_client.downloads import load_activations
from acs_portal.celery import app as celery_app
from api.models import LanguageModel
from api.selectors import registry_clear
from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind, SteeringScore
from playground.runs import views
from playground.runs.execution import run_execute
from playground.runs.services import run_create
from playground.steering.services import steering_runs_create, steering_score_execute
from playground.vectors.services import contrast_runs_create, steering_vector_create
from tests.conftest import ENGINE_MODEL_FIELDS
from tests.gateway.conftest import wait_settled
from tests.tolerances import WIDEST

from .conftest import workers_client

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "smollm2-135m"
# 9 prompt tokens, none merged across words.
PROMPT = "The quick brown fox jumps over the lazy dog"
MODEL_ENTRY = {
    "id": MODEL,
    "object": "model",
    "status": "live",
    "capabilities": {
        "max_model_len": 8192, "max_logprobs": 20, "full_vocab_max_prompt_tokens": 256,
        "activations": True, "n_layers": 30, "hidden_size": 576, "max_steering_vectors": 8,
    },
}  # fmt: skip


class Recorder(httpx.BaseTransport):
    """An HTTP transport that keeps every JSON request and response it carries."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.exchanges: list[tuple[dict, dict]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()
        if request.content:
            self.exchanges.append((json.loads(request.content), json.loads(response.content)))
        return response

    def answer_to(self, body: dict) -> dict:
        """The answer to `body`, sent as it is or, as every run sends it, asking for its
        tokens' ids."""
        asked = [body, {**body, "return_token_ids": True}]
        matches = [answer for sent, answer in self.exchanges if sent in asked]
        assert len(matches) == 1, f"{len(matches)} requests sent with {body}"
        return matches[0]


@pytest.fixture
def science(engine_url, gateway_url, approved_user, settings, redis_client, monkeypatch):
    LanguageModel.objects.all().delete()
    LanguageModel.objects.create(
        name=MODEL, upstream_urls=[engine_url], **ENGINE_MODEL_FIELDS, max_logprobs=20,
        is_default=True,
    )  # fmt: skip
    registry_clear()
    settings.GATEWAY_URL = gateway_url
    recorder = Recorder()
    workers_client(monkeypatch, recorder)
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL_ENTRY])
    queued = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args, **_: queued.append(args[0]))
    tokenizer = Tokenizer.from_str(httpx.get(f"{engine_url}/tokenizer.json").text)
    yield recorder, tokenizer
    wait_settled()
    registry_clear()


@pytest.fixture
def page_client(client, approved_user):
    client.force_login(approved_user)
    return client


# ---------------------------------------------------------------------------------------
# Independent helpers: nothing here calls the playground's code


def residual_stream(response: dict) -> np.ndarray:
    """The capture as float32 `[layers, tokens, hidden]`, decoded from the wire by hand."""
    wire = response["activations"]["residual_stream"]
    raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(wire["data"]))
    words = np.frombuffer(raw, dtype="<u2").reshape(wire["shape"])
    return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def shown(token: str) -> str:
    """A token as the pages show it: whitespace made visible, then HTML-escaped."""
    visible = token.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "·") or "∅"
    return html.escape(visible, quote=False)


def prompt_pieces(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[str]]:
    """The prompt's token ids and each token's text, cut from the prompt by its offsets."""
    encoding = tokenizer.encode(text, add_special_tokens=True)
    return encoding.ids, [text[start:end] for start, end in encoding.offsets]


def embedded(page: str) -> dict[str, dict]:
    """The figures a page embeds (json_script), by name."""
    scripts = re.findall(r'<script id="([^"]+)" type="application/json">(.*?)</script>', page, re.S)
    return {name: json.loads(content) for name, content in scripts}


def figure_of(response) -> dict:
    figures = embedded(response.content.decode())
    assert len(figures) == 1
    return next(iter(figures.values()))


def run_through(user, request: dict) -> Run:
    run = run_create(user=user, request=request)
    run = run_execute(run_id=run.id)
    assert run.status == WorkStatus.SUCCEEDED, (run.error_code, run.error_message)
    return run


def close(actual, expected, tolerance=1e-4):
    return np.allclose(np.asarray(actual, dtype=np.float64), expected, rtol=tolerance, atol=1e-6)


def pca(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates on the first two principal components and their variance shares, from the
    eigenvectors of the covariance (not an SVD of the data, as the page computes it)."""
    centred = rows - rows.mean(axis=0)
    values, vectors = np.linalg.eigh(centred.T @ centred)
    order = np.argsort(values)[::-1]
    values, vectors = values[order], vectors[:, order]
    return centred @ vectors[:, :2], values[:2] / values.sum()


# ---------------------------------------------------------------------------------------
# A capture run without echo or prompt_logprobs


CAPTURE = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 4,
           "output_residual_stream": True}  # fmt: skip


@pytest.fixture
def capture(science, approved_user):
    """A capture run of every layer, its raw answer, the capture decoded by hand, and the
    label every position must have: "index token", from the engine's tokenizer for the
    prompt and from the answer's logprobs for the generated tokens fed back."""
    recorder, tokenizer = science
    run = run_through(approved_user, CAPTURE)
    raw = recorder.answer_to(CAPTURE)
    tensor = residual_stream(raw)
    prompt_ids, prompt_texts = prompt_pieces(tokenizer, PROMPT)
    generated = raw["choices"][0]["logprobs"]["tokens"]
    assert len(prompt_ids) == raw["usage"]["prompt_tokens"] == 9
    # Rows: the 9 prompt tokens, then the generated tokens fed back but the last.
    assert tensor.shape[1] == 9 + 5 - 1
    labels = [f"{row} {shown(token)}" for row, token in enumerate(prompt_texts + generated[:-1])]
    return run, raw, tensor, labels


def test_capture_positions_are_labelled_with_their_tokens_without_echo(capture, page_client):
    run, _, _, labels = capture
    url = reverse("playground:run_figure", args=[run.id, "heatmap"])
    everything = figure_of(page_client.get(url + "?first=include"))
    assert everything["layout"]["xaxis"]["ticktext"] == labels
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    figures = embedded(page)
    assert figures["heatmap"]["layout"]["xaxis"]["ticktext"] == labels[1:]
    assert figures["cosine"]["layout"]["yaxis"]["ticktext"] == labels[1:]
    assert figures["pca"]["data"][0]["text"] == labels[1:]
    assert figures["norm_by_layer"]["layout"]["title"]["text"].endswith(labels[-1])
    # The position lists show the same labels as the figures.
    for label in labels:
        assert f">{label}</option>" in page


def test_norm_heatmap_numbers_match_numpy(capture, page_client):
    run, _, tensor, _ = capture
    norms = np.linalg.norm(tensor, axis=-1)
    url = reverse("playground:run_figure", args=[run.id, "heatmap"])
    # Clipped at the 95th percentile: both ends of the colour range are set (plotly ignores
    # a zmax without a zmin).
    everything = figure_of(page_client.get(url + "?colour=clip&first=include"))["data"][0]
    assert close(everything["z"], norms)
    assert close([everything["zmin"], everything["zmax"]], [norms.min(), np.percentile(norms, 95)])
    shown_norms = norms[:, 1:]
    clip = figure_of(page_client.get(url + "?colour=clip"))["data"][0]
    assert close([clip["zmin"], clip["zmax"]], [shown_norms.min(), np.percentile(shown_norms, 95)])
    log = figure_of(page_client.get(url + "?colour=log"))["data"][0]
    assert close(log["z"], np.log10(shown_norms))
    linear = figure_of(page_client.get(url))["data"][0]
    assert close(linear["z"], shown_norms) and "zmin" not in linear and "zmax" not in linear
    # Hover shows the norm itself whatever the colours.
    assert close(log["customdata"], shown_norms)
    # Norm by layer at the last position (the default), and at the first.
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    line = embedded(page)["norm_by_layer"]["data"][0]
    assert line["x"] == list(range(30)) and close(line["y"], norms[:, -1])
    url = reverse("playground:run_figure", args=[run.id, "norm_by_layer"])
    first = figure_of(page_client.get(url + "?norm_position=0"))
    assert close(first["data"][0]["y"], norms[:, 0])


def test_activation_views_leave_out_the_first_token_by_default(capture, page_client):
    run, _, tensor, labels = capture
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    figures = embedded(page)
    assert figures["heatmap"]["data"][0]["x"] == list(range(1, 13))
    assert "positions 1–12 (first token excluded)" in figures["heatmap"]["layout"]["title"]["text"]
    assert "leave out position 0" in page
    url = reverse("playground:run_figure", args=[run.id, "heatmap"])
    window = figure_of(page_client.get(url + "?start=3&end=9"))
    assert window["data"][0]["x"] == list(range(3, 10))
    assert window["layout"]["xaxis"]["ticktext"] == labels[3:10]

    def cosine(rows):
        unit = rows / np.linalg.norm(rows, axis=-1, keepdims=True)
        return unit @ unit.T

    assert close(figures["cosine"]["data"][0]["z"], cosine(tensor[0, 1:]), 1e-3)
    url = reverse("playground:run_figure", args=[run.id, "cosine"])
    layer_20 = figure_of(page_client.get(url + "?cosine_row=20&first=include"))["data"][0]
    assert close(layer_20["z"], cosine(tensor[20]), 1e-3)

    url = reverse("playground:run_figure", args=[run.id, "pca"])
    for query, rows, texts in (
        ("", tensor[24, 1:], labels[1:]),
        ("&first=include", tensor[24], labels),
    ):
        figure = figure_of(page_client.get(url + "?pca_row=24" + query))
        coordinates, share = pca(rows)
        drawn = np.column_stack([figure["data"][0]["x"], figure["data"][0]["y"]])
        # Principal components are defined up to their sign.
        assert close(np.abs(drawn), np.abs(coordinates), 1e-3)
        assert figure["layout"]["xaxis"]["title"]["text"].startswith(f"PC1 ({share[0]:.0%}")
        assert figure["layout"]["yaxis"]["title"]["text"].startswith(f"PC2 ({share[1]:.0%}")
        assert figure["data"][0]["text"] == texts
    # With the first token, it alone is the first component (an attention sink).
    assert pca(tensor[24])[1][0] > 0.9 > pca(tensor[24, 1:])[1][0]


def test_token_view_and_top_k_numbers_match_numpy(capture, page_client, science):
    run, raw, _, _ = capture
    _, tokenizer = science
    _, prompt_texts = prompt_pieces(tokenizer, PROMPT)
    figures = embedded(
        page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    )
    generated = raw["choices"][0]["logprobs"]["tokens"]
    logprobs = raw["choices"][0]["logprobs"]["token_logprobs"]
    # The prompt's tokens (unscored: no prompt_logprobs were asked for), then the generated
    # tokens coloured by probability; positions count from the prompt's first token.
    strip = figures["tokens"]
    assert strip["layout"]["yaxis"]["ticktext"] == ["prompt #0–8", "completion #9–13"]
    assert strip["data"][0]["text"][0][:9] == [shown(text) for text in prompt_texts]
    assert strip["data"][0]["z"][0][:9] == [None] * 9
    assert close(strip["data"][0]["z"][1][:5], np.exp(logprobs))
    assert strip["data"][0]["text"][1][:5] == [shown(token) for token in generated]
    # Top-k at the last position: the 4 asked for, then the token itself when not among them.
    top = raw["choices"][0]["logprobs"]["top_logprobs"][-1]
    # Equally likely alternatives (bfloat16 ties) by token text, as the page promises.
    best = sorted(top.items(), key=lambda item: (-item[1], item[0]))[:4]
    if generated[-1] not in dict(best):
        best.append((generated[-1], logprobs[-1]))
    bars = figures["topk"]["data"][0]
    assert bars["y"] == [shown(token) for token, _ in best]
    assert close(bars["x"], np.exp([logprob for _, logprob in best]))
    assert figures["topk"]["layout"]["title"]["text"].startswith(
        f"Top-4 at position 13 ({shown(generated[-1])})"
    )


def run_notebook(code: str, *, user, gateway_url: str, monkeypatch) -> dict:
    """Run a page's acs_client code against the live gateway with the user's key; its
    variables."""
    _, secret = playground_key_get_or_create(user=user)
    monkeypatch.setattr(
        "acs_client.client.AcsClient",
        lambda base_url, api_key: AcsClient(base_url=gateway_url, api_key=secret),
    )
    monkeypatch.setenv("ACS_API_KEY", "unused")
    namespace = {}
    exec(compile(html.unescape(code), "notebook", "exec"), namespace)
    return namespace


def test_prompt_logprobs_page_numbers_match_numpy(
    science, approved_user, page_client, gateway_url, monkeypatch
):
    recorder, tokenizer = science
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
               "logprobs": 2, "prompt_logprobs": 3}  # fmt: skip
    run = run_through(approved_user, request)
    raw = recorder.answer_to(request)
    prompt_ids, prompt_texts = prompt_pieces(tokenizer, PROMPT)
    entries = raw["choices"][0]["prompt_logprobs"]
    actual = [entries[t][str(prompt_ids[t])]["logprob"] for t in range(1, len(prompt_ids))]
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    figures = embedded(page)
    # The page's acs_client code sends the request again and reads the same numbers.
    code = re.search(rf'<pre id="snippet-acs_client-{run.id}">(.*?)</pre>', page, re.S).group(1)
    notebook = run_notebook(
        code, user=approved_user, gateway_url=gateway_url, monkeypatch=monkeypatch
    )
    assert np.allclose(notebook["surprisal"], -np.asarray(actual), atol=0.05)
    assert np.allclose(
        notebook["probabilities"],
        np.exp(raw["choices"][0]["logprobs"]["token_logprobs"]),
        atol=0.02,
    )
    surprisal = figures["surprisal"]["data"][0]
    assert surprisal["x"] == list(range(1, 9)) and close(surprisal["y"], -np.asarray(actual))
    assert surprisal["text"] == [shown(text) for text in prompt_texts[1:]]
    strip = figures["tokens"]["data"][0]
    assert strip["z"][0][0] is None and close(strip["z"][0][1:9], np.exp(actual))
    assert strip["text"][0][:9] == [shown(text) for text in prompt_texts]
    # Top-k of a prompt position: the 3 asked for, then the token itself (rank r) if outside.
    url = reverse("playground:run_figure", args=[run.id, "topk"])
    for position in range(1, 9):
        figure = figure_of(page_client.get(url + f"?position={position}"))
        entry = entries[position]
        own = entry[str(prompt_ids[position])]
        others = [item for key, item in entry.items() if key != str(prompt_ids[position])]
        title = f"Top-3 at position {position} ({shown(prompt_texts[position])})"
        best = sorted(entry.values(), key=lambda item: item["rank"])[:3]
        if len(entry) > 3:  # the API added the token itself to the 3 asked for
            best = [*sorted(others, key=lambda item: item["rank"]), own]
            title += f", and the token itself (rank {own['rank']})"
        assert figure["layout"]["title"]["text"] == title
        assert close(figure["data"][0]["x"], np.exp([item["logprob"] for item in best]))


# ---------------------------------------------------------------------------------------
# Steering: a comparison and a sweep, compared on the same tokens


def sampled_ids(tokenizer: Tokenizer, response: dict, choice: int = 0) -> list[int]:
    """The sampled tokens' ids: the completion text re-encoded, checked token by token
    against the tokens its logprobs name (so they are the sampled ones)."""
    tokens = response["choices"][choice]["logprobs"]["tokens"]
    ids = tokenizer.encode("".join(tokens), add_special_tokens=False).ids
    assert_named(tokenizer, ids, tokens)
    return ids


def assert_named(tokenizer: Tokenizer, ids: list[int], names: list[str]) -> None:
    """`names` (an answer's logprobs tokens) name `ids`: one each, and together the ids' text
    less the bytes of a character they leave unfinished, which no name holds (a byte token
    of an unfinished character is named "", as vLLM names it)."""
    assert len(ids) == len(names)
    assert "".join(names) == tokenizer.decode(ids, skip_special_tokens=False).rstrip("\ufffd")


def full_vocabulary(entry: dict) -> np.ndarray:
    logprobs = np.full(len(entry), -np.inf)
    for token_id, item in entry.items():
        logprobs[int(token_id)] = item["logprob"]
    return logprobs


def same_tokens(recorder, tokenizer, steered_request, steered_raw, *, prompt_ids, base_ids):
    """Δ logprob on the baseline's and the steered tokens, and KL(baseline ‖ steered) per
    baseline position, from the raw teacher-forced answers."""
    first = len(prompt_ids)
    base_prompt = prompt_ids + base_ids
    steering = steered_request["apply_steering_vectors"]
    plain = {"model": MODEL, "max_tokens": 1, "temperature": 0}
    c = recorder.answer_to({**plain, "prompt": base_prompt, "prompt_logprobs": -1})
    a = recorder.answer_to({**plain, "prompt": base_prompt, "prompt_logprobs": -1,
                            "apply_steering_vectors": steering})  # fmt: skip
    # The steered run's own tokens, scored under its own model: the ids sent must be the
    # sampled tokens (the same strings, and the logprobs the run reported).
    [(d_sent, d)] = [
        (sent, answer) for sent, answer in recorder.exchanges
        if sent.get("apply_steering_vectors") == steering and sent.get("prompt_logprobs") == 0
        and sent["prompt"][:first] == prompt_ids
    ]  # fmt: skip
    steered_ids = d_sent["prompt"][first:]
    sampled = steered_raw["choices"][0]["logprobs"]
    assert_named(tokenizer, steered_ids, sampled["tokens"])
    own = [d["choices"][0]["prompt_logprobs"][first + j][str(t)]["logprob"]
           for j, t in enumerate(steered_ids)]  # fmt: skip
    # Teacher-forced (one prefill) against sampled (token by token): bfloat16 kernels of
    # different shapes, each within the bfloat16 bound of the float32 model (up to ~0.15
    # nats apart on an AMX CPU).
    assert np.allclose(own, sampled["token_logprobs"], atol=2 * WIDEST.logprob)
    [b_choice] = [
        choice
        for sent, answer in recorder.exchanges
        if "apply_steering_vectors" not in sent and isinstance(sent["prompt"][0], list)
        for prompt, choice in zip(sent["prompt"], answer["choices"], strict=True)
        if prompt == prompt_ids + steered_ids
    ]

    def at(answer_choice, ids):
        entries = answer_choice["prompt_logprobs"]
        return np.asarray([entries[first + j][str(t)]["logprob"] for j, t in enumerate(ids)])

    base_delta = at(a["choices"][0], base_ids) - at(c["choices"][0], base_ids)
    own_delta = at(d["choices"][0], steered_ids) - at(b_choice, steered_ids)
    kl = []
    for j in range(len(base_ids)):
        p = full_vocabulary(c["choices"][0]["prompt_logprobs"][first + j])
        q = full_vocabulary(a["choices"][0]["prompt_logprobs"][first + j])
        kl.append(float(np.sum(np.exp(p) * (p - q))))
    return base_delta, own_delta, np.asarray(kl)


def steer(user, *, prompt, scales, kind, target=""):
    rng = np.random.default_rng(0)
    vector = steering_vector_create(
        user=user, name="noise", model=MODEL, layer=6, method="upload",
        vector=(rng.standard_normal(576) * 2).astype(np.float32), details={"filename": "n.npy"},
    )  # fmt: skip
    group = steering_runs_create(
        user=user,
        base_request={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                      "seed": 0, "logprobs": 2},
        vector=vector, layers=[6], scales=scales, kind=kind, target_token=target,
    )  # fmt: skip
    for run in Run.objects.filter(group=group):
        run_execute(run_id=run.id)
    score = SteeringScore.objects.get(group=group)
    score = steering_score_execute(score_id=score.pk)
    assert score.status == WorkStatus.SUCCEEDED, (score.error_code, score.error_message)
    return group, sorted(Run.objects.filter(group=group), key=lambda run: run.scale)


def test_steering_comparison_numbers_are_on_the_same_tokens(science, approved_user, page_client):
    recorder, tokenizer = science
    group, (baseline, steered) = steer(
        approved_user, prompt="I feel", scales=[16.0], kind=RunKind.STEERING_STEERED
    )
    prompt_ids, _ = prompt_pieces(tokenizer, "I feel")
    base_raw = recorder.answer_to(baseline.request)
    steered_raw = recorder.answer_to(steered.request)
    base_ids = sampled_ids(tokenizer, base_raw)
    assert base_raw["choices"][0]["text"] != steered_raw["choices"][0]["text"]
    base_delta, own_delta, kl = same_tokens(
        recorder, tokenizer, steered.request, steered_raw, prompt_ids=prompt_ids,
        base_ids=base_ids,
    )  # fmt: skip
    page = page_client.get(reverse("playground:group_detail", args=[group])).content.decode()
    figure = embedded(page)["diff-16"]
    on_base, on_steered, divergence = figure["data"]
    assert close(on_base["y"], base_delta, 1e-6) and close(on_steered["y"], own_delta, 1e-6)
    assert close(divergence["y"], kl, 1e-6) and divergence["yaxis"] == "y2"
    assert (kl >= -1e-9).all() and kl.max() > 0
    assert "nats" in figure["layout"]["yaxis"]["title"]["text"]
    assert figure["layout"]["yaxis2"]["title"]["text"] == "KL(baseline ‖ steered) (nats)"
    # The means on the steered card, in nats per token, over the generated tokens (the
    # comparison page's definition).
    for value in (base_delta.mean(), own_delta.mean(), kl.mean()):
        assert f"{value:.3f} nats/token" in page
    assert "the mean of Δ logprob over the generated tokens only" in page


def test_sweep_numbers_downloads_and_notebook_code_match_numpy(
    science, approved_user, page_client, gateway_url, monkeypatch, tmp_path
):
    recorder, tokenizer = science
    group, runs = steer(
        approved_user, prompt="I feel", scales=[-12.0, 12.0], kind=RunKind.SWEEP, target=" happy"
    )
    prompt_ids, _ = prompt_pieces(tokenizer, "I feel")
    target_ids = tokenizer.encode("I feel happy", add_special_tokens=True).ids[len(prompt_ids) :]
    baseline = next(run for run in runs if run.scale == 0)
    base_ids = sampled_ids(tokenizer, recorder.answer_to(baseline.request))
    expected = {}
    for run in runs:
        raw = recorder.answer_to(run.request)
        scored = raw["choices"][1]["prompt_logprobs"]
        target = sum(
            scored[len(prompt_ids) + j][str(t)]["logprob"] for j, t in enumerate(target_ids)
        )
        if run.scale == 0:
            expected[0.0] = (target, 0.0, 0.0)
            continue
        base_delta, _, kl = same_tokens(
            recorder, tokenizer, run.request, raw, prompt_ids=prompt_ids, base_ids=base_ids
        )
        expected[run.scale] = (target, base_delta.mean(), kl.mean())
    figure = embedded(
        page_client.get(reverse("playground:group_detail", args=[group])).content.decode()
    )["sweep"]
    traces = {trace["name"]: trace for trace in figure["data"]}
    scales = sorted(expected)
    target = traces["logprob of ·happy (left)"]
    assert target["x"] == scales and close(target["y"], [expected[s][0] for s in scales], 1e-6)
    shift = traces["mean Δ logprob, baseline's tokens (right)"]
    assert shift["x"] == scales and close(shift["y"], [expected[s][1] for s in scales], 1e-6)
    divergence = traces["mean KL(baseline ‖ steered) (right)"]
    assert close(divergence["y"], [expected[s][2] for s in scales], 1e-6)
    assert figure["layout"]["yaxis2"]["title"]["text"] == "nats per token, same tokens"

    # The downloads hold the same numbers, per arm, with the runs and their request ids.
    document = page_client.get(reverse("playground:group_json", args=[group])).json()
    rows = list(csv.DictReader(io.StringIO(
        page_client.get(reverse("playground:group_csv", args=[group])).content.decode()
    )))  # fmt: skip
    assert [arm["scale_entered"] for arm in document["arms"]] == scales
    assert [float(row["scale_entered"]) for row in rows] == scales
    for arm, row, run in zip(document["arms"], rows, runs, strict=True):
        target, delta, kl = expected[run.scale]
        assert (arm["run"], row["run"], arm["request_id"]) == (
            str(run.pk),
            str(run.pk),
            run.request_id,
        )
        assert close(arm["target_logprob"], target, 1e-9)
        assert close(float(row["target_logprob"]), target, 1e-9)
        if run.scale:
            assert close([arm["mean_delta_baseline_tokens"], arm["mean_kl"]], [delta, kl], 1e-9)
            assert close(float(row["mean_delta_baseline_tokens"]), delta, 1e-9)
        assert arm["text"] == recorder.answer_to(run.request)["choices"][0]["text"]
    assert "over the generated tokens only" in document["definitions"]["mean_delta"]

    # The page's acs_client code, run against the live gateway with the user's key, gives
    # each scale's text, target logprob and mean Δ logprob, within twice the bfloat16 bound
    # (both runs compute in bfloat16, in batches of other shapes, each within one bound of the
    # float32 model; beside a CPU hog a target logprob of -12 moved by 0.66).
    bound = 2 * WIDEST.logprob
    page = page_client.get(reverse("playground:group_detail", args=[group])).content.decode()
    code = re.search(r'<pre id="notebook-[^"]+">(.*?)</pre>', page, re.S).group(1)
    vector = runs[0].vector
    download = page_client.get(reverse("playground:vector_download", args=[vector.pk]))
    (tmp_path / f"vector-{vector.pk}.npy").write_bytes(download.content)
    monkeypatch.chdir(tmp_path)
    namespace = run_notebook(
        code, user=approved_user, gateway_url=gateway_url, monkeypatch=monkeypatch
    )
    for run in runs:
        if not run.scale:
            continue
        result = namespace["results"][run.scale_entered]
        target, delta, _ = expected[run.scale]
        assert result["text"] == run.response["choices"][0]["text"]
        assert abs(result["target_logprob"] - target) <= bound
        assert abs(result["mean_delta_baseline_tokens"] - delta) <= bound


# ---------------------------------------------------------------------------------------
# The typical layer norm of a contrast vector


def test_typical_norm_is_the_median_over_reference_positions_after_the_first(
    science, approved_user, page_client
):
    recorder, _ = science
    group = contrast_runs_create(
        user=approved_user, model=MODEL, name="mood", layer=12, method="contrast_last",
        positive="Joy, delight, happiness", negative="Grief, sorrow, sadness",
    )  # fmt: skip
    for run in Run.objects.filter(group=group):
        run_execute(run_id=run.id)
    references = [
        residual_stream(recorder.answer_to(run.request))[0]
        for run in Run.objects.filter(group=group, meta__role="reference")
    ]
    assert len(references) == 4
    expected = float(np.median(np.linalg.norm(np.concatenate([r[1:] for r in references]), axis=1)))
    # What the old definition gave: the mean over every position, the first included.
    inflated = float(np.mean([np.linalg.norm(r, axis=1).mean() for r in references]))
    assert inflated > 3 * expected
    vector = approved_user.steering_vectors.get()
    assert vector.layer_typical_norm == pytest.approx(expected, rel=1e-5)
    page = page_client.get(reverse("playground:page")).content.decode()
    assert f"{expected:.2f}</td>" in page  # the library
    assert f"mood (layer 12): {expected:.2f}" in page  # next to the scales


# ---------------------------------------------------------------------------------------
# The run's download


def test_run_download_holds_the_capture_with_its_tokens_for_the_loader(
    science, approved_user, page_client, tmp_path
):
    recorder, tokenizer = science
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
               "output_residual_stream": [3, 17]}  # fmt: skip
    run = run_through(approved_user, request)
    raw = recorder.answer_to(request)
    prompt_ids, prompt_texts = prompt_pieces(tokenizer, PROMPT)
    # No logprobs were asked for: the generated tokens are the ids the answer names (the
    # run asks for them), each decoded alone; not the returned text encoded again.
    generated = raw["choices"][0]["token_ids"]
    assert tokenizer.decode(generated) == raw["choices"][0]["text"]
    download = page_client.get(reverse("playground:run_activations", args=[run.id]))
    assert download["Content-Disposition"].endswith('-activations.safetensors"')
    path = tmp_path / "run.safetensors"
    path.write_bytes(download.content)
    loaded = load_activations(path)
    assert (loaded.model, loaded.layers, loaded.metadata["kind"]) == (MODEL, [3, 17], "run")
    assert loaded.metadata["capture"] == "output of decoder block k, before the final norm"
    assert loaded.metadata["run_id"] == str(run.id) and loaded.steering == []
    [capture] = loaded.captures
    assert np.array_equal(capture.activations, residual_stream(raw).astype(np.float32))
    assert capture.request_id == run.request_id != ""
    assert capture.prompt_length == 9 and capture.is_prompt.tolist() == [True] * 9 + [False] * 3
    assert capture.token_ids.tolist() == prompt_ids + generated[:3]
    assert capture.token_strings == prompt_texts + [
        tokenizer.decode([token], skip_special_tokens=False) for token in generated[:3]
    ]
    assert np.array_equal(capture.layer(17), capture.activations[1])
    printed = subprocess.run(
        [sys.executable, "-m", "acs_client.downloads", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"run of {MODEL}, layers [3, 17]" in printed and "0='The' 1=' quick'" in printed
    assert "9*=" in printed  # the first generated position is marked
