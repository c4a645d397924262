"""Linear probes without the engine: the dataset's and the form's errors (naming the bad row
and why), the cost stated before anything is submitted, one probe per form submission, the
worker's steps against a stand-in gateway (the harvest submitted with the playground key and an
Idempotency-Key, followed with a countdown rather than a waiting worker, a refused submission
and a failed harvest kept with the API's code, a spent quota worded as such), cancelling (the
harvest cancelled through /v1, the worker's later writes refused), the stuck sweep, and another
user's probe. The numbers themselves, on the real engine: test_probes_numbers.py."""

import csv
import datetime as dt
import functools
import hashlib
import io
import json
import uuid

import httpx
import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

from accounts.services.playground_key import playground_key_get_or_create
from acs_client.client import AcsClient
from acs_client.responses import HarvestJob
from acs_portal.celery import app as celery_app
from infra.lifecycle import WorkStatus
from playground.probes import datasets, fitting, forms, services
from playground.probes.models import Probe
from playground.runs import views

from .conftest import HTMX, MODEL
from .test_runs import error

pytestmark = pytest.mark.django_db

JOB_ID = "0b8f5a52-0f4e-4c55-9d8c-1d1f3cf0a002"
GOOD = "text,label\n" + "".join(
    f"Row {index} is about {topic}.,{topic}\n" for index in range(8) for topic in ("cats", "dogs")
)


async def word_counts(model_id: str, texts: list[str]) -> list[int]:
    """A stand-in tokenizer: one token per word."""
    return [len(text.split()) for text in texts]


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    monkeypatch.setattr(forms, "_token_counts", word_counts)


@pytest.fixture
def sent(monkeypatch):
    """The tasks enqueued: (name, id, countdown)."""
    queued = []
    monkeypatch.setattr(
        celery_app,
        "send_task",
        lambda name, args, countdown=None, **_: queued.append((name, args[0], countdown)),
    )
    return queued


@pytest.fixture
def gateway(monkeypatch):
    """The probe worker's /v1 calls answered by `gateway.handler`; kept in `gateway.requests`."""

    class Gateway:
        def __init__(self):
            self.requests, self.handler = [], None

        def __call__(self, request):
            self.requests.append(request)
            return self.handler(request)

    fake = Gateway()
    transport = httpx.MockTransport(fake)
    monkeypatch.setattr(services, "AcsClient", functools.partial(AcsClient, transport=transport))
    return fake


def post(client, action="fit", **fields):
    data = {
        "model": "smollm2-135m",
        "action": action,
        "probe-dataset": GOOD,
        "probe-layers": "3, 15",
        "probe-pooling": "mean",
        "probe-seed": 0,
        "probe-test_fraction": 0.25,
        "probe-regularisation_c": 1.0,
        "probe-submit_token": str(uuid.uuid4()),
    }
    data.update({f"probe-{name}": value for name, value in fields.items()})
    return client.post(reverse("playground:probe_submit"), data)


def field_errors(response, field: str) -> list[str]:
    return response.context["form"].errors.get(field, [])


# ---------------------------------------------------------------------------------------
# The dataset and the form


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ("text,label\nA cat.,cats\n,dogs\n", "Line 3: missing text."),
        ("text,label\nA cat.,cats\nA dog.\n", "Line 3: missing label."),
        ('{"text": "A cat.", "label": "cats"}\n{"text": "A dog."}\n', "Line 2: missing label."),
        ('{"text": "A cat.", "label": 1}\n{"label": 0}\n', "Line 2: missing text."),
        ('{"text": "A cat.", "label": "cats"}\n{"text": "A dog.",\n', "Line 2 is not JSON."),
        (
            "text,label\nA cat.,cats\nA dog.,dogs\nA cow.,cows\n",
            "Line 4: label “cows” is a third class; the rows before it have “cats” and “dogs”, "
            "and a probe here tells two apart.",
        ),
        (
            "text,label\n" + "A cat.,cats\n" * 1000 + "A dog.,dogs\n" * 1001,
            "More than 2,000 rows: Line 2002 is one too many.",
        ),
        ("words,class\nA cat.,cats\n", "The CSV's first line must name its columns, text and "
         "label (e.g. “text,label”); it names words, class. JSON Lines starts each line with {."),
        ("text,label\nA cat.,cats\nA cow.,cats\n", "A probe needs rows of two classes; this "
         "dataset has one (every row is “cats”)."),
    ],
    ids=["csv-no-text", "csv-no-label", "jsonl-no-label", "jsonl-no-text", "not-json",
         "third-class", "too-many-rows", "no-header", "one-class"],
)  # fmt: skip
def test_a_malformed_row_is_a_field_error_naming_its_line_and_why(ada, dataset, message):
    response = post(ada, dataset=dataset)
    assert response.status_code == 400
    assert field_errors(response, "dataset") == [message]
    assert not Probe.objects.exists()


def test_too_few_rows_of_a_class_for_the_split_names_the_class_and_the_need(ada):
    dataset = "text,label\n" + "A cat.,cats\n" * 10 + "A dog.,dogs\n" * 3
    response = post(ada, dataset=dataset, test_fraction=0.25)
    assert field_errors(response, "dataset") == [
        "Class “dogs” has 3 rows; with a test fraction of 0.25 each class needs at least 8, so "
        "that both splits hold 2 of it."
    ]
    assert datasets.min_rows_per_class(0.5) == 4


def test_layers_are_checked_by_the_apis_layer_rule(ada):
    assert field_errors(post(ada, layers="3, 30"), "layers") == [
        "Layer 30 in 'Layers' is out of range; this model has layers 0–29."
    ]
    assert field_errors(post(ada, layers="3, 3"), "layers") == [
        "Layers: 3 is listed more than once."
    ]


def test_a_one_token_text_has_no_mean_after_its_first_position(ada):
    dataset = GOOD + "Cats,cats\n"
    assert field_errors(post(ada, dataset=dataset), "dataset") == [
        "Row 17 (“Cats”) is one token: its mean after the first position is empty. Use the "
        "last token, or a longer text."
    ]
    counted = post(ada, action="count", dataset=dataset, pooling="last")
    assert counted.context["form"].errors == {}


def test_an_uploaded_file_takes_the_place_of_the_pasted_text(ada, sent):
    upload = {"probe-dataset_file": _file('{"text": "A cat.", "label": "cats"}\n{"text": "A')}
    response = ada.post(
        reverse("playground:probe_submit"),
        {**_form_fields(), **upload, "probe-dataset": GOOD},
    )
    assert field_errors(response, "dataset") == ["Line 2 is not JSON."]
    # The form shown again holds the file's text, so that it can be fixed there.
    assert "A cat." in response.content.decode()


def _file(text: str):
    return SimpleUploadedFile("rows.jsonl", text.encode(), content_type="application/jsonl")


def _form_fields() -> dict:
    return {
        "model": "smollm2-135m",
        "action": "count",
        "probe-layers": "3",
        "probe-pooling": "mean",
        "probe-seed": 0,
        "probe-test_fraction": 0.25,
        "probe-regularisation_c": 1.0,
    }


# ---------------------------------------------------------------------------------------
# The cost, stated before anything is submitted


def test_the_cost_is_stated_before_the_probe_is_submitted(
    ada, sent, django_capture_on_commit_callbacks
):
    tokens = sum(len(text.split()) for text in _texts(GOOD)) + 16
    counted = post(ada, action="count")
    assert counted.status_code == 200 and not Probe.objects.exists()
    page = counted.content.decode()
    assert f'data-probe-cost="{tokens}"' in page
    assert f"{tokens} tokens" in page and "16 activation requests" in page
    # Fitting a dataset whose cost the page has not stated shows the cost first.
    unconfirmed = post(ada, confirmed_tokens=tokens - 1)
    assert f'data-probe-cost="{tokens}"' in unconfirmed.content.decode()
    assert not Probe.objects.exists()
    token = str(uuid.uuid4())
    with django_capture_on_commit_callbacks(execute=True):
        fitted = post(ada, confirmed_tokens=tokens, submit_token=token)
    probe = Probe.objects.get()
    assert fitted.status_code == 302
    assert (probe.token_cost, probe.layers, probe.classes) == (tokens, [3, 15], ["cats", "dogs"])
    assert sent == [(services.PROBE_SUBMIT_TASK, str(probe.id), None)]
    # The same form posted again (a double click) makes no second probe.
    post(ada, confirmed_tokens=tokens, submit_token=token)
    assert Probe.objects.count() == 1


def _texts(dataset: str) -> list[str]:
    return [line.rsplit(",", 1)[0] for line in dataset.splitlines()[1:]]


def test_the_dataset_hash_does_not_depend_on_its_format():
    as_csv = datasets.parse_dataset(GOOD)
    rows = [json.dumps({"label": label, "text": text}) for text, label in
            zip(as_csv.texts, as_csv.labels, strict=True)]  # fmt: skip
    as_jsonl = datasets.parse_dataset("\n".join(rows))
    expected = hashlib.sha256(
        "".join(json.dumps(json.loads(row), sort_keys=True, ensure_ascii=False) + "\n"
                for row in rows).encode()
    ).hexdigest()  # fmt: skip
    assert as_csv.sha256 == as_jsonl.sha256 == expected


# ---------------------------------------------------------------------------------------
# The worker, against a stand-in gateway


def make_probe(user, **fields) -> Probe:
    dataset = datasets.parse_dataset(GOOD)
    return services.probe_create(
        user=user, model="smollm2-135m", dataset=dataset, layers=[3, 15], pooling="mean",
        seed=0, test_fraction=0.25, regularisation_c=1.0, token_cost=80, **fields,
    )  # fmt: skip


def harvest_job(status: str, done: int = 0, error_body=None) -> httpx.Response:
    answer = HarvestJob(
        job_id=JOB_ID, status=status, model="smollm2-135m", layers=[3, 15], n_prompts=16,
        progress={"prompts_done": done, "n_prompts": 16}, created_at=1_796_580_000,
        completed_at=None, error=error_body, message=None, result=None,
    )  # fmt: skip
    return httpx.Response(202, json=answer.model_dump(mode="json"))


def test_the_harvest_is_submitted_with_the_playground_key_and_followed_with_a_countdown(
    approved_user, gateway, sent
):
    probe = make_probe(approved_user)
    gateway.handler = lambda request: harvest_job("pending")
    services.probe_submit(probe_id=probe.id)
    [submitted] = gateway.requests
    _, secret = playground_key_get_or_create(user=approved_user)
    assert (submitted.method, submitted.url.path) == ("POST", "/v1/harvest")
    assert submitted.headers["authorization"] == f"Bearer {secret}"
    assert submitted.headers["idempotency-key"] == str(probe.id)
    assert json.loads(submitted.content) == {
        "model": "smollm2-135m", "prompts": probe.dataset["texts"], "layers": [3, 15],
        "add_special_tokens": True,
    }  # fmt: skip
    assert sent[-1] == (services.PROBE_FOLLOW_TASK, str(probe.id), services.FOLLOW_EVERY_S)
    gateway.handler = lambda request: harvest_job("running", done=8)
    services.probe_follow(probe_id=probe.id)
    probe.refresh_from_db()
    assert (probe.status, probe.prompts_done, probe.stage) == ("running", 8, "harvest")
    assert sent[-1] == (services.PROBE_FOLLOW_TASK, str(probe.id), services.FOLLOW_EVERY_S)


def test_a_refused_harvest_fails_the_probe_and_the_page_says_the_quota_is_spent(
    ada, approved_user, gateway, sent
):
    probe = make_probe(approved_user)
    gateway.handler = lambda request: error(429, "harvest_quota_exceeded")
    services.probe_submit(probe_id=probe.id)
    probe.refresh_from_db()
    assert (probe.status, probe.error_code) == ("failed", "harvest_quota_exceeded")
    page = ada.get(reverse("playground:probe_detail", args=[probe.id])).content.decode()
    assert "Your Playground key's budget or quota is spent" in page
    assert "harvest_quota_exceeded happened" in page


def test_a_submission_the_api_asks_to_retry_is_queued_again_until_the_retries_are_spent(
    approved_user, gateway, sent, settings
):
    settings.PLAYGROUND_RUN_MAX_RETRIES = 1
    probe = make_probe(approved_user)
    gateway.handler = lambda request: error(503, "upstream_unavailable", {"Retry-After": "2"})
    services.probe_submit(probe_id=probe.id)
    probe.refresh_from_db()
    assert (probe.status, probe.attempts) == (WorkStatus.QUEUED, 1)
    assert sent[-1] == (services.PROBE_SUBMIT_TASK, str(probe.id), 2)
    services.probe_submit(probe_id=probe.id)
    probe.refresh_from_db()
    assert (probe.status, probe.error_code) == (WorkStatus.FAILED, "upstream_unavailable")
    assert len(sent) == 1


def test_a_harvest_that_failed_on_the_budget_fails_the_probe_with_its_code(
    approved_user, gateway, sent
):
    probe = make_probe(approved_user)
    gateway.handler = lambda request: harvest_job("pending")
    services.probe_submit(probe_id=probe.id)
    spent = {"code": "budget_exceeded", "message": "The monthly budget is spent.", "type": "x"}
    gateway.handler = lambda request: harvest_job("failed", done=8, error_body=spent)
    services.probe_follow(probe_id=probe.id)
    probe.refresh_from_db()
    assert (probe.status, probe.error_code) == ("failed", "budget_exceeded")
    assert probe.error_message == "The harvest job failed: The monthly budget is spent."


def test_cancelling_a_running_probe_cancels_its_harvest_and_refuses_later_writes(
    ada, approved_user, gateway, sent, django_capture_on_commit_callbacks
):
    probe = make_probe(approved_user)
    gateway.handler = lambda request: harvest_job("running")
    services.probe_submit(probe_id=probe.id)
    with django_capture_on_commit_callbacks(execute=True):
        response = ada.post(reverse("playground:probe_cancel", args=[probe.id]), **HTMX)
    assert "Cancelled." in response.content.decode()
    probe.refresh_from_db()
    assert probe.status == WorkStatus.CANCELLED
    assert sent[-1][:2] == (services.PROBE_HARVEST_CANCEL_TASK, str(probe.id))
    gateway.handler = lambda request: harvest_job("cancelled")
    services.probe_harvest_cancel(probe=probe)
    assert (gateway.requests[-1].method, gateway.requests[-1].url.path) == (
        "DELETE", f"/v1/harvest/{JOB_ID}",
    )  # fmt: skip
    # The worker's next look at the harvest finds the probe cancelled and does nothing.
    count = len(gateway.requests)
    services.probe_follow(probe_id=probe.id)
    assert len(gateway.requests) == count
    assert services.Attempt.of(probe).write(status=WorkStatus.SUCCEEDED) is False


def test_a_probe_cancelled_while_its_harvest_is_submitted_cancels_that_harvest(
    approved_user, gateway, sent
):
    probe = make_probe(approved_user)

    def answer(request):
        if request.method == "POST":
            # Cancelled while the submission is on its way.
            services.probe_cancel(probe=Probe.objects.get(pk=probe.pk))
            return harvest_job("pending")
        return harvest_job("cancelled")

    gateway.handler = answer
    services.probe_submit(probe_id=probe.id)
    assert [(r.method, r.url.path) for r in gateway.requests] == [
        ("POST", "/v1/harvest"), ("DELETE", f"/v1/harvest/{JOB_ID}"),
    ]  # fmt: skip
    probe.refresh_from_db()
    assert probe.status == WorkStatus.CANCELLED and probe.harvest_job_id is None


def test_a_probe_whose_worker_stopped_is_failed_by_the_sweep(approved_user, gateway, sent):
    probe = make_probe(approved_user)
    gateway.handler = lambda request: harvest_job("pending")
    services.probe_submit(probe_id=probe.id)
    later = timezone.now() + services.LEASE + dt.timedelta(seconds=1)
    assert services.probes_fail_stuck(now=later) == 1
    probe.refresh_from_db()
    assert (probe.status, probe.error_code) == ("failed", "worker_lost")


def test_another_users_probe_is_not_found(client, approved_user, other_user, sent):
    probe = make_probe(approved_user)
    client.force_login(other_user)
    assert client.get(reverse("playground:probe_detail", args=[probe.id])).status_code == 404
    assert client.post(reverse("playground:probe_cancel", args=[probe.id])).status_code == 404


def test_bootstrap_auroc_equals_a_loop_over_the_resamples():
    rng = np.random.default_rng(3)
    labels = np.array([0, 1] * 10)
    scores = labels + rng.normal(size=20)
    counts = fitting.bootstrap_counts(20, 5)
    draws = np.random.default_rng(5).integers(0, 20, size=(fitting.BOOTSTRAP_RESAMPLES, 20))
    values = []
    for draw in draws:
        picked_scores, picked_labels = scores[draw], labels[draw]
        positive, negative = picked_scores[picked_labels == 1], picked_scores[picked_labels == 0]
        if len(positive) and len(negative):
            values.append(np.mean([[float(p > n) + 0.5 * (p == n) for n in negative]
                                   for p in positive]))  # fmt: skip
    expected = [np.percentile(values, 2.5), np.percentile(values, 97.5)]
    assert fitting.auroc_interval(scores, labels, counts) == pytest.approx(expected, abs=1e-12)


def planted_features(probe: Probe) -> np.ndarray:
    """`[texts, layers, hidden]`: layer 0 noise, layer 1 the label planted on dimension 0."""
    rng = np.random.default_rng(11)
    labels = np.array([probe.classes.index(label) for label in probe.dataset["labels"]])
    features = rng.normal(size=(len(labels), 2, 8))
    features[:, 1, 0] += 6 * labels
    return features


def claimed(probe: Probe) -> services.Attempt:
    attempt = services.work_claim(Probe, pk=probe.pk, now=timezone.now(), lease=services.LEASE)
    assert attempt is not None
    return attempt


def test_the_fit_reads_the_planted_layer_and_the_downloads_hold_its_numbers(
    ada, approved_user, sent
):
    probe = make_probe(approved_user)
    services.probe_fit(attempt=claimed(probe), probe=probe, features=planted_features(probe))
    probe.refresh_from_db()
    assert probe.status == WorkStatus.SUCCEEDED
    noise, planted = probe.results["layers"]
    assert planted["accuracy"] == 1.0 and planted["auroc"] == 1.0
    assert noise["accuracy_ci"][0] <= 0.5 <= noise["accuracy_ci"][1]
    rows = list(csv.DictReader(io.StringIO(
        ada.get(reverse("playground:probe_csv", args=[probe.id])).content.decode()
    )))  # fmt: skip
    assert [int(row["layer"]) for row in rows] == [3, 15]
    assert [float(row["accuracy"]) for row in rows] == [noise["accuracy"], 1.0]
    document = ada.get(reverse("playground:probe_json", args=[probe.id])).json()
    assert document["layers"][1]["control_accuracy_ci"] == planted["control_accuracy_ci"]
    assert document["dataset_sha256"] == datasets.parse_dataset(GOOD).sha256


def test_a_probe_cancelled_during_its_fit_stops_after_the_layer_it_is_on(approved_user, sent):
    probe = make_probe(approved_user)
    attempt = claimed(probe)
    services.probe_cancel(probe=Probe.objects.get(pk=probe.pk))
    services.probe_fit(attempt=attempt, probe=probe, features=planted_features(probe))
    probe.refresh_from_db()
    assert probe.status == WorkStatus.CANCELLED
    assert probe.results is None and probe.weights is None
