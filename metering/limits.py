"""Setting the limits of the budget windows: a key's (by its owner or staff) and an
account's (by staff), each checked and audited as `metering.windows.WINDOWS` declares it.

Functions are named `<entity>_<action>`, take keyword-only arguments and `acting_user`, and
write an `AuditLog` row in the transaction that changes the limits.
"""

from django.core.exceptions import ValidationError
from django.db import transaction

from accounts.models import ApiKey, User
from accounts.services.audit import audit_log

from . import windows


def limits_of(owner, scope: str) -> dict:
    """The limits of a key (`scope` KEY) or an account (ACCOUNT) as a plain dict, by
    attribute name (for audit before/after)."""
    return {window.limit: getattr(owner, window.limit) for window in windows.of_scope(scope)}


def _settable(scope: str) -> dict[str, windows.Window]:
    return {window.limit: window for window in windows.of_scope(scope)}


def _unknown_error(scope: str, names) -> ValidationError:
    known = ", ".join(_settable(scope))
    return ValidationError(f"Unknown budget {', '.join(sorted(names))}; the budgets are {known}.")


def _value_errors(scope: str, limits: dict) -> dict:
    """Errors of values that no one may set: an empty required limit, a negative one."""
    errors = {}
    for name, value in limits.items():
        if value is None and not _settable(scope)[name].optional:
            errors[name] = "This budget needs a value."
        elif value is not None and value < 0:
            errors[name] = "A budget cannot be negative."
    return errors


def _errors(*, key: ApiKey, limits: dict, acting_user: User | None) -> dict:
    """The field errors of setting the key's `limits` (by attribute name) by `acting_user`."""
    errors = _value_errors(windows.KEY, limits)
    is_operator = acting_user is None or acting_user.is_staff  # the system, or staff
    account = windows.named(windows.ACCOUNT_MONTHLY)
    for name, value in limits.items():
        window = _settable(windows.KEY)[name]
        if name in errors or is_operator:
            continue
        if not window.owner_sets:
            errors[name] = "Only staff can change this quota."
        elif value is not None and value > (cap := account.limit_of(key)):
            errors[name] = (
                f"At most your account's {account.period.adjective} budget ({cap:,} tokens)."
            )
    return _cap_errors(key=key, limits=limits) | errors


def _cap_errors(*, key: ApiKey, limits: dict) -> dict:
    """Errors for limits set above the limit of their `Window.at_most` window (as changed by
    `limits` or as it is). Lowering only the capping limit is allowed: it caps the others
    anyway."""
    errors = {}
    for name, value in limits.items():
        at_most = _settable(windows.KEY)[name].at_most
        if value is None or at_most is None:
            continue
        cap_window = windows.named(at_most)
        cap = cap_window.limit_of(key)
        if cap_window.scope == windows.KEY:
            cap = limits.get(cap_window.limit, cap)
        if cap is not None and value > cap:
            errors[name] = (
                f"At most the {cap_window.scope}'s {cap_window.period.adjective} budget"
                f" ({cap:,} tokens)."
            )
    return errors


def api_key_budget_set(*, key: ApiKey, acting_user: User | None, budgets: dict) -> ApiKey:
    """Change some of a key's limits (`budgets` maps the `limit` names of key windows to
    values; None removes an optional limit). Staff and the system may set any; a key's owner
    only those its windows let owners set, each at most their account's monthly budget.
    Raises `ValidationError`, keyed by field (an unknown name: not keyed)."""
    unknown = set(budgets) - set(_settable(windows.KEY))
    if unknown:
        raise _unknown_error(windows.KEY, unknown)
    with transaction.atomic():
        locked = ApiKey.objects.select_for_update().select_related("user").get(pk=key.pk)
        errors = _errors(key=locked, limits=budgets, acting_user=acting_user)
        if errors:
            raise ValidationError(errors)
        before = limits_of(locked, windows.KEY)
        for name, value in budgets.items():
            setattr(locked, name, value)
        locked.save(update_fields=list(budgets))
        audit_log(
            actor=acting_user,
            action="key.budget_set",
            target=locked,
            before=before,
            after=limits_of(locked, windows.KEY),
        )
    return locked


def user_budget_set(*, user: User, acting_user: User | None, budgets: dict) -> User:
    """Change some of an account's limits (staff): `budgets` maps the `limit` names of
    account windows to values. Raises `ValidationError` as `api_key_budget_set` does."""
    unknown = set(budgets) - set(_settable(windows.ACCOUNT))
    if unknown:
        raise _unknown_error(windows.ACCOUNT, unknown)
    errors = _value_errors(windows.ACCOUNT, budgets)
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        locked = User.objects.select_for_update().get(pk=user.pk)
        before = limits_of(locked, windows.ACCOUNT)
        for name, value in budgets.items():
            setattr(locked, name, value)
        locked.save(update_fields=list(budgets))
        audit_log(
            actor=acting_user,
            action="user.budget_set",
            target=locked,
            before=before,
            after=limits_of(locked, windows.ACCOUNT),
        )
    for name, value in budgets.items():
        setattr(user, name, value)
    return user
