"""Reads of jobs. A job is visible to its owner only: another user's id reads as missing."""

import uuid

from django.conf import settings
from django.utils import timezone

from infra.lifecycle import ENDED

from .models import CompletionJob, HarvestJob
from .signing import download_expiry, download_path
from .storage import MANIFEST_NAME, STATS_NAME


def _parse_id(job_id) -> uuid.UUID | None:
    try:
        return job_id if isinstance(job_id, uuid.UUID) else uuid.UUID(str(job_id))
    except ValueError:
        return None


def completion_job_get(*, user_id, job_id) -> CompletionJob | None:
    """The user's completion job, or None (unknown id, another user's job, or deleted)."""
    parsed = _parse_id(job_id)
    if parsed is None:
        return None
    return CompletionJob.objects.filter(pk=parsed, user_id=user_id).first()


def harvest_job_get(*, user_id, job_id) -> HarvestJob | None:
    """The user's harvest job, or None."""
    parsed = _parse_id(job_id)
    if parsed is None:
        return None
    return HarvestJob.objects.filter(pk=parsed, user_id=user_id).first()


def harvest_job_by_id(*, job_id) -> HarvestJob | None:
    """Any harvest job (for signed downloads, whose token already names the job)."""
    parsed = _parse_id(job_id)
    return None if parsed is None else HarvestJob.objects.filter(pk=parsed).first()


def jobs_for_user(*, user, limit=50) -> dict:
    """The user's most recent completion and harvest jobs (without their requests and
    prompts), and whether any is still active."""
    completion_jobs = list(CompletionJob.objects.filter(user=user).defer("request")[:limit])
    harvest_jobs = list(HarvestJob.objects.filter(user=user).defer("prompts")[:limit])
    active = any(not job.is_finished for job in completion_jobs) or any(
        job.is_active or job.is_stopping for job in harvest_jobs
    )
    return {"completion_jobs": completion_jobs, "harvest_jobs": harvest_jobs, "active": active}


def harvest_retention_days() -> str:
    """ACS_HARVEST_RETENTION_SECONDS in days, for messages ("7", "0.5")."""
    return f"{settings.ACS_HARVEST_RETENTION_SECONDS / 86400:g}"


def harvest_download_links(*, job: HarvestJob, key_id: int | None = None, now=None) -> dict | None:
    """Signed paths to a job's files, all expiring together and working only while key
    `key_id` (None: the job's account) may use the API: `{manifest_url, shard_urls,
    stats_url, urls_expire_at}` (paths; the API makes them absolute), or None while the job
    has none to offer. Done jobs have files, and so do jobs that failed on a limit or were
    cancelled after writing some batches."""
    if job.status not in ENDED or not job.files:
        return None
    expires_at = download_expiry(now=now or timezone.now())

    def link(name):
        return download_path(job_id=job.pk, name=name, expires_at=expires_at, key_id=key_id)

    shards = [name for name in job.files if name not in (MANIFEST_NAME, STATS_NAME)]
    return {
        "manifest_url": link(MANIFEST_NAME),
        "shard_urls": [link(name) for name in shards],
        "stats_url": link(STATS_NAME),
        "urls_expire_at": expires_at,
    }
