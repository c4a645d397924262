"""The three gateway rules the completion forms apply too, each written once in
`acs_client.protocol`: max_tokens named with several sequences, the non-streaming cap and
the model's logprobs limit. The gateway (`api.validation`, which the completion jobs API
uses too) and the forms (the playground's and the Jobs page's share
`api.request_forms.CompletionRequestForm`) refuse with the rule's own message: a caller that
wrote its own check would word it its own way, and fail here."""

from types import SimpleNamespace

import pytest

from acs_client.protocol import (
    NON_STREAMING_MAX_TOKENS,
    RuleBroken,
    check_logprobs_limit,
    check_max_tokens_given,
    check_non_streaming_max_tokens,
)
from api import validation
from api.errors import ApiError
from api.request_forms import ModelCapabilities
from playground.runs.forms import CompletionForm
from portal.jobs_forms import CompletionJobForm

MODEL_LOGPROBS = 5
CARD = {"id": "small", "capabilities": {"max_logprobs": MODEL_LOGPROBS}}

CASES = [
    pytest.param(
        {"n": 2},
        check_max_tokens_given,
        {"max_tokens": None, "prompts": 1, "n": 2},
        "invalid_request",
        id="max_tokens with n > 1",
    ),
    pytest.param(
        {"max_tokens": NON_STREAMING_MAX_TOKENS + 1},
        check_non_streaming_max_tokens,
        {"stream": False, "max_tokens": NON_STREAMING_MAX_TOKENS + 1},
        "deadline_infeasible",
        id="the non-streaming cap",
    ),
    pytest.param(
        {"prompt_logprobs": MODEL_LOGPROBS + 1, "max_tokens": 1},
        check_logprobs_limit,
        {"logprobs": None, "prompt_logprobs": MODEL_LOGPROBS + 1, "max_logprobs": MODEL_LOGPROBS},
        "invalid_request",
        id="the model's logprobs limit",
    ),
]


def broken(check, **terms) -> RuleBroken:
    with pytest.raises(RuleBroken) as refused:
        check(**terms)
    return refused.value


@pytest.mark.parametrize(("fields", "check", "terms", "code"), CASES)
async def test_the_gateway_refuses_with_the_rules_message(monkeypatch, fields, check, terms, code):
    rule = broken(check, **terms)

    async def model_get(name):
        return SimpleNamespace(name=name, max_logprobs=MODEL_LOGPROBS, vocab_size=100)

    monkeypatch.setattr(validation, "model_get", model_get)
    with pytest.raises(ApiError) as refused:
        await validation.validate_completion({"model": "small", "prompt": "Hi", **fields})
    assert (refused.value.code, refused.value.message) == (code, str(rule))


@pytest.mark.parametrize("form_class", [CompletionForm, CompletionJobForm])
@pytest.mark.parametrize(("fields", "check", "terms", "code"), CASES)
def test_the_completion_forms_refuse_with_the_rules_message(form_class, fields, check, terms, code):
    rule = broken(check, **terms)
    prefix = f"{form_class.prefix}-" if form_class.prefix else ""
    data = {
        f"{prefix}{name}": str(value)
        for name, value in {"model": "small", "prompt": "Hi", **fields}.items()
    }
    form = form_class(data, models=[CARD], capabilities=ModelCapabilities(CARD))
    assert not form.is_valid()
    assert form.errors[rule.field] == [str(rule)]


@pytest.mark.parametrize(
    ("terms", "field"),
    [
        ({"max_tokens": None, "prompts": 3, "n": 1}, "max_tokens"),
        ({"max_tokens": None, "prompts": 1, "n": 4}, "max_tokens"),
    ],
)
def test_several_sequences_need_max_tokens(terms, field):
    assert broken(check_max_tokens_given, **terms).field == field
    check_max_tokens_given(max_tokens=8, prompts=3, n=4)
    check_max_tokens_given(max_tokens=None, prompts=1, n=1)


def test_the_non_streaming_cap_spares_a_stream():
    check_non_streaming_max_tokens(stream=True, max_tokens=NON_STREAMING_MAX_TOKENS + 1)
    check_non_streaming_max_tokens(stream=False, max_tokens=NON_STREAMING_MAX_TOKENS)
    assert "set stream: true" in str(
        broken(
            check_non_streaming_max_tokens, stream=False, max_tokens=NON_STREAMING_MAX_TOKENS + 1
        )
    )


def test_the_logprobs_limit_names_the_field_over_it():
    check_logprobs_limit(logprobs=5, prompt_logprobs=5, max_logprobs=5)
    assert broken(check_logprobs_limit, logprobs=6, prompt_logprobs=None, max_logprobs=5).field == (
        "logprobs"
    )
    # -1 asks for the whole vocabulary (its own limit: FULL_VOCAB_MAX_PROMPT_TOKENS).
    check_logprobs_limit(logprobs=None, prompt_logprobs=-1, max_logprobs=5)
