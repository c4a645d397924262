"""Celery tasks of the accounts app: thin, ids in."""

import smtplib

from celery import shared_task

from . import login_throttle
from .models import AccessApplication
from .services import applications


@shared_task(
    autoretry_for=(smtplib.SMTPException, OSError),
    retry_backoff=30,
    max_retries=5,
)
def application_decision_email_send_task(application_id: int) -> None:
    """E-mail an applicant the decision on their application."""
    application = AccessApplication.objects.select_related("user").filter(pk=application_id)
    application = application.first()
    if application is not None:
        applications.application_decision_email_send(application=application)


@shared_task(ignore_result=True)
def login_throttles_prune_task() -> int:
    """Delete login failure counts that no longer matter (beat: hourly)."""
    return login_throttle.login_throttles_prune()
