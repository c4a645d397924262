"""The differential suite uses tests/vllm's two registry rows (vLLM-Lens and the engine on the
same weights) behind one live gateway, and one key whose limits a long run cannot reach."""

import pytest

from tests.vllm.conftest import (  # noqa: F401
    client,
    engine_url,
    gateway_url,
    models,
    tokenizer_json,
    vllm_lens,
    weights_dir,
)


@pytest.fixture
def api_key_pair(api_key_pair):
    """The approved user's key, with budgets and quotas past what any run spends."""
    key, secret = api_key_pair
    for field in ("monthly_token_budget", "daily_token_budget"):
        setattr(key, field, 10**12)
    key.monthly_activation_quota = key.monthly_harvest_quota = 10**6
    key.save()
    return key, secret
