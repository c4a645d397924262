"""A Patchscope on vLLM-Lens: from a capture run on the vLLM row, the worker captures the
inspection prompt and sends one generation per source layer steered at one prompt position
(which the gateway sends vLLM-Lens as the 3-D vector it means). Each generation equals what
transformers' float32 model generates greedily with a forward hook replacing the target
block's output at the inspection position by the source state (from the source run's
activation download), up to the bfloat16 near-tie bound."""

import pytest
from django.test import Client
from django.urls import reverse

from playground import tasks
from playground.runs.execution import run_execute
from playground.runs.services import run_create
from tests.patchscope_numbers import compare_generations, reference, source_states

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE_LAYERS = [2, 20]


def test_a_patchscope_on_vllm_lens_generates_what_float32_hooks_do(
    models, approved_user, gateway_url, settings, sent_tasks
):
    settings.GATEWAY_URL = gateway_url
    browser = Client()
    browser.force_login(approved_user)
    source = run_create(
        user=approved_user,
        request={
            "model": models["vllm"],
            "prompt": "The capital of France is",
            "max_tokens": 1,
            "temperature": 0,
            "output_residual_stream": True,
        },
    )
    assert run_execute(run_id=source.id).status == "succeeded"
    sent_tasks.clear()
    form = {
        "run": str(source.pk),
        "scope-source_position": "3",
        "scope-source_layers": ", ".join(map(str, SOURCE_LAYERS)),
        "scope-inspection_prompt": "cat -> cat; 1135 -> 1135; hello -> hello; ?",
        "scope-inspection_position": "",
        "scope-target_layer": "",
        "scope-max_tokens": "6",
    }
    submitted = browser.post(reverse("playground:patchscope_submit"), form)
    assert submitted.status_code == 302, submitted.content.decode()[-2000:]
    done = 0
    while sent_tasks:
        name, args = sent_tasks.pop(0)
        assert name == tasks.run_execute_task.name, name
        tasks.run_execute_task.apply(args=args)
        done += 1
    assert done == 1 + len(SOURCE_LAYERS)
    patchscope_id = submitted["Location"].rstrip("/").rsplit("/", 1)[1]
    document = browser.get(reverse("playground:patchscope_json", args=[patchscope_id])).json()
    assert document["model"] == models["vllm"]
    download = browser.get(reverse("playground:run_activations", args=[source.pk])).content
    states = source_states(download, layers=SOURCE_LAYERS, position=3)
    said = compare_generations(document, reference(document, states), "bfloat16")
    print(f"Patchscope on vLLM-Lens vs float32 hooks: {said}")
