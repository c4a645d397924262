"""The Jobs page's submissions: a completion or harvest job asked for on the page, sent to /v1
by a worker with the user's playground key."""

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from infra.lifecycle import WorkRow, WorkStatus


class JobKind(models.TextChoices):
    COMPLETION = "completion", "Completion job"
    HARVEST = "harvest", "Harvest job"


_SUBMISSION_STATUS_LABELS = {
    WorkStatus.QUEUED: "Queued",
    WorkStatus.RUNNING: "Sending",
    WorkStatus.SUCCEEDED: "Submitted",
    WorkStatus.FAILED: "Refused",
}


class JobSubmission(WorkRow):
    """A completion or harvest job asked for on the Jobs page. A worker sends `request` to
    /v1 with the user's playground key, exactly as an outside client would (so budgets,
    limits and revocation apply the same way), and keeps the API's `job_id`, or the error
    the API refused it with. Status moves queued → running (being sent) → succeeded (the
    API took it) | failed (the API refused it), at `finished_at`; `status_label` says so to
    a person."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="job_submissions"
    )
    kind = models.CharField(max_length=10, choices=JobKind.choices)
    request = models.JSONField()
    job_id = models.UUIDField(null=True, blank=True)
    # The one-time token of the form submission: posted again, it returns this submission.
    submit_token = models.UUIDField(null=True, blank=True)

    class Meta:
        # The table of the playground app, where submissions began: moved without a copy.
        db_table = "playground_jobsubmission"
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["user", "-created_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "submit_token"],
                condition=Q(submit_token__isnull=False),
                name="one_job_submission_per_form_submission",
            )
        ]

    def __str__(self):
        return f"{self.get_kind_display().lower()} submission {self.id} ({self.status})"

    @property
    def status_label(self) -> str:
        """The status as the Jobs page words it: what happened to the sending."""
        return _SUBMISSION_STATUS_LABELS[self.status]
