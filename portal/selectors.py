"""Reads of the Jobs page's submissions."""

import datetime as dt

from django.utils import timezone

from infra.lifecycle import WorkStatus

from .models import JobSubmission

# How long the Jobs page keeps showing a submission the API refused.
REFUSED_SUBMISSION_SHOWN = dt.timedelta(days=1)


def job_submissions_shown(*, user, limit: int = 10) -> list[JobSubmission]:
    """The user's Jobs-page submissions still on their way to /v1, and those the API refused
    in the last day (with its error), newest first. Submitted ones are listed as jobs."""
    return list(
        JobSubmission.objects.filter(user=user)
        .exclude(status=WorkStatus.SUCCEEDED)
        .exclude(
            status=WorkStatus.FAILED,
            created_at__lt=timezone.now() - REFUSED_SUBMISSION_SHOWN,
        )
        .defer("request")[:limit]
    )
