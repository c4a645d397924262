"""The playground on a production row: a capture run on the vLLM-Lens row registered as
docs/deploy.md §5 says (its weights directory, no tokenizer attached) shows what the same run
on the engine's row shows: its tokens by id and string, the lens's targets and the direct
logit attribution's measured difference, taken from the logprobs the run reported."""

import pytest

from api.models import LanguageModel
from api.selectors import registry_clear
from api.services import language_model_tokenizer_set
from playground.models import Run
from playground.run_figures import Drawing
from playground.services.run_execution import run_execute
from playground.services.runs import run_create

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
    return run_execute(run_id=run.id, final_attempt=True)


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
