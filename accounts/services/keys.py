"""API keys: creation, renaming, pausing, revocation, and showing a new key's secret once.
(A key's budgets are set by `metering.limits`.)"""

import base64

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django.utils.crypto import salted_hmac

from accounts.models import ApiKey, KeyStatus, Scope, User

from .audit import audit_log
from .auth import api_key_generate, api_key_hash


def api_key_create(
    *,
    user: User,
    name: str,
    acting_user: User | None,
    monthly_token_budget: int | None = None,
    daily_token_budget: int | None = None,
    is_playground: bool = False,
) -> tuple[ApiKey, str]:
    """Create a key with the default budgets (capped at the account's monthly budget) and
    return it with its secret, which is never stored and must be shown once. ValidationError
    when the account already holds as many keys as it may (`User.keys_allowed`; its
    playground key aside)."""
    prefix, secret = api_key_generate()
    account_cap = user.monthly_token_budget or settings.ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS
    with transaction.atomic():
        if not is_playground:
            _key_room_check(user)
        key = ApiKey.objects.create(
            user=user,
            name=name,
            prefix=prefix,
            secret_hash=api_key_hash(secret),
            scopes=[Scope.COMPLETIONS],
            is_playground=is_playground,
            monthly_token_budget=min(
                monthly_token_budget or settings.ACS_DEFAULT_KEY_MONTHLY_TOKENS, account_cap
            ),
            daily_token_budget=daily_token_budget or settings.ACS_DEFAULT_KEY_DAILY_TOKENS,
            monthly_activation_quota=settings.ACS_DEFAULT_ACTIVATION_QUOTA,
            monthly_harvest_quota=settings.ACS_DEFAULT_HARVEST_QUOTA,
        )
        audit_log(
            actor=acting_user,
            action="key.create",
            target=key,
            after={"name": name, "prefix": prefix, "budgets": key.limits()},
        )
    return key, secret


def _key_room_check(user: User) -> None:
    """Raise ValidationError when `user` holds as many keys as allowed. Locks the user's row
    (in the caller's transaction), so that concurrent creations cannot pass it together."""
    locked = User.objects.select_for_update().only("key_limit").get(pk=user.pk)
    held = (
        ApiKey.objects.filter(user=user, is_playground=False)
        .exclude(status=KeyStatus.REVOKED)
        .count()
    )
    if held >= locked.keys_allowed:
        raise ValidationError(
            f"This account holds {held} keys, the most it may ({locked.keys_allowed}): revoke "
            "one you no longer use, or ask staff to raise the limit."
        )


def _key_locked(key: ApiKey) -> ApiKey:
    return ApiKey.objects.select_for_update().select_related("user").get(pk=key.pk)


def api_key_rename(*, key: ApiKey, acting_user: User | None, name: str) -> ApiKey:
    name = name.strip()
    if not name:
        raise ValidationError({"name": "Give the key a name."})
    with transaction.atomic():
        locked = _key_locked(key)
        if locked.status == KeyStatus.REVOKED:
            raise ValidationError("A revoked key cannot be renamed.")
        before = {"name": locked.name}
        locked.name = name
        locked.save(update_fields=["name"])
        audit_log(
            actor=acting_user,
            action="key.rename",
            target=locked,
            before=before,
            after={"name": name},
        )
    return locked


def api_key_disable(*, key: ApiKey, acting_user: User | None) -> ApiKey:
    """Pause an active key: it is refused with key_disabled until enabled again."""
    return _api_key_status_move(
        key=key,
        acting_user=acting_user,
        sources=(KeyStatus.ACTIVE,),
        target=KeyStatus.DISABLED,
        action="key.disable",
    )


def api_key_enable(*, key: ApiKey, acting_user: User | None) -> ApiKey:
    """Resume a paused key."""
    return _api_key_status_move(
        key=key,
        acting_user=acting_user,
        sources=(KeyStatus.DISABLED,),
        target=KeyStatus.ACTIVE,
        action="key.enable",
    )


def api_key_revoke(*, key: ApiKey, acting_user: User | None) -> ApiKey:
    """Revoke a key for good (key_revoked); a secret still waiting to be shown is dropped."""
    return _api_key_status_move(
        key=key,
        acting_user=acting_user,
        sources=(KeyStatus.ACTIVE, KeyStatus.DISABLED),
        target=KeyStatus.REVOKED,
        action="key.revoke",
    )


def _api_key_status_move(*, key, acting_user, sources, target, action) -> ApiKey:
    with transaction.atomic():
        locked = _key_locked(key)
        if locked.status not in sources:
            raise ValidationError(
                f"This key is {locked.get_status_display().lower()}; it cannot be "
                f"{'revoked' if target == KeyStatus.REVOKED else 'changed that way'}."
            )
        before = {"status": locked.status}
        locked.status = target
        fields = ["status"]
        if target == KeyStatus.REVOKED:
            locked.revoked_at = timezone.now()
            locked.pending_reveal = ""
            fields += ["revoked_at", "pending_reveal"]
        locked.save(update_fields=fields)
        audit_log(
            actor=acting_user,
            action=action,
            target=locked,
            before=before,
            after={"status": target},
        )
    return locked


# ---------------------------------------------------------------------------------------
# Showing a new key's secret once

# A Fernet key derived from SECRET_KEY for this one purpose: the secret waits encrypted in the
# database only until its owner's next visit of the API keys page.
_REVEAL_SALT = "accounts.api_key_pending_reveal"


def _reveal_cipher() -> Fernet:
    return Fernet(
        base64.urlsafe_b64encode(salted_hmac(_REVEAL_SALT, "", algorithm="sha256").digest())
    )


def api_key_reveal_store(*, key: ApiKey, secret: str) -> None:
    """Keep `secret` (encrypted) for one display on the owner's API keys page."""
    ApiKey.objects.filter(pk=key.pk).update(
        pending_reveal=_reveal_cipher().encrypt(secret.encode()).decode()
    )


def api_key_reveals_take(*, user: User) -> list[tuple[ApiKey, str | None]]:
    """Secrets waiting to be shown to `user`, each returned exactly once (a conditional clear,
    so two concurrent page loads cannot both show it). The secret is None when it can no
    longer be decrypted (SECRET_KEY rotated): the owner should revoke that key."""
    taken = []
    for key in ApiKey.objects.filter(user=user).exclude(pending_reveal=""):
        claimed = ApiKey.objects.filter(pk=key.pk, pending_reveal=key.pending_reveal).update(
            pending_reveal=""
        )
        if not claimed:
            continue
        try:
            secret = _reveal_cipher().decrypt(key.pending_reveal.encode()).decode()
        except InvalidToken:
            secret = None
        key.pending_reveal = ""
        taken.append((key, secret))
    return taken
