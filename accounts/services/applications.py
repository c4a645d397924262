"""Sign-up and access applications: filing one, and staff's decision, e-mailed."""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone

from accounts.models import AccessApplication, ApplicationStatus, User, UserStatus
from infra.tasks import task_send

from .audit import audit_log
from .keys import api_key_create, api_key_reveal_store
from .users import user_state, user_status_change

# The task that e-mails an applicant the decision (`tasks.py`), enqueued by name.
APPLICATION_DECISION_EMAIL_SEND_TASK = "accounts.tasks.application_decision_email_send_task"


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
            user_status_change(user, UserStatus.PENDING)
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
    before = user_state(user)
    application.status = ApplicationStatus.APPROVED if approve else ApplicationStatus.REJECTED
    application.decided_at = timezone.now()
    application.decided_by = acting_user
    application.decision_note = note
    application.save(update_fields=["status", "decided_at", "decided_by", "decision_note"])
    user_status_change(user, UserStatus.APPROVED if approve else UserStatus.REJECTED)
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
            after=user_state(user),
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
            after=user_state(user),
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
