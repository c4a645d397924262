"""Playground pages: access (another user's run or vector is a 404), htmx partials with and
without HX-Request, model output shown as text, the SSE replay, downloads and forms."""

import ast
import asyncio
import datetime as dt
import io
import json
import re
import uuid

import numpy as np
import pytest
from django.urls import reverse

from acs_client.codec import decode
from acs_client.downloads import load_activations
from api.tokenizer import PromptTokens
from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind, SteeringScore, SteeringVector
from playground.runs import selectors, streams, views
from playground.vectors import forms as vector_forms
from playground.vectors.services import REFERENCE_PROMPTS, steering_vector_create

from .conftest import HTMX, MODEL, recorded

EVIL = "<script>alert('pwned')</script><b>bold</b>"


pytestmark = pytest.mark.usefixtures("listed_model")


def finished_run(user, *, request=None, response=None, **fields):
    run = Run.objects.create(
        user=user,
        request=request or {"model": "smollm2-135m", "prompt": "The capital of France is"},
        status=WorkStatus.SUCCEEDED,
        response=response or recorded("completion_logprobs.json"),
        **fields,
    )
    return run


def evil_response():
    response = recorded("completion_logprobs.json")
    response["choices"][0]["text"] = EVIL
    response["choices"][0]["logprobs"]["tokens"][0] = "<script>"
    return response


def test_page_lists_every_request_field_with_limits(ada):
    page = ada.get(reverse("playground:page")).content.decode()
    for name in (
        "prompt", "several_prompts", "max_tokens", "temperature", "top_p", "top_k", "seed",
        "stop", "name=\"n\"", "logprobs", "prompt_logprobs", "echo", "stream", "capture",
    ):  # fmt: skip
        assert name in page
    assert "0–20" in page  # the model's max_logprobs
    assert "Layer indices 0–29" in page
    assert '<option value="smollm2-135m" selected>' in page


def test_the_page_preselects_the_registrys_default_model(ada, monkeypatch):
    """A production registry lists its vLLM row beside the engine's; the default is chosen
    unless the page names another."""
    engine = {**MODEL, "default": False}
    production = {**MODEL, "id": "smollm2-vllm", "default": True}
    monkeypatch.setattr(views, "model_cards", lambda: [engine, production])
    page = ada.get(reverse("playground:page")).content.decode()
    assert '<option value="smollm2-vllm" selected>' in page
    named = ada.get(reverse("playground:page") + "?model=smollm2-135m").content.decode()
    assert '<option value="smollm2-135m" selected>' in named


def test_model_without_activations_disables_capture_with_the_reason(ada, monkeypatch):
    plain = {**MODEL, "capabilities": {**MODEL["capabilities"], "activations": False}}
    monkeypatch.setattr(views, "model_cards", lambda: [plain])
    page = ada.get(reverse("playground:page")).content.decode()
    assert "smollm2-135m does not support activation capture or steering." in page
    assert 'name="capture" disabled' in page or 'disabled id="id_capture"' in page


def test_page_needs_an_approved_login(client, pending_user):
    assert client.get(reverse("playground:page")).status_code == 302
    client.force_login(pending_user)
    assert client.get(reverse("playground:page")).status_code == 403


def test_page_shows_the_latest_completion_run_in_the_run_panel_uncached(
    ada, approved_user, other_user
):
    earlier = finished_run(approved_user)
    latest = Run.objects.create(
        user=approved_user, request={"model": "smollm2-135m", "prompt": "Hi", "stream": True},
        status=WorkStatus.RUNNING,
    )  # fmt: skip
    Run.objects.create(user=approved_user, kind=RunKind.SWEEP, request={"prompt": "steer"})
    Run.objects.create(user=other_user, request={"prompt": "theirs"})
    response = ada.get(reverse("playground:page"))
    assert "no-store" in response["Cache-Control"]
    body = response.content.decode()
    panel = body[body.index('<div id="run-area">') :]
    # Still running: the panel follows its event stream; the earlier run is only in History.
    assert f'data-run-id="{latest.id}"' in panel
    assert f'data-events-url="/playground/runs/{latest.id}/events/"' in panel
    assert f'data-run-id="{earlier.id}"' not in body


def test_page_without_runs_says_where_the_run_will_appear(ada):
    body = ada.get(reverse("playground:page")).content.decode()
    assert "The run's status and output appear here." in body and "data-run-id" not in body


def test_htmx_submit_creates_the_run_and_returns_its_panel(
    ada, no_enqueue, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        response = ada.post(
            reverse("playground:run_submit"),
            {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": "8", "stream": "on",
             "include_usage": "on", "logprobs": "3", "stop": "\n\nEND", "seed": "7"},
            **HTMX,
        )  # fmt: skip
    assert response.status_code == 200
    body = response.content.decode()
    assert "<html" not in body and 'data-events-url="/playground/runs/' in body
    assert json.loads(response["HX-Trigger"]) == {"runCreated": {}}
    run = Run.objects.get()
    assert run.request == {
        "model": "smollm2-135m", "prompt": "Hello", "max_tokens": 8, "seed": 7,
        "stop": ["END"], "logprobs": 3, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }  # fmt: skip
    assert no_enqueue == [str(run.id)]


def test_plain_submit_redirects_to_the_permalink(ada, no_enqueue):
    response = ada.post(
        reverse("playground:run_submit"), {"model": "smollm2-135m", "prompt": "Hello"}
    )
    run = Run.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("playground:run_detail", args=[run.id])


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"n": "2"}, "max_tokens", "explicitly when sending a prompt list or n &gt; 1."),
        ({"stop": "a\nb\nc\nd\ne", "max_tokens": "1"}, "stop", "At most 4 stop strings"),
        ({"logprobs": "21"}, "logprobs", "may be at most 20 for this model."),
        ({"capture": "all", "stream": "on"}, "stream", "A capture cannot be streamed"),
        ({"capture": "layers", "capture_layers": "3, x"}, "capture_layers", "whole numbers"),
        (
            {"capture": "layers", "capture_layers": "30"},
            "capture_layers",
            "Layer 30 in &#x27;Layers&#x27; is out of range; this model has layers 0–29.",
        ),
    ],
)
def test_invalid_htmx_submit_shows_the_error_next_to_the_field(ada, data, field, message):
    response = ada.post(
        reverse("playground:run_submit"),
        {"model": "smollm2-135m", "prompt": "Hi", **data},
        **HTMX,
    )
    body = response.content.decode()
    assert response["HX-Retarget"] == "#completion-form" and response["HX-Reswap"] == "outerHTML"
    assert message in body
    assert f'id="id_{field}"' in body.split(message)[0]
    assert not Run.objects.exists()


def test_invalid_plain_submit_renders_the_page_with_400(ada):
    response = ada.post(reverse("playground:run_submit"), {"model": "smollm2-135m"})
    assert response.status_code == 400
    assert "This field is required." in response.content.decode()


def test_another_users_run_is_404_everywhere(ada, other_user):
    request = {"model": "m", "prompt": "x", "output_residual_stream": [0, 4, 8]}
    run = finished_run(other_user, response=recorded("capture.json"), request=request)
    urls = [
        reverse("playground:run_detail", args=[run.id]),
        reverse("playground:run_edit", args=[run.id]),
        reverse("playground:run_figure", args=[run.id, "cosine"]) + "?cosine_row=0",
        reverse("playground:run_figure", args=[run.id, "activations"]),
        reverse("playground:run_activations", args=[run.id]),
        reverse("playground:group_detail", args=[run.id]),
    ]
    for url in urls:
        assert ada.get(url).status_code == 404, url
        assert ada.get(url, **HTMX).status_code == 404, url
    assert ada.post(reverse("playground:run_rerun", args=[run.id])).status_code == 404


@pytest.mark.django_db(transaction=True)
async def test_another_users_run_events_are_404(
    async_db_connections_closed, async_client, approved_user, other_user
):
    run = await Run.objects.acreate(user=other_user, request={"prompt": "x"})
    await async_client.aforce_login(approved_user)
    response = await async_client.get(reverse("playground:run_events", args=[run.id]))
    assert response.status_code == 404


def test_another_users_vector_is_404_and_not_selectable(ada, other_user, no_enqueue):
    vector = steering_vector_create(
        user=other_user, name="theirs", model="smollm2-135m", layer=3, method="upload",
        vector=np.ones(576, dtype=np.float32),
    )  # fmt: skip
    url = reverse("playground:vector_download", args=[vector.pk])
    assert ada.get(url).status_code == 404
    response = ada.post(
        reverse("playground:steer"),
        {
            "steer-vector": vector.pk,
            "steer-prompt": "I think",
            "steer-scale_unit": "absolute",
            "steer-scales": "4",
            "steer-max_tokens": 4,
            "steer-temperature": 0,
            "steer-seed": 1,
            "steer-logprobs": 2,
        },
        **HTMX,
    )
    assert "Select a valid choice" in response.content.decode()
    assert not Run.objects.exists()


def test_model_output_with_html_is_shown_as_text_everywhere(ada, approved_user):
    run = finished_run(
        approved_user,
        request={"model": "smollm2-135m", "prompt": EVIL, "logprobs": 5, "prompt_logprobs": 3},
        response=evil_response(),
        error_code="",
    )
    Run.objects.create(
        user=approved_user, request={"model": "m", "prompt": "x"}, status=WorkStatus.FAILED,
        error_code="invalid_request", error_message=EVIL,
    )  # fmt: skip
    pages = [
        ada.get(reverse("playground:run_detail", args=[run.id])),
        ada.get(reverse("playground:run_detail", args=[run.id]), **HTMX),
        ada.get(reverse("playground:run_history")),
        ada.get(reverse("playground:page")),
        ada.get(reverse("playground:run_figure", args=[run.id, "topk"]) + "?position=5"),
    ]
    for page in pages:
        body = page.content.decode()
        assert page.status_code == 200
        assert "<script>alert" not in body and "<b>bold" not in body
        assert '<script>"' not in body
    detail = pages[0].content.decode()
    assert "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;" in detail
    assert "\\u0026lt;script\\u0026gt;" in detail  # figure JSON keeps the token escaped


def test_run_page_shows_request_response_timings_usage_and_figures(ada, approved_user):
    request = {"model": "smollm2-135m", "prompt": "The capital of France is", "logprobs": 5,
               "prompt_logprobs": 3, "max_tokens": 6}  # fmt: skip
    usage = {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    run = finished_run(
        approved_user, request=request, gateway_ms=14.5, upstream_ms=11.25, usage=usage
    )
    body = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert "14.5 ms" in body and "11.3 ms" in body
    assert "5 prompt + 6 completion = 11 tokens" in body
    assert "&quot;prompt_logprobs&quot;: 3" in body
    for name in ("tokens", "topk", "surprisal"):
        assert f'data-plot="{name}"' in body
    assert "Copy as Python (openai SDK)" in body and "Edit and re-run" in body


def test_run_panel_times_are_utc_to_the_second(ada, approved_user):
    queued = dt.datetime(2026, 12, 1, 14, 3, 59, 744861, tzinfo=dt.UTC)
    run = finished_run(approved_user, created_at=queued)
    body = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert "2026-12-01 14:03:59 UTC" in body
    assert "744861" not in body


def test_a_choice_that_ended_at_once_says_why_it_is_empty(ada, approved_user):
    response = recorded("completion_logprobs.json")
    response["choices"][0].update(text="", finish_reason="stop")
    response["choices"][0]["logprobs"] = None
    request = {"model": "smollm2-135m", "prompt": "x", "stop": [" "]}
    run = finished_run(approved_user, request=request, response=response)
    body = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert "the model stopped at its first token" in body
    assert "held a stop string of the request" in body
    full = finished_run(approved_user)
    body = ada.get(reverse("playground:run_detail", args=[full.id])).content.decode()
    assert "data-empty-choice" not in body


def test_htmx_run_panel_is_a_partial(ada, approved_user):
    run = finished_run(approved_user)
    partial = ada.get(reverse("playground:run_detail", args=[run.id]), **HTMX)
    assert "<html" not in partial.content.decode()
    assert 'class="run-panel"' in partial.content.decode()
    full = ada.get(reverse("playground:run_detail", args=[run.id]))
    assert "<html" in full.content.decode()


def test_history_with_and_without_htmx(ada, approved_user):
    finished_run(approved_user)
    partial = ada.get(reverse("playground:run_history"), **HTMX).content.decode()
    full = ada.get(reverse("playground:run_history")).content.decode()
    assert "<html" not in partial and 'id="history"' in partial
    assert "<html" in full and "The capital of France is" in full


def test_capture_run_has_activation_figures_and_downloads(ada, approved_user):
    run = finished_run(
        approved_user,
        request={"model": "smollm2-135m", "prompt": "Hello world, this is", "max_tokens": 1,
                 "output_residual_stream": [0, 4, 8]},
        response=recorded("capture.json"),
    )  # fmt: skip
    body = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    for name in ("heatmap", "norm_by_layer", "cosine", "pca"):
        assert f'data-plot="{name}"' in body
    download = ada.get(reverse("playground:run_activations", args=[run.id]))
    loaded = load_activations(download.content)
    tensor = loaded.captures[0].activations
    assert tensor.shape == (3, 5, 576) and tensor.dtype == np.float32
    captured = decode(recorded("capture.json")["activations"]["residual_stream"])
    assert np.array_equal(tensor, captured)
    assert loaded.layers == [0, 4, 8] and loaded.metadata["kind"] == "run"
    figure = ada.get(reverse("playground:run_figure", args=[run.id, "pca"]) + "?pca_row=2", **HTMX)
    assert "PCA of positions, layer 8" in figure.content.decode()
    bad = ada.get(reverse("playground:run_figure", args=[run.id, "pca"]) + "?pca_row=9")
    assert bad.status_code == 404


def test_rerun_sends_the_same_request_again(ada, approved_user, no_enqueue):
    run = finished_run(approved_user)
    response = ada.post(reverse("playground:run_rerun", args=[run.id]), **HTMX)
    again = Run.objects.exclude(pk=run.pk).get()
    assert again.request == {**run.request, "return_token_ids": True}
    assert again.status == WorkStatus.QUEUED
    assert str(again.id) in response.content.decode()


def test_edit_and_rerun_fills_the_form_from_the_request(ada, approved_user):
    request = {"model": "smollm2-135m", "prompt": ["one", "two"], "max_tokens": 5,
               "stop": ["x", "y"], "output_residual_stream": [1, 2], "n": 1}  # fmt: skip
    run = finished_run(approved_user, request=request)
    body = ada.get(reverse("playground:run_edit", args=[run.id])).content.decode()
    assert ">\none\ntwo</textarea>" in body and ">\nx\ny</textarea>" in body
    assert 'value="1, 2"' in body and 'id="id_several_prompts" checked' in body


def test_code_snippets_reproduce_the_exact_request():
    request = {"model": "smollm2-135m", "prompt": "It's \"true\"", "max_tokens": 4,
               "prompt_logprobs": -1, "echo": True, "top_k": 5}  # fmt: skip
    snippets = selectors.run_code_snippets(Run(request=request), base_url="http://h")
    assert "'" + json.dumps(request).replace("'", "'\"'\"'") + "'" in snippets["curl"]
    for name in ("openai", "acs_client"):
        ast.parse(snippets[name])
    tree = ast.parse(snippets["openai"])
    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "create"
    )
    arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert arguments.pop("extra_body") == {"prompt_logprobs": -1, "top_k": 5}
    assert arguments == {k: v for k, v in request.items() if k not in ("prompt_logprobs", "top_k")}


@pytest.mark.django_db(transaction=True)
async def test_sse_replays_what_is_published_then_ends(
    async_db_connections_closed, async_client, approved_user, redis_client
):
    run = await Run.objects.acreate(user=approved_user, request={"prompt": "x"})
    for event in ({"type": "status", "status": "running"},
                  {"type": "token", "choice": 0, "text": "<b>Hi"},
                  {"type": "end", "status": "succeeded"}):  # fmt: skip
        streams.publish(run.id, event)
    await async_client.aforce_login(approved_user)
    response = await async_client.get(reverse("playground:run_events", args=[run.id]))
    assert response["Content-Type"] == "text/event-stream"
    chunks = [chunk.decode() async for chunk in response.streaming_content]
    events = [
        json.loads(line[6:]) for c in chunks for line in c.splitlines() if line.startswith("data: ")
    ]
    assert [e["type"] for e in events] == ["status", "token", "end"]
    ids = [line[4:] for c in chunks for line in c.splitlines() if line.startswith("id: ")]
    resumed = await async_client.get(
        reverse("playground:run_events", args=[run.id]), headers={"Last-Event-ID": ids[1]}
    )
    rest = "".join([chunk.decode() async for chunk in resumed.streaming_content])
    assert '"type": "end"' in rest and "<b>Hi" not in rest


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]


@pytest.mark.django_db(transaction=True)
async def test_sse_of_a_queued_run_idle_past_the_redis_socket_timeout_keeps_streaming(
    async_db_connections_closed, async_client, approved_user, redis_client, settings
):
    # Just over redis-py's default 5 s socket timeout, which used to cut the blocking read.
    settings.PLAYGROUND_SSE_KEEPALIVE_SECONDS = 5.5
    run = await Run.objects.acreate(user=approved_user, request={"prompt": "x"})
    streams.publish(run.id, {"type": "status", "status": "queued"})
    await async_client.aforce_login(approved_user)
    response = await async_client.get(reverse("playground:run_events", args=[run.id]))

    async def read_all() -> str:
        chunks = []
        async for chunk in response.streaming_content:
            chunks.append(chunk.decode())
            if chunk.decode() == ": keepalive\n\n":
                streams.publish(run.id, {"type": "token", "choice": 0, "text": "late"})
                streams.publish(run.id, {"type": "end", "status": "succeeded"})
        return "".join(chunks)

    body = await asyncio.wait_for(read_all(), timeout=60)
    assert ": keepalive" in body
    assert [e["type"] for e in sse_events(body)] == ["status", "token", "end"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("last_event_id", ["garbage", "1-2-3", "99999999999999999999-0", "-1"])
async def test_sse_with_a_malformed_last_event_id_replays_from_the_start(
    async_db_connections_closed, async_client, approved_user, redis_client, last_event_id
):
    run = await Run.objects.acreate(user=approved_user, request={"prompt": "x"})
    for event in ({"type": "status", "status": "running"},
                  {"type": "token", "choice": 0, "text": "Hi"},
                  {"type": "end", "status": "succeeded"}):  # fmt: skip
        streams.publish(run.id, event)
    await async_client.aforce_login(approved_user)
    response = await async_client.get(
        reverse("playground:run_events", args=[run.id]), headers={"Last-Event-ID": last_event_id}
    )
    body = "".join([chunk.decode() async for chunk in response.streaming_content])
    assert [e["type"] for e in sse_events(body)] == ["status", "token", "end"]


@pytest.mark.django_db(transaction=True)
async def test_sse_of_a_run_whose_stream_expired_ends_at_once(
    async_db_connections_closed, async_client, approved_user, redis_client
):
    run = await Run.objects.acreate(
        user=approved_user, request={"prompt": "x"}, status=WorkStatus.FAILED, error_code="x"
    )
    await async_client.aforce_login(approved_user)
    response = await async_client.get(reverse("playground:run_events", args=[run.id]))
    body = "".join([chunk.decode() async for chunk in response.streaming_content])
    assert json.loads(body.split("data: ")[1]) == {"type": "end", "status": "failed"}


def test_upload_rejects_a_wrong_shape_with_a_clear_error(ada):
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((2, 576), dtype=np.float32))
    buffer.name = "v.npy"
    buffer.seek(0)
    response = ada.post(
        reverse("playground:vector_upload"),
        {"upload-name": "v", "upload-layer": 3, "upload-file": buffer},
        **HTMX,
    )
    assert "The array has shape [2, 576]; this model needs [576] or [1, 576]." in (
        response.content.decode()
    )
    assert response["HX-Retarget"] == "#vectors"
    assert not SteeringVector.objects.exists()


def test_upload_rejects_a_file_that_is_not_npy(ada):
    garbage = io.BytesIO(b"not numpy")
    garbage.name = "v.npy"
    response = ada.post(
        reverse("playground:vector_upload"),
        {"upload-name": "v", "upload-layer": 3, "upload-file": garbage},
    )
    assert response.status_code == 400
    assert "This is not a .npy file" in response.content.decode()


def _upload(ada, content: bytes, headers):
    upload = io.BytesIO(content)
    upload.name = "v.npy"
    return ada.post(
        reverse("playground:vector_upload"),
        {"upload-name": "v", "upload-layer": 3, "upload-file": upload},
        **headers,
    )


def _npy(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.mark.parametrize("headers", [{}, HTMX], ids=["plain", "htmx"])
def test_an_npy_header_claiming_2_to_the_40_values_is_refused_before_reading_them(ada, headers):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (2**40,)}
    )
    response = _upload(ada, header.getvalue() + b"\0" * 64, headers)
    assert response.status_code == (200 if headers else 400)
    assert "The array has shape [1099511627776]; this model needs [576] or [1, 576]." in (
        response.content.decode()
    )
    assert not SteeringVector.objects.exists()


def test_an_npy_file_with_fewer_values_than_its_header_says_is_a_field_error(ada):
    response = _upload(ada, _npy(np.zeros(576, dtype=np.float32))[:-8], {})
    assert response.status_code == 400
    assert "The file holds fewer values than its header&#x27;s shape [576] says." in (
        response.content.decode()
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1e300, "Value 7 is 1e+300, beyond the ±3.39e+38 that bfloat16"),
        (3.4e38, "Value 7 is 3.4e+38, beyond the ±3.39e+38 that bfloat16"),
        (np.nan, "Value 7 is nan; every value must be finite."),
        (-np.inf, "Value 7 is -inf; every value must be finite."),
    ],
)
def test_an_upload_whose_value_is_not_finite_once_stored_names_the_first_one(ada, value, message):
    array = np.full(576, 0.5)
    array[7] = array[9] = value
    response = _upload(ada, _npy(array), HTMX)
    assert message in response.content.decode()
    assert not SteeringVector.objects.exists()


@pytest.mark.parametrize("headers", [{}, HTMX], ids=["plain", "htmx"])
def test_several_prompts_of_only_a_newline_is_a_field_error(ada, headers):
    response = ada.post(
        reverse("playground:run_submit"),
        {"model": "smollm2-135m", "prompt": "\n", "several_prompts": "on", "max_tokens": "4"},
        **headers,
    )
    assert response.status_code == (200 if headers else 400)
    body = response.content.decode()
    message = "Several prompts: one per line, and every line here is empty."
    assert message in body and 'id="id_prompt"' in body.split(message)[0]
    assert not Run.objects.exists()


def test_upload_saves_a_one_by_hidden_vector(ada, approved_user):
    buffer = io.BytesIO()
    np.save(buffer, np.full((1, 576), 0.5, dtype=np.float32))
    buffer.name = "v.npy"
    buffer.seek(0)
    response = ada.post(
        reverse("playground:vector_upload"),
        {"upload-name": "half", "upload-layer": 3, "upload-file": buffer},
        **HTMX,
    )
    vector = SteeringVector.objects.get(user=approved_user)
    assert vector.norm == pytest.approx(0.5 * 576**0.5) and vector.hidden_size == 576
    assert "half" in response.content.decode()
    download = ada.get(reverse("playground:vector_download", args=[vector.pk]))
    assert np.load(io.BytesIO(download.content)).tolist() == [0.5] * 576


def test_contrast_form_queues_two_captures(ada, approved_user, no_enqueue, monkeypatch):
    # Each prompt two tokens (the form refuses one: see test_contrast_vectors).
    two = PromptTokens(ids=[40, 1234], strings=["I", " love"])
    monkeypatch.setattr(vector_forms, "tokenize", lambda model_id, texts: [two for _ in texts])
    response = ada.post(
        reverse("playground:vector_contrast"),
        {"contrast-name": "love", "contrast-layer": 12, "contrast-positive": "I love",
         "contrast-negative": "I hate", "contrast-method": "contrast_mean"},
        **HTMX,
    )  # fmt: skip
    runs = Run.objects.filter(kind=RunKind.CONTRAST)
    # The pair, and the reference prompts that measure the layer's typical norm.
    assert sorted(r.meta["role"] for r in runs) == ["negative", "positive"] + ["reference"] * 4
    assert all(r.request["output_residual_stream"] == [12] for r in runs)
    references = [r.request["prompt"] for r in runs if r.meta["role"] == "reference"]
    assert sorted(references) == sorted(REFERENCE_PROMPTS)
    assert 'hx-trigger="load delay:700ms"' in response.content.decode()


def test_contrast_panel_polls_until_the_vector_is_saved(ada, approved_user):
    group = uuid.uuid4()
    for role in ("positive", "negative"):
        finished_run(
            approved_user, kind=RunKind.CONTRAST, group=group, meta={"role": role},
            response=recorded("capture.json"),
        )  # fmt: skip
    url = reverse("playground:group_detail", args=[group])
    # Both captures succeeded, but their worker has not saved the vector yet.
    assert 'data-finished="false"' in ada.get(url, **HTMX).content.decode()
    vector = steering_vector_create(
        user=approved_user, name="v", model="smollm2-135m", layer=3, method="contrast_last",
        vector=np.full(576, 2.0, dtype=np.float32),
    )  # fmt: skip
    Run.objects.filter(group=group).update(vector=vector)
    body = ada.get(url, **HTMX).content.decode()
    assert 'data-finished="true"' in body and "vector-ready" in body


def test_steering_runs_baseline_and_steered_with_the_same_seed(ada, approved_user, no_enqueue):
    vector = steering_vector_create(
        user=approved_user, name="v", model="smollm2-135m", layer=3, method="contrast_last",
        vector=np.full(576, 2.0, dtype=np.float32), layer_typical_norm=96.0,
    )  # fmt: skip
    ada.post(
        reverse("playground:steer"),
        {
            "steer-vector": vector.pk,
            "steer-prompt": "I think",
            "steer-scale_unit": "typical",
            "steer-scales": "0.5",
            "steer-max_tokens": 4,
            "steer-temperature": 0,
            "steer-seed": 11,
            "steer-logprobs": 2,
            "steer-layers": "3",
        },
        **HTMX,
    )
    runs = sorted(Run.objects.all(), key=lambda r: r.scale)
    assert [r.kind for r in runs] == [RunKind.STEERING_BASELINE, RunKind.STEERING_STEERED]
    assert {r.request["seed"] for r in runs} == {11}
    steering = [r.request["apply_steering_vectors"][0] for r in runs]
    assert [s["scale"] for s in steering] == [0.0, pytest.approx(0.5 * 96 / 48)]
    assert steering[1]["layer_indices"] == [3]
    assert steering[1]["activations"]["shape"] == [1, 576]
    assert runs[0].group == runs[1].group


def test_absolute_scale_steers_at_several_layers(ada, approved_user, no_enqueue):
    vector = steering_vector_create(
        user=approved_user, name="v", model="smollm2-135m", layer=3, method="upload",
        vector=np.full(576, 2.0, dtype=np.float32),
    )  # fmt: skip
    ada.post(
        reverse("playground:steer"),
        {"steer-vector": vector.pk, "steer-prompt": "I think", "steer-scale_unit": "absolute",
         "steer-scales": "2", "steer-max_tokens": 4, "steer-temperature": 0, "steer-seed": 11,
         "steer-logprobs": 2, "steer-layers": "3, 5"},
        **HTMX,
    )  # fmt: skip
    steered = Run.objects.get(scale=2.0).request["apply_steering_vectors"][0]
    assert steered["layer_indices"] == [3, 5] and steered["activations"]["shape"] == [2, 576]


def test_typical_norm_scale_is_only_for_the_vectors_own_layer(ada, approved_user):
    # The typical norm was measured at the vector's layer; another layer's can differ a lot.
    vector = steering_vector_create(
        user=approved_user, name="v", model="smollm2-135m", layer=3, method="contrast_last",
        vector=np.full(576, 2.0, dtype=np.float32), layer_typical_norm=96.0,
    )  # fmt: skip
    response = ada.post(
        reverse("playground:steer"),
        {"steer-vector": vector.pk, "steer-prompt": "I", "steer-scale_unit": "typical",
         "steer-scales": "1", "steer-max_tokens": 4, "steer-temperature": 0, "steer-seed": 1,
         "steer-logprobs": 2, "steer-layers": "3, 5"},
        **HTMX,
    )  # fmt: skip
    assert "× typical norm is layer 3&#x27;s typical norm" in response.content.decode()
    assert not Run.objects.exists()


def test_typical_norm_scale_needs_a_contrast_vector(ada, approved_user):
    vector = steering_vector_create(
        user=approved_user, name="v", model="smollm2-135m", layer=3, method="upload",
        vector=np.ones(576, dtype=np.float32),
    )  # fmt: skip
    response = ada.post(
        reverse("playground:steer"),
        {
            "steer-vector": vector.pk,
            "steer-prompt": "I",
            "steer-scale_unit": "typical",
            "steer-scales": "1",
            "steer-max_tokens": 4,
            "steer-temperature": 0,
            "steer-seed": 1,
            "steer-logprobs": 2,
        },
        **HTMX,
    )
    assert "This vector has no typical layer norm" in response.content.decode()
    assert response["HX-Retarget"] == "#steering-box"


def score_of(user, group, runs) -> SteeringScore:
    """A finished same-token comparison of `runs` (made-up logprobs: each steered model
    finds the baseline's tokens 0.5 nats less likely)."""
    baseline = next(run for run in runs if run.scale == 0)
    strings = ["a", "b"]

    def entry(run):
        return {
            "run": str(run.pk), "scale": run.scale, "scale_entered": run.scale_entered,
            "label": run.scale_label,
            "baseline_tokens": {"under_baseline": [-1.0, -2.0], "under_steered": [-1.5, -2.5],
                                "kl": [0.25, 0.5]},
            "steered_tokens": {"strings": ["c", "d"], "ids": [3, 4],
                               "under_baseline": [-4.0, -3.0], "under_steered": [-1.0, -1.0]},
        }  # fmt: skip

    results = {
        "baseline": {"run": str(baseline.pk), "strings": strings, "ids": [1, 2]},
        "prompt_tokens": 2, "full_vocabulary": True, "kl_max_tokens": 64,
        "runs": [entry(run) for run in runs if run.scale != 0],
        "requests": [{"purpose": "baseline model, baseline's tokens", "request_id": "req-1"}],
    }  # fmt: skip
    return SteeringScore.objects.create(
        user=user, group=group, status=WorkStatus.SUCCEEDED, results=results
    )


def test_comparison_page_shows_both_texts_and_the_difference(ada, approved_user):
    group = "6f1d7f5e-0000-4000-8000-000000000001"
    runs = [
        finished_run(approved_user, group=group, scale=scale, response=recorded(name),
                     kind=RunKind.STEERING_BASELINE if scale == 0 else RunKind.STEERING_STEERED,
                     meta={"target_token": "'s"})
        for scale, name in ((0.0, "steer_baseline.json"), (4.0, "steer_steered.json"))
    ]  # fmt: skip
    body = ada.get(reverse("playground:group_detail", args=[group])).content.decode()
    # Until the runs are compared on the same tokens, the panel keeps polling.
    assert 'data-finished="false"' in body and 'data-plot="diff-4"' not in body
    score_of(approved_user, group, runs)
    body = ada.get(reverse("playground:group_detail", args=[group])).content.decode()
    assert "Baseline (scale 0)" in body and "Steered, scale 4" in body
    assert "&#x27;s a great idea." in body
    assert 'data-plot="diff-4"' in body and 'data-finished="true"' in body
    assert "-0.500 nats/token" in body and "0.375 nats/token" in body
    partial = ada.get(reverse("playground:group_detail", args=[group]), **HTMX)
    assert "<html" not in partial.content.decode()


def test_sweep_page_plots_target_logprob_against_scale(ada, approved_user):
    group = "6f1d7f5e-0000-4000-8000-000000000002"
    runs = [
        finished_run(approved_user, group=group, scale=scale, response=recorded(name),
                     kind=RunKind.SWEEP, meta={"target_token": "'s"})
        for scale, name in ((0.0, "steer_baseline.json"), (2.0, "steer_baseline.json"),
                            (4.0, "steer_steered.json"))
    ]  # fmt: skip
    score_of(approved_user, group, runs)
    body = ada.get(reverse("playground:group_detail", args=[group])).content.decode()
    assert 'data-plot="sweep"' in body


def test_page_shows_the_latest_comparison_in_the_steering_area(ada, approved_user, other_user):
    older = "6f1d7f5e-0000-4000-8000-000000000003"
    for scale in (0.0, 4.0):
        finished_run(approved_user, group=older, scale=scale, kind=RunKind.STEERING_STEERED)
    sweep = "6f1d7f5e-0000-4000-8000-000000000004"
    for scale, name in ((0.0, "steer_baseline.json"), (2.0, "steer_baseline.json"),
                        (4.0, "steer_steered.json")):  # fmt: skip
        finished_run(approved_user, group=sweep, scale=scale, response=recorded(name),
                     kind=RunKind.SWEEP, meta={"target_token": "'s"})  # fmt: skip
    Run.objects.create(user=approved_user, group=sweep, scale=8.0, kind=RunKind.SWEEP,
                       status=WorkStatus.RUNNING, request={"prompt": "steer"})  # fmt: skip
    Run.objects.create(user=other_user, group=uuid.uuid4(), scale=0, kind=RunKind.SWEEP,
                       request={"prompt": "theirs"})  # fmt: skip
    body = ada.get(reverse("playground:page")).content.decode()
    area = body[body.index('<div id="steering-area"') :]
    area = area[: area.index("</section>")]
    # Still running: the panel polls for the rest; the older comparison is only in History.
    assert f'id="group-{sweep}"' in area and 'data-finished="false"' in area
    assert f'hx-get="/playground/groups/{sweep}/"' in area
    assert area.count('class="card"') == 4 and older not in area


def test_page_without_comparisons_has_an_empty_steering_area(ada, approved_user):
    finished_run(approved_user)
    body = ada.get(reverse("playground:page")).content.decode()
    assert '<div id="steering-area" aria-live="polite"></div>' in body


def _two_choices():
    response = recorded("completion_logprobs.json")
    second = json.loads(json.dumps(response["choices"][0]))
    second["index"] = 1
    second["text"] = "Lyon"
    second["logprobs"]["tokens"][0] = "·Lyon-marker"
    response["choices"].append(second)
    return response


def _figure_json(body: str, name: str) -> str:
    return body.split(f'<script id="{name}" type="application/json">')[1].split("</script>")[0]


def test_every_per_choice_figure_follows_the_chosen_choice(ada, approved_user):
    request = {"model": "smollm2-135m", "prompt": "The capital of France is", "logprobs": 5,
               "prompt_logprobs": 3, "max_tokens": 6, "n": 2}  # fmt: skip
    run = finished_run(approved_user, request=request, response=_two_choices())
    url = reverse("playground:run_detail", args=[run.id])
    first = ada.get(url).content.decode()
    assert "data-choice-select" in first and "Lyon-marker" not in _figure_json(first, "tokens")
    chosen = ada.get(url + "?choice=1", **HTMX).content.decode()
    assert "Lyon-marker" in _figure_json(chosen, "tokens")
    assert "Lyon-marker" in chosen.split('data-picker="topk"')[1].split("</select>")[0]
    assert '<input type="hidden" name="choice" value="1">' in chosen
    figure_url = reverse("playground:run_figure", args=[run.id, "topk"])
    topk = ada.get(figure_url + "?position=5&choice=1", **HTMX).content.decode()
    assert "Lyon-marker" in topk
    for bad in ("2", "x", "-1"):
        missing = ada.get(url + f"?choice={bad}")
        assert missing.status_code == 404
        assert ada.get(figure_url + f"?position=5&choice={bad}").status_code == 404


def test_norm_heatmap_colour_can_be_log_or_clipped(ada, approved_user):
    run = finished_run(
        approved_user,
        request={"model": "smollm2-135m", "prompt": "Hello world, this is", "max_tokens": 1,
                 "output_residual_stream": [0, 4, 8]},
        response=recorded("capture.json"),
    )  # fmt: skip
    body = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert 'name="colour"' in body
    url = reverse("playground:run_figure", args=[run.id, "heatmap"])
    for colour, shown in (("log", "log₁₀"), ("clip", "clipped at the 95th percentile")):
        partial = ada.get(url + f"?colour={colour}", **HTMX).content.decode()
        title = json.loads(_figure_json(partial, "heatmap"))["layout"]["title"]["text"]
        assert title == (
            f"Residual-stream norm ‖h‖ by layer × position ({shown}), "
            "positions 1–4 (first token excluded)"
        )
    assert ada.get(url + "?colour=sepia").status_code == 404


def test_sweep_keeps_scales_as_entered_and_scores_the_target(ada, approved_user, no_enqueue):
    vector = steering_vector_create(
        user=approved_user, name="v", model="smollm2-135m", layer=3, method="contrast_last",
        vector=np.full(576, 2.0, dtype=np.float32), layer_typical_norm=96.0,
    )  # fmt: skip
    ada.post(
        reverse("playground:steer"),
        {
            "steer-vector": vector.pk,
            "steer-prompt": "I feel",
            "steer-scale_unit": "typical",
            "steer-scales": "-1.5, 0.75",
            "steer-target_token": " happy",
            "steer-max_tokens": 4,
            "steer-temperature": 0,
            "steer-seed": 11,
            "steer-logprobs": 2,
        },
        **HTMX,
    )
    runs = sorted(Run.objects.all(), key=lambda r: r.scale)
    assert [r.scale for r in runs] == [pytest.approx(-1.5 * 96 / 48), 0.0, pytest.approx(1.5)]
    assert [r.scale_label for r in runs] == [
        "-1.5 × typical norm",
        "0 × typical norm",
        "0.75 × typical norm",
    ]
    assert all(r.request["prompt"] == ["I feel", "I feel happy"] for r in runs)
    assert all(r.request["prompt_logprobs"] == 0 for r in runs)
    Run.objects.update(status=WorkStatus.SUCCEEDED, response=recorded("steer_steered.json"))
    runs = sorted(Run.objects.all(), key=lambda r: r.scale)
    score_of(approved_user, runs[0].group, runs)
    body = ada.get(reverse("playground:group_detail", args=[runs[0].group])).content
    body = body.decode()
    assert "Steered, scale -1.5 × typical norm" in body and "scale -3" not in body
    diff = json.loads(_figure_json(body, "diff-1.5"))["layout"]["title"]["text"]
    assert diff == "Same tokens under both models, scale 0.75 × typical norm"
    sweep = json.loads(_figure_json(body, "sweep"))
    assert sweep["data"][0]["x"] == [-1.5, 0, 0.75]
    assert sweep["layout"]["xaxis"]["title"]["text"] == (
        "scale (× layer 3's typical norm, ‖h‖ = 96.00)"
    )


def test_comparison_page_shows_what_each_arm_sent(ada, approved_user, no_enqueue):
    vector = steering_vector_create(
        user=approved_user, name="calm", model="smollm2-135m", layer=4, method="upload",
        vector=np.full(576, 0.5, dtype=np.float32), details={"filename": "calm.npy"},
    )  # fmt: skip
    ada.post(
        reverse("playground:steer"),
        {"steer-vector": vector.pk, "steer-prompt": "I think", "steer-scale_unit": "absolute",
         "steer-scales": "6", "steer-max_tokens": 7, "steer-temperature": 0.5, "steer-seed": 13,
         "steer-logprobs": 3, "steer-layers": "4, 9"},
        **HTMX,
    )  # fmt: skip
    group = Run.objects.first().group
    body = ada.get(reverse("playground:group_detail", args=[group])).content.decode()
    assert "Vector <strong>calm</strong> (‖v‖ = 12.00, built for layer 4)" in body
    assert "uploaded as <code>calm.npy</code>" in body
    rows = re.findall(r"<tr><td><a [^>]+>(baseline|steered)</a></td>(.*?)</tr>", body, re.S)
    cells = {arm: re.findall(r"<td[^>]*>(.*?)</td>", row) for arm, row in rows}
    # prompt, layers, positions, scale as entered, scale sent, norm_match, seed, temperature,
    # max_tokens
    assert cells["baseline"][:9] == [
        "<code>I think</code>",
        "4, 9",
        "every",
        "0",
        "0",
        "no",
        "13",
        "0.5",
        "7",
    ]
    assert cells["steered"][:9] == [
        "<code>I think</code>",
        "4, 9",
        "every",
        "6",
        "6",
        "no",
        "13",
        "0.5",
        "7",
    ]


def test_position_lists_show_tokens_as_the_figures_do(ada, approved_user):
    response = recorded("completion_logprobs.json")
    run = finished_run(
        approved_user,
        request={"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 6,
                 "logprobs": 5, "prompt_logprobs": 3},
        response=response,
    )  # fmt: skip
    body = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    # The newlines of " Paris.\n\nThe answer" are ⏎ in the list, as on the charts.
    assert '<option value="7" >7 ⏎</option>' in body and "7: \n" not in body
    assert '<option value="1" >1 ·capital</option>' in body


def test_run_download_names_the_steering_applied_and_its_vector(ada, approved_user):
    vector = steering_vector_create(
        user=approved_user, name="calm", model="smollm2-135m", layer=4, method="upload",
        vector=np.full(576, 0.5, dtype=np.float32), details={"filename": "calm.npy"},
    )  # fmt: skip
    steering = {"activations": vector.data, "layer_indices": [4], "scale": 2.5,
                "norm_match": True}  # fmt: skip
    run = finished_run(
        approved_user,
        request={"model": "smollm2-135m", "prompt": "Hello world, this is", "max_tokens": 1,
                 "output_residual_stream": [0, 4, 8], "apply_steering_vectors": [steering]},
        response=recorded("capture.json"), vector=vector, request_id="req-77",
    )  # fmt: skip
    download = ada.get(reverse("playground:run_activations", args=[run.id]))
    loaded = load_activations(download.content)
    [applied] = loaded.steering
    assert (applied["layer_indices"], applied["scale"], applied["norm_match"]) == ([4], 2.5, True)
    assert applied["vector"]["name"] == "calm" and applied["vector"]["norm"] == 12.0
    assert applied["vector"]["details"] == {"filename": "calm.npy"}
    assert "data" not in json.dumps(applied)
    assert loaded.captures[0].request_id == "req-77"
    # Stored before runs kept their tokens: the prompt's 5 rows are known from the usage.
    assert (
        loaded.captures[0].prompt_length == 5 and loaded.captures[0].token_ids.tolist() == [-1] * 5
    )
