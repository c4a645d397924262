"""A Patchscope on the real path: the worker (in this process) sends its runs with the user's
playground key to the live gateway in front of the real embedded engine. Its generations
equal what transformers' float32 model generates greedily with a forward hook that replaces
the output of the target block at the inspection position by the source state, taken here
from the source run's activation download (bfloat16, as the API gives it), within the
engine's near-tie bound; and the cost the form stated before submitting is what the gateway
billed (its usage records)."""

import re

import pytest
from django.db.models import F, Sum
from django.urls import reverse

from acs_portal.celery import app as celery_app
from api.models import LanguageModel
from api.selectors import registry_clear
from metering.models import UsageRecord
from playground import tasks
from playground.runs import views
from playground.runs.services import run_create
from tests.conftest import ENGINE_MODEL_FIELDS
from tests.gateway.conftest import wait_settled
from tests.patchscope_numbers import compare_generations, reference, source_states

from .conftest import MODEL as MODEL_ENTRY

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = MODEL_ENTRY["id"]
SOURCE_PROMPT = "The capital of France is"
SOURCE_POSITION = 3  # " France"
SOURCE_LAYERS = [2, 10, 20]


@pytest.fixture
def queued(engine_url, gateway_url, settings, redis_client, monkeypatch):
    """The engine as the registry's model, the worker's /v1 calls to the live gateway, and
    the tasks the playground sends kept here for the test to run."""
    LanguageModel.objects.all().delete()
    LanguageModel.objects.create(
        name=MODEL, upstream_urls=[engine_url], **ENGINE_MODEL_FIELDS, max_logprobs=20,
        is_default=True,
    )  # fmt: skip
    registry_clear()
    settings.GATEWAY_URL = gateway_url
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL_ENTRY])
    monkeypatch.setattr("playground.patchscopes.views.model_cards", lambda: [MODEL_ENTRY])
    sent = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args, **_: sent.append(args[0]))
    yield sent
    wait_settled()
    registry_clear()


def run_queued(sent: list) -> int:
    """Execute every run sent, and those their ends send, as a worker would."""
    done = 0
    while sent:
        tasks.run_execute_task(sent.pop(0))
        done += 1
    return done


def test_a_patchscope_on_the_engine_generates_what_float32_hooks_do_and_costs_what_it_said(
    client, approved_user, queued
):
    client.force_login(approved_user)
    source = run_create(
        user=approved_user,
        request={
            "model": MODEL,
            "prompt": SOURCE_PROMPT,
            "max_tokens": 1,
            "temperature": 0,
            "output_residual_stream": True,
        },
    )
    assert run_queued(queued) == 1
    form = {
        "run": str(source.pk),
        "scope-source_position": str(SOURCE_POSITION),
        "scope-source_layers": ", ".join(map(str, SOURCE_LAYERS)),
        "scope-inspection_prompt": "cat -> cat; 1135 -> 1135; hello -> hello; ?",
        "scope-inspection_position": "",
        "scope-target_layer": "",
        "scope-max_tokens": "8",
    }
    cost = client.get(reverse("playground:patchscope_cost"), form).content.decode()
    stated = int(re.search(r"data-cost-tokens>(\d+)<", cost).group(1))
    submitted = client.post(reverse("playground:patchscope_submit"), form)
    assert submitted.status_code == 302, submitted.content.decode()[-2000:]
    # The capture of the inspection prompt, then one generation per source layer.
    assert run_queued(queued) == 1 + len(SOURCE_LAYERS)
    patchscope_id = submitted["Location"].rstrip("/").rsplit("/", 1)[1]
    document = client.get(reverse("playground:patchscope_json", args=[patchscope_id])).json()
    assert [row["source_layer"] for row in document["rows"]] == SOURCE_LAYERS
    assert [row["target_layer"] for row in document["rows"]] == SOURCE_LAYERS
    assert document["source_token"] == " France"

    download = client.get(reverse("playground:run_activations", args=[source.pk])).content
    states = source_states(download, layers=SOURCE_LAYERS, position=SOURCE_POSITION)
    expected = reference(document, states)
    said = compare_generations(document, expected, expected["compute_dtype"])
    print(f"Patchscope on the engine ({expected['compute_dtype']}) vs float32 hooks: {said}")

    wait_settled()
    request_ids = [document["capture"]["request_id"]] + [r["request_id"] for r in document["rows"]]
    billed = UsageRecord.objects.filter(request_id__in=request_ids).aggregate(
        tokens=Sum(F("prompt_tokens") + F("completion_tokens"))
    )["tokens"]
    assert UsageRecord.objects.filter(request_id__in=request_ids).count() == 4
    assert stated == billed == document["cost"]["tokens"] == document["billed_tokens"]
