"""The playground on a production row: a capture run on the vLLM-Lens row registered as
docs/deploy.md §5 says (its weights directory, no tokenizer attached) shows what the same run
on the engine's row shows: its tokens by id and string, the lens's targets and the direct
logit attribution's measured difference, taken from the logprobs the run reported; and a
patching grid by the logit difference on that row matches transformers' float32 model with
forward hooks cell by cell (each cell's request scores two sequences, which vLLM-Lens alone
would steer on the first only)."""

import json
import re

import pytest
from django.test import Client
from django.urls import reverse

from api.models import LanguageModel
from api.selectors import registry_clear
from api.services import language_model_tokenizer_set
from playground import tasks
from playground.models import Run
from playground.runs.execution import run_execute
from playground.runs.registry import Drawing
from playground.runs.services import run_create
from tests.patching_numbers import (
    LOGPROB_TOLERANCE,
    assert_causal_tracing_picture,
    compare_grid,
    reference_grid,
)

from .test_vllm_lens import BOUND

pytestmark = pytest.mark.django_db(transaction=True)

REQUEST = {
    "prompt": "The capital of France is",
    "max_tokens": 3,
    "temperature": 0,
    "logprobs": 5,
    "output_residual_stream": True,
}


@pytest.fixture
def vllm_row_without_tokenizer(models, weights_dir):
    """The vLLM row without its tokenizer; both rows with the weights the lens reads."""
    row = LanguageModel.objects.get(name=models["vllm"])
    language_model_tokenizer_set(model=row, content=None)
    LanguageModel.objects.filter(name=models["engine"]).update(weights_dir=weights_dir)
    registry_clear()
    return models


def run_on(model: str, user) -> Run:
    run = run_create(user=user, request={"model": model, **REQUEST})
    return run_execute(run_id=run.id)


def test_a_capture_run_on_a_vllm_row_without_a_tokenizer_shows_the_engines_tokens_lens_and_dla(
    vllm_row_without_tokenizer, approved_user, gateway_url, settings, sent_tasks
):
    models = vllm_row_without_tokenizer
    settings.GATEWAY_URL = gateway_url
    vllm, engine = (run_on(models[side], approved_user) for side in ("vllm", "engine"))
    for run in (vllm, engine):
        assert run.status == "succeeded", run.error
    # Every token named, by id and string, as on the engine's row.
    assert vllm.tokens == engine.tokens
    prompt = vllm.tokens["prompts"][0]
    assert None not in prompt["ids"] and None not in prompt["strings"]
    assert None not in vllm.tokens["completions"][0]["ids"]
    sections = [Drawing(run).lens for run in (vllm, engine)]
    for section in sections:
        assert "note" not in section and "target_note" not in section, section
    assert sections[0]["target"] == sections[1]["target"]
    assert sections[0]["covered"] == sections[1]["covered"]
    # The measured logit difference is the reported logprobs', on both rows. It is a
    # difference of two logprobs, each within BOUND.logprob of float32 on each upstream.
    dla = [section["dla"] for section in sections]
    assert [d["source"] for d in dla] == ["reported", "reported"]
    assert dla[0]["foil"] == dla[1]["foil"]
    for total in ("measured", "sum"):
        assert abs(dla[0][total] - dla[1][total]) <= 4 * BOUND.logprob, (total, dla)


def run_sent_tasks(sent_tasks) -> int:
    """Run every playground task sent, and those they send, as a worker would."""
    done = 0
    while sent_tasks:
        name, args = sent_tasks.pop(0)
        assert name == tasks.run_execute_task.name, name
        tasks.run_execute_task.apply(args=args)
        done += 1
    return done


def test_a_logit_difference_grid_on_vllm_lens_matches_float32_torch_hooks(
    vllm_row_without_tokenizer, approved_user, client, gateway_url, settings, sent_tasks
):
    settings.GATEWAY_URL = gateway_url
    browser = Client()
    browser.force_login(approved_user)
    form = {
        "model": vllm_row_without_tokenizer["vllm"],
        "patch-clean_prompt": "The capital of France is",
        "patch-corrupted_prompt": "The capital of Italy is",
        "patch-target": " Paris",
        "patch-corrupted_target": " Rome",
        "patch-metric": "logit_diff",
        "patch-layers": "0, 12, 29",
        "patch-positions": "",
    }
    submitted = browser.post(reverse("playground:patching_submit"), form)
    assert submitted.status_code == 302, submitted.content.decode()[-2000:]
    # 2 captures, the clean baseline, 3 repeats and 3 layers × 5 positions.
    assert run_sent_tasks(sent_tasks) == 21
    page = browser.get(submitted["Location"]).content.decode()
    numbers = json.loads(re.search(r'id="patching-numbers"[^>]*>(.*?)</script>', page).group(1))
    assert numbers["model"] == vllm_row_without_tokenizer["vllm"]
    assert all(run["status"] == "succeeded" for run in numbers["runs"]), numbers["runs"]
    reference = reference_grid(numbers)
    found = compare_grid(numbers, reference, LOGPROB_TOLERANCE["bfloat16"])
    assert_causal_tracing_picture(found.effects, last_layer=29)
    floor = numbers["metrics"]["logit_diff"]["noise_floor"]
    print(
        f"patching grid on vLLM-Lens vs float32 torch hooks: {found.describe()}; noise floor "
        f"of the logit difference {floor:.4f} nats over 3 repeats"
    )
