"""The one lifecycle of background work (completion and harvest jobs, playground runs, scores,
comparisons and job submissions, and so the grids made of runs): its status vocabulary.

A row moves queued → running → succeeded | failed | cancelled; an ended row whose stored
output was deleted after its retention is expired. Where a page or the API words a status
otherwise (the harvest API's "pending" and "done", the Jobs page's "Submitted"), the model
says so next to its table."""

from django.db import models


class WorkStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    # Ended, and its stored output deleted after its retention.
    EXPIRED = "expired", "Expired"


ACTIVE = (WorkStatus.QUEUED, WorkStatus.RUNNING)
# Ended with its output still stored: an expired row has ended too, and has nothing left.
ENDED = (WorkStatus.SUCCEEDED, WorkStatus.FAILED, WorkStatus.CANCELLED)
