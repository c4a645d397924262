"""Steering evaluated over a dataset, without the engine: the dataset's field errors naming
the bad row, the cost stated before anything is sent (and refused when the playground key
cannot afford it), the runs it queues (one sequence each, the repeats spread among the
steered ones, dispatched a few at a time), cancelling, the API's budget refusals, and every
number the page and downloads show — per prompt recomputed by hand from the stored /v1
answers, per scale recomputed with numpy from the downloaded per-prompt numbers — and the
`acs_client` code that gets the same numbers. Ada is an approved researcher, Eve another
user. The real tokenizer and engine are in test_steering_eval_engine.py."""

import csv
import functools
import html as html_module
import io
import json
import re

import httpx
import numpy as np
import pytest
from django.urls import reverse

from accounts.models import ApiKey
from accounts.services.playground_key import playground_key_get_or_create
from acs_client.client import AcsClient
from acs_client.codec import decode
from api.tokenizer import PromptTokens
from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind
from playground.runs import views
from playground.steering_eval import dataset, forms, services
from playground.steering_eval.models import SteeringEvaluation
from playground.vectors.services import steering_vector_create

from .conftest import HTMX, MODEL

pytestmark = pytest.mark.django_db

HIDDEN = 576
ROWS = [
    ("The capital of France is", " Paris", " Rome"),
    ("The Eiffel Tower stands in", " Paris", " London"),
    ("Big Ben stands in", " London", " Paris"),
    ("The Colosseum stands in", " Rome", " Paris France"),
]
DATASET = "prompt,target,foil\n" + "".join(f'"{p}","{t}","{f}"\n' for p, t, f in ROWS)
SCALES = [0.0, 8.0]
REPEATS = services.REPEATS
# The test's own bootstrap, written from the page's stated definition.
RESAMPLES, SEED = 2000, 0


def word_tokens(text: str, add_special_tokens: bool) -> PromptTokens:
    """A stand-in tokenizer: one token per word (a leading space belongs to its word)."""
    words = re.findall(r" ?\S+", text)
    return PromptTokens(ids=[1000 + sum(map(ord, w)) for w in words], strings=words)


@pytest.fixture(autouse=True)
def tokenizer(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    monkeypatch.setattr(
        forms, "tokenize", lambda model_id, texts: [word_tokens(t, s) for t, s in texts]
    )


@pytest.fixture
def vector(approved_user):
    values = np.random.default_rng(3).normal(size=HIDDEN).astype(np.float32)
    return steering_vector_create(
        user=approved_user, name="france", model="smollm2-135m", layer=12,
        method="upload", vector=values,
    )  # fmt: skip


def form_data(vector, **fields) -> dict:
    data = {
        "model": "smollm2-135m",
        "steereval-vector": str(vector.pk),
        "steereval-scales": ", ".join(f"{s:g}" for s in SCALES),
        "steereval-steer_at": "all",
        "steereval-dataset": DATASET,
    }
    data.update({f"steereval-{name}": value for name, value in fields.items()})
    return data


def form_errors(user, vector, **fields) -> dict:
    form = forms.SteeringEvalForm(
        form_data(vector, **fields), user=user, capabilities=forms.ModelCapabilities(MODEL)
    )
    assert not form.is_valid()
    return form.errors


# ---------------------------------------------------------------------------------------
# The dataset


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prompt,target\nA,b\n", "Line 1 (the header): missing column “foil”"),
        ('{"prompt": "A", "target": " b"}\n', "Row 1 (line 1): missing column “foil”."),
        ("prompt,target,foil\nA, b, c\nB,,c\n", "Row 2 (line 3): the target is empty."),
        ("prompt,target,foil\nA, b, b\n", "Row 1 (line 2): the target equals the foil (' b')"),
        (
            '{"prompt": "A", "target": " b", "foil": " c"}\n{"prompt": "B", target}\n',
            "Row 2 (line 2) is not JSON: Expecting property name enclosed in double quotes.",
        ),
        (
            "prompt,target,foil\n" + "A, b, c\n" * (dataset.MAX_ROWS + 1),
            f"Too many rows: more than {dataset.MAX_ROWS}; at most {dataset.MAX_ROWS}.",
        ),
        ("prompt,target,foil\nA, b, c, d\n", "Row 1 (line 2): 4 values for 3 columns"),
        ("  \n", "Paste the dataset or upload a file."),
    ],
    ids=["header", "jsonl-key", "empty", "equal", "not-json", "too-many", "extra", "blank"],
)
def test_malformed_rows_are_refused_naming_the_row(approved_user, vector, text, message):
    errors = form_errors(approved_user, vector, dataset=text)
    assert message in errors["dataset"][0]


def test_jsonl_and_csv_give_the_same_rows_keeping_leading_spaces():
    jsonl = "".join(json.dumps({"prompt": p, "target": t, "foil": f}) + "\n" for p, t, f in ROWS)
    for text in (DATASET, jsonl):
        rows = dataset.parse_dataset(text)
        assert [(r.prompt, r.target, r.foil) for r in rows] == ROWS


def test_an_uploaded_file_is_read_and_its_errors_named_beside_it(ada, vector):
    upload = io.BytesIO(b"prompt,target,foil\nA, b, b\n")
    upload.name = "rows.csv"
    data = form_data(vector, dataset="", dataset_file=upload)
    response = ada.post(reverse("playground:steering_eval_submit"), data)
    assert response.status_code == 400
    html = response.content.decode()
    assert 'id="id_steereval-dataset_file"' in html
    assert "the target equals the foil" in html
    assert not Run.objects.exists()


def test_a_too_long_completion_and_a_vector_of_another_model_are_refused(approved_user, vector):
    long = "prompt,target,foil\nA, a b c d e f g h i, c\n"
    assert form_errors(approved_user, vector, dataset=long)["dataset"] == [
        "Row 1: the target is 9 tokens; at most 8: ‘·a’ ‘·b’ ‘·c’ ‘·d’ ‘·e’ ‘·f’ ‘·g’ ‘·h’ ‘·i’."
    ]
    vector.model = "llama-8b"
    vector.save()
    assert "This vector was made on llama-8b" in form_errors(approved_user, vector)["vector"][0]


@pytest.mark.parametrize(
    ("scales", "message"),
    [("0, 0", "Scales: each scale once."), ("1, 2, 3, 4, 5, 6, 7", "Scales: at most 6")],
)
def test_scales_are_checked(approved_user, vector, scales, message):
    assert message in form_errors(approved_user, vector, scales=scales)["scales"][0]


# ---------------------------------------------------------------------------------------
# The cost, then the runs


def expected_cost() -> dict:
    """Counted by hand: every request is one prompt + one completion, and generates one."""
    requests = prompt_tokens = 0
    for prompt, target, foil in ROWS:
        for completion in (target, foil):
            length = len(prompt.split()) + len(completion.split())
            requests += len(SCALES) + REPEATS
            prompt_tokens += (len(SCALES) + REPEATS) * length
    return {
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": requests,
        "total_tokens": prompt_tokens + requests,
        "activation_requests": len(ROWS) * 2 * len(SCALES),
    }


@pytest.fixture
def submit(ada, vector, django_capture_on_commit_callbacks):
    """Post the form twice as a person does: once to see the cost, once to confirm it."""

    def post(htmx=False, **fields):
        headers = HTMX if htmx else {}
        url = reverse("playground:steering_eval_submit")
        first = ada.post(url, form_data(vector, **fields), **headers)
        total = re.search(r'name="steereval-confirmed_cost" value="(\d+)"', first.content.decode())
        assert total, first.content.decode()
        data = form_data(vector, confirmed_cost=total.group(1), **fields)
        with django_capture_on_commit_callbacks(execute=True):
            second = ada.post(url, data, **headers)
        return first, second

    return post


def test_the_cost_is_stated_before_anything_is_sent(ada, vector, no_enqueue):
    response = ada.post(reverse("playground:steering_eval_submit"), form_data(vector), **HTMX)
    html = response.content.decode()
    cost = expected_cost()
    assert response["HX-Retarget"] == "#steering-eval-form"
    assert (
        f"{cost['requests']} requests (4 prompts × (2 scales + 3 unsteered repeats) × 2 "
        f"completions): {cost['prompt_tokens']} prompt tokens + {cost['completion_tokens']} "
        f"generated tokens (one per request) = {cost['total_tokens']} tokens, and "
        f"{cost['activation_requests']} activation requests"
    ) in html
    assert "Run the evaluation" in html
    assert not Run.objects.exists() and no_enqueue == []


def test_a_cost_over_the_playground_keys_budget_is_refused_naming_the_window(
    approved_user, ada, vector
):
    key, _ = playground_key_get_or_create(user=approved_user)
    ApiKey.objects.filter(pk=key.pk).update(monthly_activation_quota=5)
    response = ada.post(reverse("playground:steering_eval_submit"), form_data(vector))
    html = html_module.unescape(response.content.decode())
    assert response.status_code == 400
    assert (
        "Your Playground key's budget is too small for this evaluation: it needs 16 activation "
        "requests and “Activation requests, this month” has 5 left"
    ) in html
    assert not Run.objects.exists()


def test_confirmed_it_queues_one_sequence_per_run_and_sends_a_few_at_a_time(
    vector, no_enqueue, submit, settings
):
    _, response = submit()
    evaluation = SteeringEvaluation.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("playground:steering_eval_detail", args=[evaluation.id])
    assert evaluation.cost == expected_cost()
    runs = list(Run.objects.filter(group=evaluation.id).order_by("created_at"))
    assert len(runs) == expected_cost()["requests"]
    assert {run.kind for run in runs} == {RunKind.STEERING_EVAL}
    assert len(no_enqueue) == settings.PLAYGROUND_GROUP_RUNS_IN_FLIGHT
    assert no_enqueue == [str(run.id) for run in runs[: len(no_enqueue)]]
    prompt, target, foil = ROWS[0]
    prompt_ids = word_tokens(prompt, True).ids
    first = runs[: 2 * (len(SCALES) + REPEATS)]
    # The first prompt's runs: a repeat, scale 0, a repeat, scale 8, a repeat; each target
    # then foil.
    assert [(r.meta["role"], r.scale, r.meta["completion"]) for r in first] == [
        ("repeat", None, "target"), ("repeat", None, "foil"),
        ("steered", 0.0, "target"), ("steered", 0.0, "foil"),
        ("repeat", None, "target"), ("repeat", None, "foil"),
        ("steered", 8.0, "target"), ("steered", 8.0, "foil"),
        ("repeat", None, "target"), ("repeat", None, "foil"),
    ]  # fmt: skip
    unsteered = {
        "model": "smollm2-135m",
        "prompt": prompt_ids + word_tokens(target, False).ids,
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 1,
        "return_token_ids": True,
    }
    assert first[0].request == unsteered
    assert first[1].request["prompt"] == prompt_ids + word_tokens(foil, False).ids
    (steering,) = first[6].request.pop("apply_steering_vectors")
    assert first[6].request == unsteered
    assert steering["layer_indices"] == [12] and steering["scale"] == 8.0
    assert "position_indices" not in steering and steering["norm_match"] is False
    np.testing.assert_array_equal(decode(steering["activations"])[0], decode(vector.data))


def test_steering_at_the_prompts_last_position(vector, no_enqueue, submit):
    submit(steer_at="last")
    for run in Run.objects.filter(meta__role="steered", meta__row=2):
        prompt_length = len(ROWS[2][0].split())
        assert run.request["apply_steering_vectors"][0]["position_indices"] == [prompt_length - 1]


def test_the_same_confirmed_submission_twice_makes_one_evaluation(ada, vector, no_enqueue):
    data = form_data(vector, confirmed_cost=expected_cost()["total_tokens"])
    data["steereval-submit_token"] = "7f0c2f4e-7d4c-4f59-9b8e-0d3b1f0b4a11"
    ada.post(reverse("playground:steering_eval_submit"), data)
    ada.post(reverse("playground:steering_eval_submit"), data)
    assert SteeringEvaluation.objects.count() == 1


def test_htmx_confirmation_shows_the_evaluation_and_resets_the_form(vector, no_enqueue, submit):
    _, response = submit(htmx=True)
    html = response.content.decode()
    assert 'class="steering-evaluation"' in html and 'hx-trigger="load delay:1s"' in html
    assert f"Running: 0 of {expected_cost()['requests']} requests finished" in html
    assert 'id="steering-eval-form" ' in html and 'hx-swap-oob="true"' in html
    assert "Check the dataset and its cost" in html, "the next evaluation is priced again"


def test_cancel_fails_the_queued_runs_and_says_what_ran(ada, vector, no_enqueue, submit):
    submit()
    evaluation = SteeringEvaluation.objects.get()
    runs = list(Run.objects.filter(group=evaluation.id).order_by("created_at"))
    for run in runs[:3]:
        succeed(run, scored_answer(run, evaluation, logprob=-1.0, top=None))
    Run.objects.filter(pk=runs[3].pk).update(status=WorkStatus.RUNNING)
    url = reverse("playground:steering_eval_cancel", args=[evaluation.id])
    html = ada.post(url, **HTMX).content.decode()
    cancelled = len(runs) - 4
    assert Run.objects.filter(status=WorkStatus.CANCELLED).count() == cancelled
    assert Run.objects.get(pk=runs[3].pk).status == WorkStatus.RUNNING
    assert (
        f"<strong>Cancelled.</strong> Ran: 3 of {len(runs)} requests. Cancelled before they "
        f"were sent (never billed): {cancelled}. Still finishing: 1 already sent."
    ) in html
    assert "Cancel the evaluation" not in html


def test_another_users_evaluation_is_404_everywhere(client, other_user, no_enqueue, submit):
    submit()
    evaluation = SteeringEvaluation.objects.get()
    client.force_login(other_user)
    for name in ("steering_eval_detail", "steering_eval_json", "steering_eval_csv"):
        url = reverse(f"playground:{name}", args=[evaluation.id])
        assert client.get(url).status_code == 404
    cancel = reverse("playground:steering_eval_cancel", args=[evaluation.id])
    assert client.post(cancel).status_code == 404
    assert not Run.objects.filter(status=WorkStatus.CANCELLED).exists()


def test_the_playground_page_does_not_take_an_evaluation_for_a_comparison(
    ada, vector, no_enqueue, submit
):
    submit()
    page = ada.get(reverse("playground:page")).content.decode()
    assert "Steered vs baseline" not in page
    assert 'href="/playground/steering-eval/"' in page
    group = SteeringEvaluation.objects.get().id
    assert ada.get(reverse("playground:group_detail", args=[group])).status_code == 404


# ---------------------------------------------------------------------------------------
# The numbers, against numpy on the stored answers


def scored_answer(run: Run, evaluation, *, logprob: float, top: int | None) -> dict:
    """A /v1 answer to a run's one sequence (prompt + completion, `prompt_logprobs: 1`):
    each completion token at `logprob`, the other positions at −1, and at the first
    completion position the rank-1 token `top` (None: the completion's own token)."""
    ids = run.request["prompt"]
    prompt_length = len(evaluation.rows[run.meta["row"]]["prompt_ids"])
    entries = [None]
    for position in range(1, len(ids)):
        value = logprob if position >= prompt_length else -1.0
        entry = {str(ids[position]): {"logprob": value, "rank": 1, "decoded_token": "w"}}
        if position == prompt_length and top is not None and top != ids[position]:
            entry[str(ids[position])]["rank"] = 7
            entry[str(top)] = {"logprob": -0.01, "rank": 1, "decoded_token": f"t{top}"}
        entries.append(entry)
    return {
        "choices": [{"index": 0, "text": "x", "prompt_logprobs": entries}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": 1 + len(ids)},
    }


def succeed(run: Run, response: dict) -> None:
    Run.objects.filter(pk=run.pk).update(
        status=WorkStatus.SUCCEEDED, response=response, request_id=f"req-{run.pk.hex[:8]}"
    )


@pytest.fixture
def answered(submit):
    """A finished evaluation: its repeats a few hundredths apart, scale 0 like a repeat, scale
    8 moving each prompt's target up and its foil down by its own amount and flipping the
    top token of rows 1 and 3; rows 0's foil at scale 8 refused by the budget."""
    submit()
    evaluation = SteeringEvaluation.objects.get()
    generator = np.random.default_rng(11)
    for run in Run.objects.filter(group=evaluation.id):
        row, completion = run.meta["row"], run.meta["completion"]
        base = -2.0 - row if completion == "target" else -3.0 + 0.5 * row
        top = None
        if run.scale == 8.0:
            shift = (1.5 + row) * (1 if completion == "target" else -1)
            value = base + shift
            top = 99 if row in (1, 3) else None
        else:
            value = base + generator.normal(scale=0.02)
        if run.scale == 8.0 and row == 0 and completion == "foil":
            Run.objects.filter(pk=run.pk).update(
                status=WorkStatus.FAILED, error_code="budget_exceeded",
                error_message="This key's monthly token budget is spent.",
            )  # fmt: skip
            continue
        succeed(run, scored_answer(run, evaluation, logprob=value, top=top))
    return evaluation


def by_hand(evaluation) -> dict:
    """Per (row, scale): Δ logit difference, Δ target logprob and whether the top token
    flipped, read from the stored answers without the playground's code."""

    def read(run):
        entries = run.response["choices"][0]["prompt_logprobs"]
        row = evaluation.rows[run.meta["row"]]
        first = len(row["prompt_ids"])
        ids = row[f"{run.meta['completion']}_ids"]
        logprob = float(np.sum([entries[first + j][str(t)]["logprob"] for j, t in enumerate(ids)]))
        top = next(token for token, e in entries[first].items() if e["rank"] == 1)
        return logprob, top

    scored = {}
    for run in Run.objects.filter(group=evaluation.id, status=WorkStatus.SUCCEEDED):
        key = (run.meta["row"], run.scale, run.meta.get("repeat"), run.meta["completion"])
        scored[key] = read(run)
    expected = {}
    for row in range(len(ROWS)):
        repeats = [(scored[(row, None, r, "target")], scored[(row, None, r, "foil")])
                   for r in range(REPEATS)]  # fmt: skip
        diffs = np.array([t[0] - f[0] for t, f in repeats])
        logprobs = np.array([t[0] for t, _ in repeats])
        tops = {t[1] for t, _ in repeats}
        expected[("range", row)] = (np.ptp(diffs), np.ptp(logprobs))
        for scale in SCALES:
            if (row, scale, None, "foil") not in scored:
                expected[(row, scale)] = None
                continue
            (target, top), (foil, _) = (
                scored[(row, scale, None, "target")],
                scored[(row, scale, None, "foil")],
            )
            expected[(row, scale)] = (
                target - foil - diffs.mean(),
                target - logprobs.mean(),
                top not in tops,
            )
    return expected


def bootstrap(values: list[float]) -> tuple[float, float]:
    """The page's stated interval, written here from its definition."""
    data = np.array(values)
    rng = np.random.default_rng(SEED)
    means = data[rng.integers(0, len(data), size=(RESAMPLES, len(data)))].mean(axis=1)
    return tuple(np.percentile(means, [2.5, 97.5]))


def test_per_prompt_numbers_match_the_stored_answers_and_means_match_numpy(ada, answered):
    expected = by_hand(answered)
    document = json.loads(
        ada.get(reverse("playground:steering_eval_json", args=[answered.id])).content
    )
    as_csv = ada.get(reverse("playground:steering_eval_csv", args=[answered.id]))
    assert as_csv["Content-Disposition"] == (
        f'attachment; filename="steering-eval-{answered.id}.csv"'
    )
    rows = list(csv.DictReader(io.StringIO(as_csv.content.decode())))
    assert len(rows) == len(document["per_prompt"]) == len(ROWS) * len(SCALES)
    for record, row in zip(document["per_prompt"], rows, strict=True):
        wanted = expected[(record["row"], record["scale"])]
        assert float(row["scale"]) == record["scale"] and int(row["row"]) == record["row"]
        if wanted is None:
            assert record["delta_logit_diff"] is None and row["delta_logit_diff"] == ""
            continue
        assert record["delta_logit_diff"] == pytest.approx(wanted[0], abs=1e-12)
        assert record["delta_target_logprob"] == pytest.approx(wanted[1], abs=1e-12)
        assert record["flipped"] == wanted[2]
        assert float(row["delta_logit_diff"]) == pytest.approx(wanted[0], abs=1e-12)
        assert row["flipped"] == str(wanted[2])
    floors = document["noise_floor"]
    assert floors["logit_diff"] == pytest.approx(
        max(expected[("range", row)][0] for row in range(len(ROWS))), abs=1e-12
    )
    # The summary, recomputed from the downloaded CSV's per-prompt numbers alone.
    for summary in document["summary"]:
        points = [r for r in rows if float(r["scale"]) == summary["scale"] and r["flipped"]]
        assert summary["prompts"] == len(points)
        for metric in ("logit_diff", "target_logprob"):
            values = [float(r[f"delta_{metric}"]) for r in points]
            low, high = bootstrap(values)
            assert summary[f"{metric}_mean"] == pytest.approx(np.mean(values), abs=1e-12)
            assert summary[f"{metric}_ci_low"] == pytest.approx(low, abs=1e-12)
            assert summary[f"{metric}_ci_high"] == pytest.approx(high, abs=1e-12)
        assert summary["flipped"] == sum(r["flipped"] == "True" for r in points)
    scale_zero, strong = document["summary"]
    assert scale_zero["prompts"] == 4 and strong["prompts"] == 3, "row 0's foil was refused"
    assert strong["flipped"] == 2 and scale_zero["flipped"] == 0
    assert document["bootstrap"] == {"resamples": RESAMPLES, "seed": SEED, "confidence": 0.95}
    assert document["rows"][3]["foil_strings"] == [" Paris", " France"]


def test_the_page_shows_the_table_figures_floor_and_the_budget_refusal(ada, answered):
    html = ada.get(reverse("playground:steering_eval_detail", args=[answered.id])).content
    html = html_module.unescape(html.decode())
    numbers = json.loads(
        re.search(r'id="steering-eval-numbers"[^>]*>(.*?)</script>', html, re.S).group(1)
    )
    strong = numbers["summary"][1]
    cell = re.search(r'<tr data-scale="8.0">.*?<td class="logit-diff">(.*?)</td>', html, re.S)
    assert cell.group(1) == (
        f"{strong['logit_diff_mean']:.3f} [{strong['logit_diff_ci_low']:.3f}, "
        f"{strong['logit_diff_ci_high']:.3f}]"
    )
    assert "Your budget or quota is spent" in html and "budget_exceeded" in html
    assert 'data-plot="steering-eval-logit-diff"' in html
    assert 'data-plot="steering-eval-target-logprob"' in html
    figure = json.loads(
        re.search(r'id="steering-eval-logit-diff"[^>]*>(.*?)</script>', html, re.S).group(1)
    )
    means = figure["data"][1]
    assert means["y"] == [s["logit_diff_mean"] for s in numbers["summary"]]
    assert "Done: " in html and 'data-finished="true"' in html


def test_the_notebook_code_computes_the_same_numbers(ada, answered, monkeypatch):
    """The page's acs_client code, answered with the evaluation's own stored answers
    (matched by request body), gives its per-prompt changes and summary."""
    Run.objects.filter(error_code="budget_exceeded").update(status=WorkStatus.QUEUED)
    run = Run.objects.get(status=WorkStatus.QUEUED)
    succeed(run, scored_answer(run, answered, logprob=-9.0, top=None))
    html = ada.get(reverse("playground:steering_eval_detail", args=[answered.id])).content
    code = re.search(r'<pre id="notebook-[^"]+">(.*?)</pre>', html.decode(), re.S).group(1)
    answers = {}
    for run in Run.objects.filter(group=answered.id).order_by("created_at"):
        request = {key: value for key, value in run.request.items() if key != "return_token_ids"}
        answers.setdefault(json.dumps(request, sort_keys=True), []).append(run.response)

    def handler(request: httpx.Request) -> httpx.Response:
        stored = answers[json.dumps(json.loads(request.content), sort_keys=True)]
        return httpx.Response(200, json=stored.pop(0) if len(stored) > 1 else stored[0])

    monkeypatch.setattr(
        "acs_client.client.AcsClient",
        functools.partial(AcsClient, transport=httpx.MockTransport(handler)),
    )
    monkeypatch.setenv("ACS_API_KEY", "acs-test")
    namespace = {}
    exec(compile(html_module.unescape(code), "notebook", "exec"), namespace)
    document = json.loads(
        ada.get(reverse("playground:steering_eval_json", args=[answered.id])).content
    )
    for mine, theirs in zip(namespace["per_prompt"], document["per_prompt"], strict=True):
        assert mine["delta_logit_diff"] == pytest.approx(theirs["delta_logit_diff"], abs=1e-12)
        assert mine["flipped"] == theirs["flipped"]
    for summary in document["summary"]:
        mean, low, high = namespace["summary"][summary["scale"]]["logit_diff"]
        assert (mean, low, high) == pytest.approx(
            (summary["logit_diff_mean"], summary["logit_diff_ci_low"],
             summary["logit_diff_ci_high"]), abs=1e-12,
        )  # fmt: skip
    assert namespace["noise_floor"]["logit_diff"] == pytest.approx(
        document["noise_floor"]["logit_diff"], abs=1e-12
    )


def test_an_empty_library_says_where_vectors_come_from(ada):
    html = ada.get(reverse("playground:steering_eval")).content.decode()
    assert "Your library has no vector yet" in html
    assert "The evaluation appears here once you run it." in html


def test_an_uploaded_dataset_is_priced_and_kept_in_the_text_box(ada, vector, no_enqueue):
    jsonl = "".join(json.dumps({"prompt": p, "target": t, "foil": f}) + "\n" for p, t, f in ROWS)
    upload = io.BytesIO(jsonl.encode())
    upload.name = "rows.jsonl"
    data = form_data(vector, dataset="", dataset_file=upload)
    html = ada.post(reverse("playground:steering_eval_submit"), data).content.decode()
    assert f"= {expected_cost()['total_tokens']} tokens" in html
    # The file cannot be sent again by the browser: its text is, once confirmed.
    assert jsonl.splitlines()[0] in html_module.unescape(html)
    assert not Run.objects.exists()


def test_a_plain_post_below_an_earlier_evaluation_states_the_new_cost(
    ada, vector, no_enqueue, submit
):
    submit()
    response = ada.post(reverse("playground:steering_eval_submit"), form_data(vector, scales="0"))
    html = response.content.decode()
    assert response.status_code == 200 and "<html" in html
    cost = re.search(r'<p class="evaluation-cost[^"]*"[^>]*>(.*?)</p>', html, re.S).group(1)
    assert "4 prompts × (1 scale + 3 unsteered repeats)" in cost
    assert "Cost stated before it was sent: 40 requests (4 prompts × (2 scales" in html
