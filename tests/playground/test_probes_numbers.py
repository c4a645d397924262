"""Linear probes on the real path: the form states the cost, the worker submits the harvest
with the playground key to the live gateway in front of the real engine, follows it, and fits
a probe per layer. Everything the page shows is recomputed here from the harvest downloaded
through /v1 (its safetensors shards read with the safetensors library, not with
`acs_client.downloads` or the playground's pooling): scikit-learn fitted by this test on the
same split and seed, bootstrap intervals drawn with numpy, the tokens billed read from the
usage records, and the run page's score strip as this test's own dot product on the run's
downloaded activations.

The dataset is planted: 24 sentences about cooking and 24 about astronomy (no word shared
but function words), linearly separable wherever the residual stream carries the topic."""

import json
import re
from itertools import product

import numpy as np
import pytest
from django.urls import reverse
from safetensors import deserialize
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from accounts.services.playground_key import playground_key_get_or_create
from acs_client.client import AcsClient
from acs_portal.celery import app as celery_app
from api.jobs.services import harvests
from api.models import LanguageModel
from api.selectors import registry_clear
from infra.lifecycle import WorkStatus
from metering.models import UsageRecord
from playground.models import RunKind, SteeringVector
from playground.probes import services
from playground.probes.models import Probe
from playground.runs import views
from playground.runs.execution import run_execute
from playground.runs.services import run_create
from tests.conftest import ENGINE_MODEL_FIELDS
from tests.gateway.conftest import wait_settled

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "smollm2-135m"
MODEL_ENTRY = {
    "id": MODEL,
    "object": "model",
    "status": "live",
    "capabilities": {
        "max_model_len": 8192, "max_logprobs": 20, "full_vocab_max_prompt_tokens": 256,
        "activations": True, "n_layers": 30, "hidden_size": 576, "max_steering_vectors": 8,
    },
}  # fmt: skip
COOKING = [
    template.format(thing)
    for template, thing in product(
        ["The chef slowly stirred {}.", "She chopped {} in the kitchen.",
         "We cooked {} for dinner.", "He seasoned {} with salt and pepper."],
        ["the onions", "the garlic", "the pasta sauce", "the fresh bread", "the soup",
         "the vegetables"],
    )
]  # fmt: skip
SPACE = [
    template.format(thing)
    for template, thing in product(
        ["The astronomer observed {}.", "Telescopes photographed {} last night.",
         "Scientists measured {} from orbit.", "The spacecraft detected {} in deep space."],
        ["distant galaxies", "the rings of Saturn", "a bright comet", "the moons of Jupiter",
         "a red nebula", "the orbit of Mars"],
    )
]  # fmt: skip
LAYERS = [2, 15, 27]
SEED = 7
TEST_FRACTION = 0.5
C = 0.5
RESAMPLES = 1000


def dataset_jsonl() -> str:
    rows = [{"text": text, "label": "cooking"} for text in COOKING]
    rows += [{"text": text, "label": "space"} for text in SPACE]
    return "\n".join(json.dumps(row) for row in rows) + "\n"


@pytest.fixture
def live(engine_url, gateway_url, approved_user, settings, redis_client, monkeypatch, tmp_path):
    LanguageModel.objects.all().delete()
    LanguageModel.objects.create(
        name=MODEL, upstream_urls=[engine_url], activation_upstream_urls=[engine_url],
        **ENGINE_MODEL_FIELDS, max_logprobs=20, is_default=True,
    )  # fmt: skip
    registry_clear()
    settings.GATEWAY_URL = settings.SITE_URL = gateway_url
    settings.MEDIA_ROOT = tmp_path / "media"
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL_ENTRY])
    sent = []
    monkeypatch.setattr(
        celery_app,
        "send_task",
        lambda name, args, countdown=None, **_: sent.append((name, args[0])),
    )
    yield sent
    wait_settled()
    registry_clear()


def form(action: str, **fields) -> dict:
    data = {
        "model": MODEL,
        "action": action,
        "probe-dataset": dataset_jsonl(),
        "probe-layers": ", ".join(map(str, LAYERS)),
        "probe-pooling": "mean",
        "probe-seed": SEED,
        "probe-test_fraction": TEST_FRACTION,
        "probe-regularisation_c": C,
    }
    data.update({f"probe-{name}": value for name, value in fields.items()})
    return data


def embedded(page: str, name: str) -> dict:
    [content] = re.findall(
        rf'<script id="{name}" type="application/json">(.*?)</script>', page, re.S
    )
    return json.loads(content)


def run_worker(sent: list, probe: Probe) -> None:
    """What the workers would do, in order: submit the harvest, run it, follow it to the fit."""
    assert sent.pop(0) == (services.PROBE_SUBMIT_TASK, str(probe.id))
    services.probe_submit(probe_id=probe.id)
    probe.refresh_from_db()
    assert probe.harvest_job_id is not None, (probe.error_code, probe.error_message)
    harvest = [job for name, job in sent if name == harvests.HARVEST_JOB_RUN_TASK]
    harvests.harvest_job_execute(job_id=harvest[0])
    services.probe_follow(probe_id=probe.id)
    probe.refresh_from_db()
    assert probe.status == WorkStatus.SUCCEEDED, (probe.error_code, probe.error_message)


# ---------------------------------------------------------------------------------------
# Independent helpers: nothing here calls the playground's code


def shard_captures(directory, manifest: dict) -> list[dict[str, np.ndarray]]:
    """Per prompt, in order: its bfloat16 activations widened to float64 `[layers, tokens,
    hidden]`, parsed with the safetensors library."""
    captures = {}
    for shard in manifest["shards"]:
        for name, spec in deserialize((directory / shard["name"]).read_bytes()):
            if name.startswith("prompt_"):
                words = np.frombuffer(bytes(spec["data"]), dtype="<u2").astype(np.uint32)
                values = (words << 16).view(np.float32).reshape(spec["shape"])
                captures[int(name.removeprefix("prompt_"))] = values.astype(np.float64)
    return [captures[index] for index in range(len(captures))]


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The probability that a random positive outscores a random negative (ties half)."""
    positive, negative = scores[labels == 1], scores[labels == 0]
    wins = sum((p > negative).sum() + 0.5 * (p == negative).sum() for p in positive)
    return wins / (len(positive) * len(negative))


def bootstrap(correct, scores, labels, seed) -> tuple[list[float], list[float]]:
    draws = np.random.default_rng(seed).integers(0, len(labels), size=(RESAMPLES, len(labels)))
    accuracies = [correct[draw].mean() for draw in draws]
    aurocs = [auroc(scores[draw], labels[draw]) for draw in draws if len(set(labels[draw])) == 2]
    return (
        [np.percentile(accuracies, 2.5), np.percentile(accuracies, 97.5)],
        [np.percentile(aurocs, 2.5), np.percentile(aurocs, 97.5)],
    )


def test_probes_by_layer_equal_scikit_learn_on_the_downloaded_harvest(
    live, client, approved_user, gateway_url, tmp_path
):
    client.force_login(approved_user)
    counted = client.post(reverse("playground:probe_submit"), form("count"))
    stated = int(re.search(r'data-probe-cost="(\d+)"', counted.content.decode())[1])
    created = client.post(reverse("playground:probe_submit"), form("fit", confirmed_tokens=stated))
    assert created.status_code == 302
    probe = Probe.objects.get(user=approved_user)
    assert probe.token_cost == stated
    run_worker(live, probe)

    # The harvest, downloaded as an outside client would.
    _, secret = playground_key_get_or_create(user=approved_user)
    api = AcsClient(base_url=gateway_url, api_key=secret)
    job = api.harvest(str(probe.harvest_job_id))
    assert job.layers == LAYERS and job.n_prompts == 48
    download = api.download_harvest(job, tmp_path / "harvest")
    captures = shard_captures(download.directory, download.manifest)
    labels = np.array([0] * len(COOKING) + [1] * len(SPACE))

    # The tokens billed for the harvest are the tokens the page stated.
    records = UsageRecord.objects.filter(key__user=approved_user, endpoint="harvest")
    billed = sum(record.prompt_tokens + record.completion_tokens for record in records)
    assert billed == stated

    page = client.get(reverse("playground:probe_detail", args=[probe.id])).content.decode()
    numbers = embedded(page, "probe-numbers")
    assert [entry["layer"] for entry in numbers["layers"]] == LAYERS
    train, test = train_test_split(
        np.arange(len(labels)), test_size=TEST_FRACTION, stratify=labels, random_state=SEED
    )
    assert numbers["split"]["test_rows"] == test.tolist()
    for row, (layer, shown) in enumerate(zip(LAYERS, numbers["layers"], strict=True)):
        features = np.stack([capture[row, 1:].mean(axis=0) for capture in captures])
        probe_fit = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=5000))
        probe_fit.fit(features[train], labels[train])
        correct = probe_fit.predict(features[test]) == labels[test]
        scores = probe_fit.decision_function(features[test])
        assert shown["accuracy"] == pytest.approx(correct.mean(), abs=1e-12), layer
        assert shown["auroc"] == pytest.approx(auroc(scores, labels[test]), abs=1e-9), layer
        accuracy_ci, auroc_ci = bootstrap(correct, scores, labels[test], SEED)
        assert shown["accuracy_ci"] == pytest.approx(accuracy_ci, abs=1e-12), layer
        assert shown["auroc_ci"] == pytest.approx(auroc_ci, abs=1e-9), layer
        # The planted topic is read at every layer probed; shuffled labels read chance.
        assert shown["accuracy"] >= 0.95, layer
        shuffled = np.random.default_rng(SEED).permutation(labels[train])
        control = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=5000))
        control.fit(features[train], shuffled)
        control_correct = control.predict(features[test]) == labels[test]
        assert shown["control_accuracy"] == pytest.approx(control_correct.mean(), abs=1e-12)
        low, high = shown["control_accuracy_ci"]
        assert low <= 0.5 <= high, (layer, shown["control_accuracy_ci"])
        assert shown["selectivity"] == pytest.approx(correct.mean() - control_correct.mean())
        assert shown["baseline_accuracy"] == 0.5
        assert f'data-accuracy="{shown["accuracy"]}"' in page
        print(
            f"layer {layer}: accuracy {shown['accuracy']:.3f} {shown['accuracy_ci']}, AUROC "
            f"{shown['auroc']:.3f}, control {shown['control_accuracy']:.3f} "
            f"{shown['control_accuracy_ci']}"
        )

    # A layer's probe saved, then read out on a capture run, token by token.
    saved = client.post(
        reverse("playground:probe_vector_save", args=[probe.id]), {"layer": 15, "name": "topic"}
    )
    assert saved.status_code == 302
    vector = SteeringVector.objects.get(user=approved_user, name="topic")
    details = vector.details
    assert details["dataset_sha256"] == probe.dataset_sha256
    assert (details["layer"], details["pooling"], details["seed"], details["C"]) == (
        15, "mean", SEED, C,
    )  # fmt: skip
    assert details["split"] == {"train": len(train), "test": len(test)}
    assert details["test_accuracy"] == numbers["layers"][1]["accuracy"]
    run = run_create(
        user=approved_user,
        kind=RunKind.COMPLETION,
        request={
            "model": MODEL, "prompt": "The chef stirred the soup while we watched Saturn.",
            "max_tokens": 1, "temperature": 0, "output_residual_stream": [15],
        },
    )  # fmt: skip
    run = run_execute(run_id=run.id)
    assert run.status == WorkStatus.SUCCEEDED, run.error_message
    run_page = client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    shown_scores = [float(value) for value in re.findall(r'data-score="([^"]+)"', run_page)]
    activations = client.get(reverse("playground:run_activations", args=[run.id]))
    [(_, spec)] = [
        item for item in deserialize(b"".join(activations.streaming_content)
                                     if activations.streaming else activations.content)
        if item[0] == "prompt_0"
    ]  # fmt: skip
    words = np.frombuffer(bytes(spec["data"]), dtype="<u2").astype(np.uint32)
    rows = (words << 16).view(np.float32).reshape(spec["shape"])[0].astype(np.float64)
    expected = ((rows - details["mean"]) / details["scale"]) @ np.array(details["coef"])
    expected += details["intercept"]
    np.testing.assert_allclose(shown_scores, expected, rtol=1e-9, atol=1e-9)
    assert len(shown_scores) == rows.shape[0]
    # The run page's probe picker redraws the strip of the probe picked, and no other's.
    strip_url = reverse("playground:probe_score_strip", args=[run.id])
    picked = client.get(strip_url, {"vector": vector.id}).content.decode()
    assert [float(value) for value in re.findall(r'data-score="([^"]+)"', picked)] == shown_scores
    assert client.get(strip_url, {"vector": vector.id + 1}).status_code == 404
    # The vector library says where the probe came from.
    library = client.get(reverse("playground:page")).content.decode()
    assert reverse("playground:probe_detail", args=[probe.id]) in library
    assert f"held-out accuracy {numbers['layers'][1]['accuracy']:.3f}" in library
