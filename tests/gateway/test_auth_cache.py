"""The gateway's per-process key cache: a known key skips the database, and any change to
a key or its account is seen on the very next request."""

import pytest

from accounts.services.keys import api_key_disable, api_key_revoke
from accounts.services.users import user_suspend
from api import auth
from metering.limits import api_key_budget_set, user_budget_set

pytestmark = pytest.mark.django_db(transaction=True)

BASE = {"model": "stub-model", "prompt": "hello", "max_tokens": 4}


@pytest.fixture
def lookups(monkeypatch):
    """Counts the database lookups of keys the gateway makes."""
    calls = []
    real = auth._authenticate

    def counting(authorization, scope):
        calls.append(scope)
        return real(authorization, scope)

    monkeypatch.setattr(auth, "_authenticate", counting)
    return calls


def test_a_known_key_is_not_looked_up_again(client, stub, lookups):
    for _ in range(3):
        assert client.post("/v1/completions", json=BASE).status_code == 200
    assert len(lookups) == 1


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (lambda key, staff: api_key_revoke(key=key, acting_user=staff), "key_revoked"),
        (lambda key, staff: api_key_disable(key=key, acting_user=staff), "key_disabled"),
        (lambda key, staff: user_suspend(user=key.user, acting_user=staff), "account_suspended"),
    ],
)
def test_a_cached_key_is_refused_right_after_access_changes(
    client, stub, api_key, staff_user, change, code
):
    assert client.post("/v1/completions", json=BASE).status_code == 200
    change(api_key, staff_user)
    response = client.post("/v1/completions", json=BASE)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == code


def test_a_lowered_key_budget_applies_to_the_next_request(client, stub, api_key, staff_user):
    assert client.post("/v1/completions", json=BASE).status_code == 200
    api_key_budget_set(key=api_key, acting_user=staff_user, budgets={"daily_token_budget": 9})
    # 9 − 5 used by the first request leaves room for the 1-token prompt and 3 more tokens.
    response = client.post("/v1/completions", json=BASE)
    assert response.headers["X-Acs-Max-Tokens-Clamped"] == "requested=4,applied=3,reason=budget"


def test_a_lowered_account_budget_applies_to_the_next_request(client, stub, api_key, staff_user):
    assert client.post("/v1/completions", json=BASE).status_code == 200
    user_budget_set(user=api_key.user, acting_user=staff_user, budgets={"monthly_token_budget": 5})
    response = client.post("/v1/completions", json=BASE)
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "budget_exceeded"


def test_expired_entries_are_looked_up_again(client, stub, lookups, monkeypatch):
    monkeypatch.setattr(auth, "AUTH_CACHE_SECONDS", -1.0)
    assert client.post("/v1/completions", json=BASE).status_code == 200
    assert client.post("/v1/completions", json=BASE).status_code == 200
    assert client.post("/v1/completions", json=BASE).status_code == 200
    assert len(lookups) == 3
