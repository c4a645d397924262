"""The comparison page of two runs: access (another user's run, a bad id: 404), htmx partial
with and without HX-Request, the token diff, runs without captures, queueing the scoring."""

import datetime as dt
import functools
import html
import json
import re
import uuid

import httpx
from django.urls import reverse
from django.utils import timezone

from acs_client.client import AcsClient
from infra.lifecycle import WorkStatus
from playground import scoring, tasks
from playground.compare import differences as compare_differences
from playground.compare import services as compare
from playground.models import Run, RunComparison

from .conftest import HTMX, recorded

MODEL = "smollm2-135m"
PROMPT = {
    "ids": [504, 3575, 282, 4649, 314],
    "strings": ["The", " capital", " of", " France", " is"],
}

WITHOUT_LOGPROBS = {"choices": [{"index": 0, "text": " Paris", "logprobs": None}], "usage": {}}


def finished_run(user, *, completion, response=None, model=MODEL, capture=None):
    """A succeeded run of `PROMPT` that generated `completion` (token ids and strings)."""
    ids, strings = zip(*completion, strict=True) if completion else ((), ())
    request = {"model": model, "prompt": "The capital of France is", "max_tokens": len(ids)}
    if capture is not None:
        request["output_residual_stream"] = capture
    return Run.objects.create(
        user=user,
        request=request,
        status=WorkStatus.SUCCEEDED,
        response=response or recorded("completion_logprobs.json"),
        tokens={
            "prompts": [PROMPT],
            "completions": [{"ids": list(ids), "strings": list(strings), "source": "logprobs"}],
        },
    )


def compare_url(a, b=None) -> str:
    query = f"?a={a.id if isinstance(a, Run) else a}"
    if b is not None:
        query += f"&b={b.id if isinstance(b, Run) else b}"
    return reverse("playground:compare") + query


def highlighted(page: str, side: str) -> list[str]:
    block = re.search(rf'data-diff-side="{side}">(.*?)</pre>', page, re.S).group(1)
    return re.findall(r'<span class="tok changed"[^>]*>(.*?)</span>', block)


def test_comparison_highlights_the_tokens_that_differ(ada, approved_user):
    paris = finished_run(approved_user, completion=[(7042, " Paris"), (30, "."), (198, "\n")])
    lyon = finished_run(approved_user, completion=[(24196, " Lyon"), (30, "."), (198, "\n")])
    page = ada.get(compare_url(paris, lyon)).content.decode()
    assert "<h1>Compare two runs</h1>" in page
    assert highlighted(page, "a") == [" Paris"] and highlighted(page, "b") == [" Lyon"]
    # The shared prompt is shown, not highlighted.
    assert page.count('<span class="tok" title="position 1 (prompt)"> capital</span>') == 2
    # Unsteered runs of one model: the same-token Δ can only be 0, and the page says so.
    assert "data-same-settings" in page


def test_comparison_partial_with_htmx_and_whole_page_without(ada, approved_user):
    a = finished_run(approved_user, completion=[(7042, " Paris")])
    b = finished_run(approved_user, completion=[(24196, " Lyon")])
    partial = ada.get(compare_url(a, b), **HTMX)
    assert partial.status_code == 200
    assert "<html" not in partial.content.decode()
    assert 'id="comparison"' in partial.content.decode()
    assert "<html" in ada.get(compare_url(a, b)).content.decode()


def test_another_users_run_or_a_bad_id_is_404(ada, approved_user, other_user):
    mine = finished_run(approved_user, completion=[(7042, " Paris")])
    theirs = finished_run(other_user, completion=[(7042, " Paris")])
    for url in (
        compare_url(mine, theirs),
        compare_url(theirs, mine),
        compare_url(theirs),
        compare_url("not-a-uuid", mine),
        compare_url(mine, "00000000-0000-0000-0000-000000000000"),
    ):
        assert ada.get(url).status_code == 404, url
        assert ada.get(url, **HTMX).status_code == 404, url
    score = reverse("playground:compare_score")
    assert ada.post(score, {"a": mine.id, "b": theirs.id}).status_code == 404
    assert not RunComparison.objects.exists()


def test_one_run_named_offers_the_users_other_runs_to_compare_with(ada, approved_user, other_user):
    a = finished_run(approved_user, completion=[(7042, " Paris")])
    b = finished_run(approved_user, completion=[(24196, " Lyon")])
    theirs = finished_run(other_user, completion=[(7042, " Paris")])
    page = ada.get(compare_url(a)).content.decode()
    options = re.findall(r'<option value="([^"]+)"', page)
    assert options == [str(b.id)] and str(theirs.id) not in page
    assert f'name="a" value="{a.id}"' in page
    Run.objects.filter(pk=b.pk).delete()
    alone = ada.get(compare_url(a)).content.decode()
    assert "You have no other run to compare with yet." in alone and "<select" not in alone


def test_runs_without_captures_say_so(ada, approved_user):
    plain = finished_run(approved_user, completion=[(7042, " Paris")])
    captured = finished_run(
        approved_user, completion=[(7042, " Paris")], response=recorded("capture.json"),
        capture=[0, 4, 8],
    )  # fmt: skip
    page = ada.get(compare_url(plain, captured)).content.decode()
    assert "Run A captured no activations" in page
    assert 'data-plot="activation-difference"' not in page


def test_the_activation_difference_of_a_run_with_itself_is_zero(ada, approved_user):
    captured = finished_run(
        approved_user, completion=[(7042, " Paris")], response=recorded("capture.json"),
        capture=[0, 4, 8],
    )  # fmt: skip
    page = ada.get(compare_url(captured, captured)).content.decode()
    assert "the first 5 positions (run A captured 5, run B 5)" in page
    assert 'data-plot="activation-difference"' in page


def test_a_failed_run_has_no_diff_and_cannot_be_scored(ada, approved_user):
    done = finished_run(approved_user, completion=[(7042, " Paris")])
    failed = Run.objects.create(
        user=approved_user, request={"model": MODEL, "prompt": "x"}, status=WorkStatus.FAILED
    )
    page = ada.get(compare_url(done, failed)).content.decode()
    assert "run B has no result (failed)" in page
    assert "Run B has no known tokens" in page
    response = ada.post(reverse("playground:compare_score"), {"a": done.id, "b": failed.id})
    assert response.status_code == 400 and not RunComparison.objects.exists()


def test_runs_of_different_models_cannot_be_scored(ada, approved_user):
    a = finished_run(approved_user, completion=[(7042, " Paris")])
    b = finished_run(approved_user, completion=[(7042, " Paris")], model="other-model")
    page = ada.get(compare_url(a, b)).content.decode()
    assert "The runs used different models" in page
    assert "Score on the same tokens" not in page


def test_scoring_is_queued_once_and_the_panel_polls_until_done(
    ada, approved_user, no_enqueue, django_capture_on_commit_callbacks
):
    a = finished_run(approved_user, completion=[(7042, " Paris")])
    b = finished_run(approved_user, completion=[(24196, " Lyon")])
    page = ada.get(compare_url(a, b)).content.decode()
    assert "Score on the same tokens" in page and "about 28 tokens" in page
    url = reverse("playground:compare_score")
    with django_capture_on_commit_callbacks(execute=True):
        first = ada.post(url, {"a": a.id, "b": b.id}, **HTMX)
        again = ada.post(url, {"a": a.id, "b": b.id})
    comparison = RunComparison.objects.get()
    assert no_enqueue == [str(comparison.pk)]
    assert 'hx-trigger="load delay:700ms"' in first.content.decode()
    assert again.status_code == 302 and again.url == compare_url(a, b)


def test_a_failed_scoring_can_be_queued_again(
    ada, approved_user, no_enqueue, django_capture_on_commit_callbacks
):
    a = finished_run(approved_user, completion=[(7042, " Paris")])
    b = finished_run(approved_user, completion=[(24196, " Lyon")])
    comparison = RunComparison.objects.create(
        user=approved_user, run_a=a, run_b=b, status=WorkStatus.FAILED,
        error_code="budget_exceeded", error_message="Monthly budget spent.",
    )  # fmt: skip
    page = ada.get(compare_url(a, b)).content.decode()
    assert "budget_exceeded" in page and "Score again" in page
    with django_capture_on_commit_callbacks(execute=True):
        compare.comparison_queue(user=approved_user, run_a=a, run_b=b)
    comparison.refresh_from_db()
    assert comparison.status == WorkStatus.QUEUED and no_enqueue == [str(comparison.pk)]


def test_run_page_and_steering_comparison_link_to_the_comparison(ada, approved_user):
    run = finished_run(approved_user, completion=[(7042, " Paris")])
    page = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert f'href="{compare_url(run)}" data-compare-link' in page
    group = uuid.uuid4()
    baseline, steered = (
        finished_run(approved_user, completion=[(7042, " Paris")]) for _ in range(2)
    )
    for run, kind, scale in (
        (baseline, "steering_baseline", 0.0),
        (steered, "steering_steered", 8.0),
    ):
        Run.objects.filter(pk=run.pk).update(group=group, kind=kind, scale=scale)
    page = ada.get(reverse("playground:group_detail", args=[group])).content.decode()
    link = compare_url(baseline, steered).replace("&", "&amp;")
    assert f'href="{link}" data-compare-link>compare with baseline</a>' in page


def test_runs_without_logprobs_are_scored_under_each_runs_settings(approved_user, monkeypatch):
    """Both sequences go in each of the two requests, once under A's settings (unsteered)
    and once under B's (its steering); a run that asked for no logprobs is scored too."""
    steering = [{"activations": {"data": "x"}, "layer_indices": [6], "scale": 8.0}]
    a = finished_run(approved_user, completion=[(7042, " Paris")], response=WITHOUT_LOGPROBS)
    b = finished_run(approved_user, completion=[(24196, " Lyon")], response=WITHOUT_LOGPROBS)
    Run.objects.filter(pk=b.pk).update(request={**b.request, "apply_steering_vectors": steering})
    b.refresh_from_db()
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        # Every token −1 nat unsteered, −3 nats steered.
        logprob = -3.0 if body.get("apply_steering_vectors") else -1.0
        choices = [
            {"index": index, "text": "", "prompt_logprobs": [None] + [
                {str(token): {"logprob": logprob, "rank": 1, "decoded_token": "?"}}
                for token in prompt[1:]
            ]}
            for index, prompt in enumerate(body["prompt"])
        ]  # fmt: skip
        return httpx.Response(200, json={"choices": choices, "usage": {}})

    transport = httpx.MockTransport(answer)
    monkeypatch.setattr(
        "playground.compare.services.AcsClient", functools.partial(AcsClient, transport=transport)
    )
    comparison = RunComparison.objects.create(user=approved_user, run_a=a, run_b=b)
    comparison = compare.comparison_execute(comparison_id=comparison.pk)
    assert comparison.status == WorkStatus.SUCCEEDED, comparison.error_message
    sequences = [PROMPT["ids"] + [7042], PROMPT["ids"] + [24196]]
    assert [body["prompt"] for body in sent] == [sequences, sequences]
    assert [body.get("apply_steering_vectors") for body in sent] == [None, steering]
    assert all(body["prompt_logprobs"] == 0 and body["max_tokens"] == 1 for body in sent)
    differences = compare_differences.logprob_differences(comparison.results)
    assert differences["a"]["delta"] == differences["b"]["delta"] == [-2.0] * 5


def test_a_scoring_no_worker_finished_is_failed_by_the_sweep(approved_user):
    a = finished_run(approved_user, completion=[(7042, " Paris")])
    b = finished_run(approved_user, completion=[(24196, " Lyon")])
    stuck = RunComparison.objects.create(
        user=approved_user, run_a=a, run_b=b, status=WorkStatus.RUNNING,
        created_at=timezone.now() - dt.timedelta(hours=1),
    )  # fmt: skip
    fresh = RunComparison.objects.create(user=approved_user, run_a=b, run_b=a)
    assert tasks.runs_sweep_task() == 1
    stuck.refresh_from_db()
    fresh.refresh_from_db()
    assert (stuck.status, stuck.error_code) == (WorkStatus.FAILED, "worker_lost")
    assert fresh.status == WorkStatus.QUEUED


def test_the_mean_delta_is_over_the_generated_tokens_as_on_the_steering_page(
    ada, approved_user, monkeypatch
):
    """One definition of the mean Δ logprob on both pages: over the generated tokens only.
    Here the prompt's tokens move by −1 nat each and the generated ones by −4: the mean over
    prompt + completion (what the page showed) would be −1.5 for A's two generated tokens."""
    a = finished_run(approved_user, completion=[(7042, " Paris"), (13, ".")])
    b = finished_run(approved_user, completion=[(24196, " Lyon")])

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        steered = bool(body.get("apply_steering_vectors"))
        choices = [
            {"index": index, "text": "", "prompt_logprobs": [None] + [
                {str(token): {"rank": 1, "decoded_token": "?", "logprob": (
                    (-5.0 if position >= len(PROMPT["ids"]) else -2.0) if steered else -1.0
                )}}
                for position, token in enumerate(prompt) if position
            ]}
            for index, prompt in enumerate(body["prompt"])
        ]  # fmt: skip
        return httpx.Response(200, json={"choices": choices, "usage": {}})

    monkeypatch.setattr(
        "playground.compare.services.AcsClient",
        functools.partial(AcsClient, transport=httpx.MockTransport(answer)),
    )
    Run.objects.filter(pk=b.pk).update(
        request={
            **b.request,
            "apply_steering_vectors": [
                {"activations": {"data": "x"}, "layer_indices": [6], "scale": 8.0}
            ],
        }
    )
    b.refresh_from_db()
    comparison = RunComparison.objects.create(user=approved_user, run_a=a, run_b=b)
    compare.comparison_execute(comparison_id=comparison.pk)
    page = ada.get(compare_url(a, b)).content.decode()
    assert re.search(r'data-mean-delta="a">-4.000 nats/token<', page)
    assert re.search(r'data-mean-delta="b">-4.000 nats/token<', page)
    said = re.search(r'<p class="help" data-mean-definition>(.*?)</p>', page).group(1)
    assert html.unescape(said).startswith(scoring.MEAN_DELTA_DEFINITION + ";")
    # The page's acs_client code sends the same two requests and gets the same numbers.
    code = re.search(r'<pre id="notebook-compare">(.*?)</pre>', page, re.S).group(1)
    monkeypatch.setattr(
        "acs_client.client.AcsClient",
        functools.partial(AcsClient, transport=httpx.MockTransport(answer)),
    )
    monkeypatch.setenv("ACS_API_KEY", "acs-test")
    namespace = {}
    exec(compile(html.unescape(code), "notebook", "exec"), namespace)
    comparison.refresh_from_db()
    differences = compare_differences.logprob_differences(comparison.results)
    for side in ("a", "b"):
        assert namespace["delta"][side.upper()].tolist() == differences[side]["delta"]
        assert namespace["mean_delta"][side.upper()] == -4.0
    assert scoring.MEAN_DELTA_DEFINITION.startswith(
        "mean Δ logprob: the mean of Δ logprob over the generated tokens only"
    )
