import pytest

from accounts.models import KeyStatus, UserStatus
from accounts.services.auth import AuthError, api_key_authenticate, api_key_hash
from api.errors import ERROR_CODES


def refused(header):
    with pytest.raises(AuthError) as error:
        api_key_authenticate(header)
    return error.value.code, ERROR_CODES[error.value.code].status


def test_valid_key_authenticates(api_key, api_secret):
    key = api_key_authenticate(f"Bearer {api_secret}")
    assert key.pk == api_key.pk
    assert key.last_used_at is not None


def test_only_prefix_and_hmac_are_stored(api_key, api_secret):
    assert api_secret.startswith(f"acs-{api_key.prefix}-")
    assert len(api_secret.split("-", 2)[2]) >= 40
    assert api_key.secret_hash == api_key_hash(api_secret)
    assert api_secret not in api_key.secret_hash


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", "Basic abc"])
def test_missing_authorization(db, header):
    assert refused(header) == ("missing_authorization", 401)


@pytest.mark.parametrize("token", ["sk-123", "acs-short-" + "a" * 40, "acs-abcdefgh-tooshort"])
def test_malformed_key_is_invalid(db, token):
    assert refused(f"Bearer {token}") == ("invalid_api_key", 401)


def test_wrong_secret_is_invalid(api_key, api_secret):
    assert refused(f"Bearer {api_secret[:-1]}x") == ("invalid_api_key", 401)


def test_revoked_key_is_refused(api_key, api_secret):
    api_key.status = KeyStatus.REVOKED
    api_key.save()
    assert refused(f"Bearer {api_secret}") == ("key_revoked", 401)


def test_disabled_key_is_refused(api_key, api_secret):
    api_key.status = KeyStatus.DISABLED
    api_key.save()
    assert refused(f"Bearer {api_secret}") == ("key_disabled", 401)


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (UserStatus.PENDING, "account_not_approved"),
        (UserStatus.REJECTED, "account_not_approved"),
        (UserStatus.SUSPENDED, "account_suspended"),
    ],
)
def test_account_status_is_enforced(api_key, api_secret, status, code):
    api_key.user.status = status
    api_key.user.save()
    assert refused(f"Bearer {api_secret}") == (code, 401)


def test_key_without_scope_is_denied(api_key, api_secret):
    api_key.scopes = []
    api_key.save()
    assert refused(f"Bearer {api_secret}") == ("scope_denied", 403)
