"""Completion jobs and harvest jobs: /v1 work that outlives the connection that asked for it.

Both belong to the user of the key that created them: any key of that user may read them, any
other user gets 404. Their lifecycle is `infra.lifecycle`'s: workers claim a job with a
conditional status update and hold it for a lease. `lease_expires_at` of a running job is
when the periodic sweep assumes its worker died (it re-queues or fails the job); of a queued
job, when the sweep re-sends its message if no worker took it.
"""

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from api.errors import ApiError
from infra.lifecycle import WorkRow, WorkStatus


class CompletionJob(WorkRow):
    """One POST /v1/completions body run by a worker. The row (request and result) is deleted
    24 hours after the job ends. A job that succeeded keeps the completion's status and body
    (`result_status`, `result_body`); one that failed keeps the error's code and message, from
    which its answer is built (`result_body` is then empty), and either keeps the answer's
    headers that belong to the result (`result_headers`)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="completion_jobs"
    )
    key = models.ForeignKey("accounts.ApiKey", on_delete=models.CASCADE, related_name="+")
    idempotency_key = models.CharField(max_length=255)
    # sha256 of the body's canonical JSON: the same key with another body is a conflict.
    request_hash = models.CharField(max_length=64)
    request = models.JSONField()
    workload = models.CharField(max_length=16, blank=True)
    result_status = models.PositiveSmallIntegerField(null=True, blank=True)
    result_body = models.JSONField(null=True, blank=True)
    result_headers = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "idempotency_key"], name="completion_job_idempotency_key"
            )
        ]
        indexes = [
            models.Index(fields=["status", "lease_expires_at"]),
            models.Index(fields=["finished_at"]),
            models.Index(fields=["user", "-created_at"]),
        ]

    def __str__(self):
        return f"completion job {self.id} ({self.status})"

    @property
    def error(self) -> dict | None:
        """The error object of a failed job, as the API answers it; else None."""
        return _error_object(self)

    @property
    def answer(self) -> tuple[int, dict]:
        """The HTTP status and body of a finished job's result: the completion, or the error
        envelope built from the row."""
        if self.error_code:
            error = ApiError(self.error_code, self.error_message)
            return error.status, error.body()
        return self.result_status, self.result_body


def _error_object(job: WorkRow) -> dict | None:
    """The `{code, message, type}` object /v1 answers for a job failed with its row's error."""
    if not job.error_code:
        return None
    return ApiError(job.error_code, job.error_message).body()["error"]


_HARVEST_PUBLIC_STATUS = {WorkStatus.QUEUED: "pending", WorkStatus.SUCCEEDED: "done"}


class HarvestJob(WorkRow):
    """Residual-stream captures of many prompts, written as safetensors files under
    `storage_prefix` in Django's default storage, deleted (the job then reads as expired)
    ACS_HARVEST_RETENTION_SECONDS after the job ends."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="harvest_jobs"
    )
    key = models.ForeignKey("accounts.ApiKey", on_delete=models.CASCADE, related_name="+")
    # Optional on submit ("" when none): the same user, key and request return this job.
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    # sha256 of the canonical request (model, prompts, layers, add_special_tokens).
    request_hash = models.CharField(max_length=64, blank=True, default="")
    model = models.CharField(max_length=64)
    prompts = models.JSONField()
    layers = models.JSONField()
    add_special_tokens = models.BooleanField(default=True)
    n_prompts = models.PositiveIntegerField()
    prompts_done = models.PositiveIntegerField(default=0)
    # Names of the files written, relative to storage_prefix, once the job is done (or
    # failed on a limit after some batches: what they wrote).
    files = models.JSONField(default=list, blank=True)
    # The shards written so far, in order, recorded after each batch: `{name, tensors,
    # prompts, bytes}`. An attempt after a worker died resumes after the last of them.
    shards = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["key", "status"]),
            models.Index(fields=["status", "lease_expires_at"]),
            models.Index(fields=["user", "-created_at"]),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(prompts_done__lte=models.F("n_prompts")),
                name="harvest_progress_within_total",
            ),
            models.UniqueConstraint(
                fields=["user", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="harvest_job_idempotency_key",
            ),
        ]

    def __str__(self):
        return f"harvest job {self.id} ({self.status})"

    @property
    def storage_prefix(self):
        return f"harvest/{self.id}/"

    @property
    def error(self) -> dict | None:
        """The error object of a failed job, as the API answers it; else None."""
        return _error_object(self)

    @property
    def public_status(self) -> str:
        """The status as /v1 names it: the API predates the one lifecycle vocabulary and
        keeps its words ("pending" for queued, "done" for succeeded)."""
        return _HARVEST_PUBLIC_STATUS.get(self.status, self.status)

    @property
    def is_stopping(self):
        """Cancelled while a worker ran it, which has not stopped yet: it may still add the
        batches it wrote to `files` (or it died, and its lease runs out)."""
        return (
            self.status == WorkStatus.CANCELLED
            and self.lease_expires_at is not None
            and self.lease_expires_at > timezone.now()
        )

    @property
    def progress(self):
        """Fraction of prompts captured, 0..1."""
        return self.prompts_done / self.n_prompts if self.n_prompts else 0.0
