"""Celery tasks of the accounts app: thin, ids in."""

import datetime as dt
import smtplib

from celery import shared_task
from django.conf import settings

from . import services
from .models import AccessApplication


@shared_task(
    autoretry_for=(smtplib.SMTPException, OSError),
    retry_backoff=30,
    max_retries=5,
)
def send_application_decision_email(application_id: int) -> None:
    """E-mail an applicant the decision on their application."""
    application = AccessApplication.objects.select_related("user").filter(pk=application_id)
    application = application.first()
    if application is not None:
        services.application_decision_email_send(application=application)


@shared_task
def release_stale_budget_reservations() -> int:
    """Free the budget holds of requests that never settled and the leases never returned
    (beat: every 5 minutes); past ACS_STALE_RESERVATION_SECONDS they belong to a dead process."""
    age = dt.timedelta(seconds=settings.ACS_STALE_RESERVATION_SECONDS)
    return services.budget_release_stale(older_than=age)
