"""Writes for accounts, access applications, API keys and their settings (the budget and
usage writes are `metering`'s).

Functions are named `<entity>_<action>` and take keyword-only arguments. Those that change
access or money take `acting_user` and write an `AuditLog` row in the same transaction.
"""

import base64
import hashlib
import hmac
import re
import secrets
import string

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone
from django.utils.crypto import salted_hmac

from acs_portal.celery import task_send

from .models import (
    AccessApplication,
    ApiKey,
    ApplicationStatus,
    AuditLog,
    KeyStatus,
    Scope,
    ServiceSettings,
    User,
    UserStatus,
)

# ---------------------------------------------------------------------------------------
# Audit


def audit_log(*, actor, action, target, before=None, after=None, note=""):
    """Record one change of access or money. Call inside the transaction that makes it."""
    return AuditLog.objects.create(
        actor=actor,
        action=action,
        target_type=target._meta.model_name,
        target_id=str(target.pk),
        target_repr=str(target)[:200],
        before=before,
        after=after,
        note=note,
    )


# ---------------------------------------------------------------------------------------
# API keys: format, hashing, authentication

# The task that e-mails an applicant the decision (`tasks.py`), enqueued by name.
APPLICATION_DECISION_EMAIL_SEND_TASK = "accounts.tasks.application_decision_email_send_task"

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


# ---------------------------------------------------------------------------------------
# Keys


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
    return it with its secret, which is never stored and must be shown once."""
    prefix, secret = api_key_generate()
    account_cap = user.monthly_token_budget or settings.ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS
    with transaction.atomic():
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
            after={"name": name, "prefix": prefix, "budgets": api_key_budgets(key)},
        )
    return key, secret


def api_key_budgets(key: ApiKey) -> dict:
    """A key's budget settings as a plain dict (for audit before/after)."""
    return {
        "monthly_token_budget": key.monthly_token_budget,
        "daily_token_budget": key.daily_token_budget,
        "monthly_input_budget": key.monthly_input_budget,
        "monthly_output_budget": key.monthly_output_budget,
        "monthly_activation_quota": key.monthly_activation_quota,
        "monthly_harvest_quota": key.monthly_harvest_quota,
    }


# ---------------------------------------------------------------------------------------
# Service-wide switches


def service_spend_cap_set(*, paused: bool, acting_user: User, reason: str = "") -> None:
    """Pause (429 spend_cap on every request) or resume all API traffic."""
    with transaction.atomic():
        current = ServiceSettings.objects.select_for_update().get_or_create(pk=1)[0]
        before = {"spend_cap_paused": current.spend_cap_paused}
        current.spend_cap_paused = paused
        current.spend_cap_reason = reason
        current.updated_by = acting_user
        current.save()
        audit_log(
            actor=acting_user,
            action="service.spend_cap",
            target=current,
            before=before,
            after={"spend_cap_paused": paused},
            note=reason,
        )


# ---------------------------------------------------------------------------------------
# Sign-up and access applications


def _user_state(user: User) -> dict:
    return {
        "status": user.status,
        "monthly_token_budget": user.monthly_token_budget,
        "is_staff": user.is_staff,
    }


def _user_status_change(user: User, status: str) -> None:
    user.status = status
    user.status_changed_at = timezone.now()
    user.save(update_fields=["status", "status_changed_at"])


def user_signup(
    *,
    email: str,
    password: str,
    name: str,
    organisation: str,
    planned_use: str,
    prior_work: str = "",
    profile_link: str = "",
    accepted_usage_rules: bool,
) -> User:
    """Create a `pending` account with its access application."""
    with transaction.atomic():
        user = User.objects.create_user(
            email, password, name=name, organisation=organisation, status=UserStatus.PENDING
        )
        application_submit(
            user=user,
            planned_use=planned_use,
            prior_work=prior_work,
            profile_link=profile_link,
            accepted_usage_rules=accepted_usage_rules,
        )
    return user


def application_submit(
    *,
    user: User,
    planned_use: str,
    prior_work: str = "",
    profile_link: str = "",
    accepted_usage_rules: bool,
) -> AccessApplication:
    """File an access application for a new (pending) or rejected account; a rejected account
    goes back to `pending`. Raises `ValidationError` for any other account or when an
    application is already waiting."""
    if not accepted_usage_rules:
        raise ValidationError({"accepted_usage_rules": "Accept the usage rules to apply."})
    with transaction.atomic():
        user = User.objects.select_for_update().get(pk=user.pk)
        if user.status not in (UserStatus.PENDING, UserStatus.REJECTED):
            raise ValidationError(f"An account that is {user.status} cannot apply.")
        if user.applications.filter(status=ApplicationStatus.PENDING).exists():
            raise ValidationError("An application of this account is already waiting for review.")
        if user.status == UserStatus.REJECTED:
            _user_status_change(user, UserStatus.PENDING)
        application = AccessApplication.objects.create(
            user=user,
            planned_use=planned_use,
            prior_work=prior_work,
            profile_link=profile_link,
            accepted_usage_rules=True,
        )
        audit_log(actor=user, action="application.submit", target=application)
    return application


def _application_decide(*, application, acting_user, note, approve: bool):
    """Lock and decide a pending application; return it, its locked user and the user's
    state before."""
    application = AccessApplication.objects.select_for_update().get(pk=application.pk)
    if application.status != ApplicationStatus.PENDING:
        raise ValidationError(f"This application was already {application.status}.")
    user = User.objects.select_for_update().get(pk=application.user_id)
    before = _user_state(user)
    application.status = ApplicationStatus.APPROVED if approve else ApplicationStatus.REJECTED
    application.decided_at = timezone.now()
    application.decided_by = acting_user
    application.decision_note = note
    application.save(update_fields=["status", "decided_at", "decided_by", "decision_note"])
    _user_status_change(user, UserStatus.APPROVED if approve else UserStatus.REJECTED)
    return application, user, before


def application_approve(
    *, application: AccessApplication, acting_user: User | None, note: str = ""
) -> AccessApplication:
    """Approve a pending application: the account becomes `approved` with the default budget
    (unless staff already set one), gets a first key "Default key" if it has none, and is
    e-mailed that the key waits on the API keys page. The secret is never e-mailed: it is
    kept encrypted in `ApiKey.pending_reveal` until the owner's first visit of /keys/."""
    with transaction.atomic():
        application, user, before = _application_decide(
            application=application, acting_user=acting_user, note=note, approve=True
        )
        if not user.monthly_token_budget:
            user.monthly_token_budget = settings.ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS
            user.save(update_fields=["monthly_token_budget"])
        if not user.api_keys.filter(is_playground=False).exists():
            key, secret = api_key_create(user=user, name="Default key", acting_user=acting_user)
            api_key_reveal_store(key=key, secret=secret)
        audit_log(
            actor=acting_user,
            action="user.approve",
            target=user,
            before=before,
            after=_user_state(user),
            note=note,
        )
        _decision_email_enqueue(application)
    return application


def application_reject(
    *, application: AccessApplication, acting_user: User | None, note: str = ""
) -> AccessApplication:
    """Reject a pending application and e-mail the applicant (with the note, if any); they
    may apply again."""
    with transaction.atomic():
        application, user, before = _application_decide(
            application=application, acting_user=acting_user, note=note, approve=False
        )
        audit_log(
            actor=acting_user,
            action="user.reject",
            target=user,
            before=before,
            after=_user_state(user),
            note=note,
        )
        _decision_email_enqueue(application)
    return application


def _decision_email_enqueue(application: AccessApplication) -> None:
    application_id = application.pk
    # robust: the decision stands even when the broker is down; the failure is logged.
    transaction.on_commit(
        lambda: task_send(APPLICATION_DECISION_EMAIL_SEND_TASK, application_id), robust=True
    )


def application_decision_email_send(*, application: AccessApplication) -> None:
    """E-mail the applicant the decision on their application. Never includes a key secret."""
    user = application.user
    site = settings.SITE_URL.rstrip("/")
    greeting = f"Hello {user.name or user.email},"
    if application.status == ApplicationStatus.APPROVED:
        subject = "Your ACS access is approved"
        body = (
            f"{greeting}\n\nYour application for the ACS research preview is approved.\n\n"
            f"Your first API key is waiting on the API keys page: {site}/keys/\n"
            "Its secret is shown there once, the first time you open the page, so copy it "
            "then.\n"
        )
    elif application.status == ApplicationStatus.REJECTED:
        subject = "Your ACS application"
        body = f"{greeting}\n\nWe could not approve your application for ACS this time.\n"
        if application.decision_note:
            body += f"\nNote from the reviewer:\n{application.decision_note}\n"
        body += f"\nYou may apply again at {site}/apply/ after logging in.\n"
    else:
        return
    send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, [user.email])


# ---------------------------------------------------------------------------------------
# Account status and budgets (staff)


def user_suspend(*, user: User, acting_user: User | None, note: str = "") -> User:
    """Suspend an approved account: every key is refused with account_suspended."""
    return _user_status_move(
        user=user,
        acting_user=acting_user,
        note=note,
        source=UserStatus.APPROVED,
        target=UserStatus.SUSPENDED,
        action="user.suspend",
    )


def user_reactivate(*, user: User, acting_user: User | None, note: str = "") -> User:
    """Give a suspended account its access back."""
    return _user_status_move(
        user=user,
        acting_user=acting_user,
        note=note,
        source=UserStatus.SUSPENDED,
        target=UserStatus.APPROVED,
        action="user.reactivate",
    )


def _user_status_move(*, user, acting_user, note, source, target, action) -> User:
    with transaction.atomic():
        locked = User.objects.select_for_update().get(pk=user.pk)
        if locked.status != source:
            raise ValidationError(
                f"This account is {locked.status}; only {source} accounts can become {target}."
            )
        before = _user_state(locked)
        _user_status_change(locked, target)
        audit_log(
            actor=acting_user,
            action=action,
            target=locked,
            before=before,
            after=_user_state(locked),
            note=note,
        )
    user.status, user.status_changed_at = locked.status, locked.status_changed_at
    return user


def user_budget_set(*, user: User, acting_user: User | None, monthly_token_budget: int) -> User:
    """Set the account-wide monthly token budget (staff)."""
    if monthly_token_budget < 0:
        raise ValidationError({"monthly_token_budget": "A budget cannot be negative."})
    with transaction.atomic():
        locked = User.objects.select_for_update().get(pk=user.pk)
        before = {"monthly_token_budget": locked.monthly_token_budget}
        locked.monthly_token_budget = monthly_token_budget
        locked.save(update_fields=["monthly_token_budget"])
        audit_log(
            actor=acting_user,
            action="user.budget_set",
            target=locked,
            before=before,
            after={"monthly_token_budget": monthly_token_budget},
        )
    user.monthly_token_budget = monthly_token_budget
    return user


def login_lock_audit(*, throttle, user, ip: str, failures: int, lockout_seconds: int):
    """Record that sign-ins of `throttle`'s subject are refused for `lockout_seconds` after
    `failures` wrong passwords, the last from `ip` (`accounts.login_throttle` keeps the lock
    itself): `user.login_locked` on the user for a lock of their account (from one address or
    from all), `login.address_locked` on the throttle for a lock of an address."""
    after = {
        "scope": throttle.scope,
        "ip": ip,
        "failures": failures,
        "lockout_seconds": lockout_seconds,
    }
    with transaction.atomic():
        if user is None:
            return audit_log(
                actor=None, action="login.address_locked", target=throttle, after=after
            )
        return audit_log(actor=None, action="user.login_locked", target=user, after=after)


# ---------------------------------------------------------------------------------------
# Key management


KEY_BUDGET_FIELDS = (
    "monthly_token_budget",
    "daily_token_budget",
    "monthly_input_budget",
    "monthly_output_budget",
    "monthly_activation_quota",
    "monthly_harvest_quota",
)
# Token budgets a key's owner may set, each at most their account's monthly budget.
KEY_OWNER_BUDGET_FIELDS = KEY_BUDGET_FIELDS[:4]


def _key_locked(key: ApiKey) -> ApiKey:
    return ApiKey.objects.select_for_update().select_related("user").get(pk=key.pk)


def _is_operator(acting_user: User | None) -> bool:
    """Staff, or the system itself (CLI, admin scripts: no acting user)."""
    return acting_user is None or acting_user.is_staff


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


# Windows that are parts of a key's monthly window: none may be set above the whole.
_KEY_MONTHLY_PARTS = ("daily_token_budget", "monthly_input_budget", "monthly_output_budget")


def _key_budget_consistency_errors(key: ApiKey, budgets: dict) -> dict:
    """Errors for a change that sets a daily, input or output budget above the key's monthly
    budget. (Lowering only the monthly budget is allowed: it caps the others anyway.)"""
    monthly = budgets.get("monthly_token_budget", key.monthly_token_budget)
    return {
        field: f"At most the key's monthly budget ({monthly:,} tokens)."
        for field in _KEY_MONTHLY_PARTS
        if budgets.get(field) is not None and budgets[field] > monthly
    }


def api_key_budget_set(*, key: ApiKey, acting_user: User | None, budgets: dict) -> ApiKey:
    """Change some of a key's budgets (`budgets` maps names of `KEY_BUDGET_FIELDS` to values;
    None removes an optional input/output limit). Staff and the system may set anything; an
    owner may set only the token budgets, each at most the account's monthly budget.
    Raises `ValidationError` keyed by field."""
    unknown = set(budgets) - set(KEY_BUDGET_FIELDS)
    if unknown:
        raise ValueError(f"Unknown budget fields: {sorted(unknown)}")
    errors = {}
    with transaction.atomic():
        locked = _key_locked(key)
        account_cap = locked.user.monthly_token_budget
        for field, value in budgets.items():
            if value is None and field not in ("monthly_input_budget", "monthly_output_budget"):
                errors[field] = "This budget needs a value."
            elif value is not None and value < 0:
                errors[field] = "A budget cannot be negative."
            elif _is_operator(acting_user):
                continue
            elif field not in KEY_OWNER_BUDGET_FIELDS:
                errors[field] = "Only staff can change this quota."
            elif value is not None and value > account_cap:
                errors[field] = f"At most your account's monthly budget ({account_cap:,} tokens)."
        errors = _key_budget_consistency_errors(locked, budgets) | errors
        if errors:
            raise ValidationError(errors)
        before = api_key_budgets(locked)
        for field, value in budgets.items():
            setattr(locked, field, value)
        locked.save(update_fields=list(budgets))
        audit_log(
            actor=acting_user,
            action="key.budget_set",
            target=locked,
            before=before,
            after=api_key_budgets(locked),
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
