"""API keys' format and hashing, and the checks of a credential: whether a key (and its
account) may call the API now."""

import hashlib
import hmac
import re
import secrets
import string

from django.conf import settings
from django.utils import timezone

from accounts.models import ApiKey, KeyStatus, Scope, User, UserStatus

KEY_PATTERN = re.compile(r"^acs-([a-z0-9]{8})-([A-Za-z0-9_-]{40,})$")
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits


def api_key_generate() -> tuple[str, str]:
    """A new `(prefix, secret)`; the secret is the whole `acs-<prefix>-<random>` string."""
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(8))
    return prefix, f"acs-{prefix}-{secrets.token_urlsafe(32)}"


def api_key_hash(secret: str) -> str:
    return hmac.new(
        settings.API_KEY_HMAC_SECRET.encode(), secret.encode(), hashlib.sha256
    ).hexdigest()


class AuthError(Exception):
    """A refused credential, with the contract's error code (the gateway's error table gives
    its HTTP status)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# Written at most once a minute per key, so authentication stays read-only on the hot path.
_LAST_USED_RESOLUTION = 60


def api_key_authenticate(authorization: str | None, *, scope: str = Scope.COMPLETIONS) -> ApiKey:
    """Return the active key (with `.user` loaded) named by an `Authorization` header value,
    or raise `AuthError` with the contract's code: missing_authorization, invalid_api_key,
    key_revoked, key_disabled, account_not_approved, account_suspended (401), scope_denied
    (403)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError(
            "missing_authorization",
            "Send your API key as 'Authorization: Bearer acs-...'.",
        )
    token = token.strip()
    match = KEY_PATTERN.match(token)
    if match is None:
        raise AuthError("invalid_api_key", "The API key is malformed.")
    key = ApiKey.objects.select_related("user").filter(prefix=match.group(1)).first()
    if key is None or not hmac.compare_digest(key.secret_hash, api_key_hash(token)):
        raise AuthError("invalid_api_key", "The API key is not valid.")
    api_key_check(key, scope=scope)
    now = timezone.now()
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() > (
        _LAST_USED_RESOLUTION
    ):
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key


def api_key_check(key: ApiKey, *, scope: str = Scope.COMPLETIONS) -> None:
    """Raise `AuthError` unless `key` (with `.user` loaded) may call the API now: key_revoked,
    key_disabled, account_suspended, account_not_approved (401), scope_denied (403)."""
    if key.status == KeyStatus.REVOKED:
        raise AuthError("key_revoked", "This API key has been revoked; create a new one.")
    if key.status == KeyStatus.DISABLED:
        raise AuthError("key_disabled", "This API key is paused; resume it on the API keys page.")
    user_access_check(key.user)
    if scope not in key.scopes:
        raise AuthError("scope_denied", f"This API key lacks the '{scope}' scope.")


def user_access_check(user: User) -> None:
    """Raise `AuthError` unless `user`'s account may use the API now: account_suspended,
    account_not_approved (401)."""
    if user.status == UserStatus.SUSPENDED or not user.is_active:
        raise AuthError("account_suspended", "This account is suspended.")
    if user.status != UserStatus.APPROVED:
        raise AuthError("account_not_approved", "This account has not been approved.")


def api_key_recheck(*, key_id: int, scope: str = Scope.COMPLETIONS) -> ApiKey:
    """Read the key and its account again and `api_key_check` them: for work that starts
    long after its request was authenticated (jobs), which a revoked or paused key or a
    suspended account must stop."""
    key = ApiKey.objects.select_related("user").get(pk=key_id)
    api_key_check(key, scope=scope)
    return key
