"""A steering evaluation on the real path: the form (the gateway's tokenizer) states the
cost, the runs go through the worker (in this process, one after another) with the user's
playground key to the live gateway in front of the embedded engine, and a recording
transport keeps every raw request and answer. Checked here: the per-prompt numbers equal
what this test reads from the raw answers alone; scale 0 sits within the noise floor; a
strong scale moves the logit difference well beyond it; the tokens and activation requests
billed equal the cost the form stated; and the page's acs_client code, run against the same
gateway, reproduces the per-prompt numbers."""

import html
import json
import re

import numpy as np
import pytest
from django.urls import reverse

from accounts.services.playground_key import playground_key_get_or_create
from acs_client.client import AcsClient
from acs_portal.celery import app as celery_app
from api.models import LanguageModel
from api.selectors import registry_clear
from metering.models import UsageRecord
from metering.selectors import budget_windows
from playground.models import Run
from playground.runs import views
from playground.runs.execution import run_execute
from playground.steering_eval.models import SteeringEvaluation
from playground.vectors.services import steering_vector_create
from tests.conftest import ENGINE_MODEL_FIELDS
from tests.gateway.conftest import wait_settled

from .conftest import workers_client
from .test_figure_numbers import MODEL, MODEL_ENTRY, Recorder

pytestmark = pytest.mark.django_db(transaction=True)

DATASET = "\n".join(
    [
        "prompt,target,foil",
        "The capital of France is, Paris, Rome",
        "The Eiffel Tower is in the city of, Paris, Rome",
        '"In spring, many tourists visit", Paris, Rome',
    ]
)
STRONG = 4.0
SCALES = f"0, {STRONG:g}"
LAYER = 10


@pytest.fixture
def live(engine_url, gateway_url, approved_user, client, settings, redis_client, monkeypatch):
    """The registry on the engine, the workers' client recording, the page's client signed
    in as Ada; yields the recorder and the list of run ids the dispatch sent (in order)."""
    LanguageModel.objects.all().delete()
    LanguageModel.objects.create(
        name=MODEL, upstream_urls=[engine_url], **ENGINE_MODEL_FIELDS, max_logprobs=20,
        is_default=True,
    )  # fmt: skip
    registry_clear()
    settings.GATEWAY_URL = gateway_url
    settings.SITE_URL = gateway_url
    recorder = Recorder()
    workers_client(monkeypatch, recorder)
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL_ENTRY])
    sent = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args, **_: sent.append(args[0]))
    client.force_login(approved_user)
    yield recorder, sent
    wait_settled()
    registry_clear()


def run_all(sent: list[str]) -> list[str]:
    """Execute the dispatched runs one at a time (each finished run sends the group's next
    one); their ids in the order they ran."""
    ran = []
    while len(ran) < len(sent):
        run_execute(run_id=sent[len(ran)])
        ran.append(sent[len(ran)])
    return ran


def from_raw(evaluation, runs: list[Run], exchanges) -> dict:
    """Per (row, scale): Δ logit difference, Δ log p(target), flipped; and per row the
    repeats' ranges: from the raw bodies sent and answered, nothing of the playground's."""
    scored = {}
    for run, (body, answer) in zip(runs, exchanges, strict=True):
        row = evaluation.rows[run.meta["row"]]
        ids = row[f"{run.meta['completion']}_ids"]
        first = len(row["prompt_ids"])
        assert body["prompt"] == row["prompt_ids"] + ids
        entries = answer["choices"][0]["prompt_logprobs"]
        logprob = sum(entries[first + j][str(t)]["logprob"] for j, t in enumerate(ids))
        top = max(entries[first].items(), key=lambda item: item[1]["logprob"])[0]
        steering = body.get("apply_steering_vectors")
        condition = steering[0]["scale"] if steering else ("repeat", run.meta["repeat"])
        scored[(run.meta["row"], condition, run.meta["completion"])] = (logprob, top)
    result = {}
    for index in range(len(evaluation.rows)):
        repeats = [
            (scored[(index, ("repeat", r), "target")], scored[(index, ("repeat", r), "foil")])
            for r in range(evaluation.repeats)
        ]
        diffs = np.array([t[0] - f[0] for t, f in repeats])
        logprobs = np.array([t[0] for t, _ in repeats])
        result[("ranges", index)] = (np.ptp(diffs), np.ptp(logprobs))
        for scale in evaluation.scales:
            (target, top), (foil, _) = (
                scored[(index, scale, "target")],
                scored[(index, scale, "foil")],
            )
            flipped = top not in {t[1] for t, _ in repeats}
            result[(index, scale)] = (
                target - foil - diffs.mean(),
                target - logprobs.mean(),
                flipped,
            )
    return result


def paris_minus_rome(gateway_url: str, secret: str) -> np.ndarray:
    """Block LAYER's output at " Paris" minus at " Rome" (each a one-token prompt), captured
    with Ada's own key (not the playground key, whose billing the test checks)."""
    client = AcsClient(base_url=gateway_url, api_key=secret)
    rows = [
        client.completions(model=MODEL, prompt=word, max_tokens=1, temperature=0,
                           output_residual_stream=[LAYER]).residual_stream()[0, -1]
        for word in (" Paris", " Rome")
    ]  # fmt: skip
    return (rows[0] - rows[1]).astype(np.float32)


def test_a_dataset_evaluation_on_the_engine(
    live, approved_user, api_key_pair, gateway_url, client, monkeypatch
):
    recorder, sent = live
    vector = steering_vector_create(
        user=approved_user, name="paris-rome", model=MODEL, layer=LAYER, method="upload",
        vector=paris_minus_rome(gateway_url, api_key_pair[1]),
    )  # fmt: skip
    data = {"model": MODEL, "steereval-vector": str(vector.pk), "steereval-scales": SCALES,
            "steereval-steer_at": "all", "steereval-dataset": DATASET}  # fmt: skip
    url = reverse("playground:steering_eval_submit")
    first = client.post(url, data).content.decode()
    stated = int(re.search(r'name="steereval-confirmed_cost" value="(\d+)"', first).group(1))
    assert f"= {stated:,} tokens" in first
    assert client.post(url, {**data, "steereval-confirmed_cost": stated}).status_code == 302
    evaluation = SteeringEvaluation.objects.get()
    ran = run_all(sent)
    runs = {str(run.id): run for run in Run.objects.filter(group=evaluation.id)}
    assert len(ran) == len(runs) == 3 * (2 + 3) * 2
    assert all(run.status == "succeeded" for run in runs.values())
    expected = from_raw(evaluation, [runs[run_id] for run_id in ran], recorder.exchanges)

    document = json.loads(
        client.get(reverse("playground:steering_eval_json", args=[evaluation.id])).content
    )
    for record in document["per_prompt"]:
        delta, logprob_delta, flipped = expected[(record["row"], record["scale"])]
        assert record["delta_logit_diff"] == pytest.approx(delta, abs=1e-12)
        assert record["delta_target_logprob"] == pytest.approx(logprob_delta, abs=1e-12)
        assert record["flipped"] == flipped
    floor = document["noise_floor"]["logit_diff"]
    assert floor == pytest.approx(max(expected[("ranges", i)][0] for i in range(3)), abs=1e-12)
    zero, strong = document["summary"]
    # Scale 0 is an exact no-op: its mean change is within what identical requests differ by.
    assert abs(zero["logit_diff_mean"]) <= floor
    assert zero["logit_diff_within_floor"] and zero["flipped"] == 0
    # A strong scale towards Paris moves the logit difference up, far beyond the floor, its
    # interval clear of 0.
    assert strong["logit_diff_mean"] > 0.5 + 10 * floor
    assert strong["logit_diff_ci_low"] > 0
    print(
        f"steering evaluation on the engine: floor {floor:.2e} nats; scale 0 mean Δ "
        f"{zero['logit_diff_mean']:.2e}; scale {STRONG:g} mean Δ {strong['logit_diff_mean']:.3f}"
        f" [{strong['logit_diff_ci_low']:.3f}, {strong['logit_diff_ci_high']:.3f}], flipped "
        f"{strong['flipped']} of {strong['prompts']}"
    )

    # What was billed is what the form stated.
    wait_settled()
    key, secret = playground_key_get_or_create(user=approved_user)
    records = UsageRecord.objects.filter(key=key, endpoint__contains="completions")
    assert records.count() == evaluation.cost["requests"]
    billed = sum(r.prompt_tokens + r.completion_tokens for r in records)
    assert billed == stated == evaluation.cost["total_tokens"]
    activation = next(w for w in budget_windows(key=key) if w["name"] == "activation_requests")
    assert activation["used"] == evaluation.cost["activation_requests"] == 3 * 2 * 2

    # The page's acs_client code, run against the same gateway, gets the same numbers.
    page = client.get(reverse("playground:steering_eval_detail", args=[evaluation.id]))
    code = re.search(r'<pre id="notebook-[^"]+">(.*?)</pre>', page.content.decode(), re.S)
    monkeypatch.setenv("ACS_API_KEY", secret)
    namespace = {}
    exec(compile(html.unescape(code.group(1)), "notebook", "exec"), namespace)
    for mine, theirs in zip(namespace["per_prompt"], document["per_prompt"], strict=True):
        assert mine["delta_logit_diff"] == pytest.approx(
            theirs["delta_logit_diff"], abs=floor + 1e-6
        )
        assert mine["flipped"] == theirs["flipped"]
