"""Signed, time-limited download URLs for harvest files: they work without an API key until
they expire, while their owner may still use the API. The expiry time is inside the signed
value, so every URL of one GET expires at the `urls_expire_at` it reports, and a changed job
id, file name, expiry or key breaks the signature. The value also names the key of the API
call that issued it (none for the portal's links): the download view checks that key, or
the job's account, again at download time (`api.auth.owner_recheck`)."""

from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.core import signing
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode

_SALT = "api.jobs.harvest-file"


class DownloadRefused(Exception):
    """A download token that is malformed, tampered with, for another file, or expired."""


def download_expiry(*, now=None) -> datetime:
    now = now or timezone.now()
    return (now + timedelta(seconds=settings.ACS_HARVEST_URL_MAX_AGE_SECONDS)).replace(
        microsecond=0
    )


def download_path(*, job_id, name: str, expires_at: datetime, key_id: int | None) -> str:
    """The path (with its token) that serves file `name` of the job until `expires_at`, to
    the holder of key `key_id` (None: to the job's account, for the portal's links)."""
    granted = {"job": str(job_id), "name": name, "exp": int(expires_at.timestamp())}
    if key_id is not None:
        granted["key"] = key_id
    token = signing.dumps(granted, salt=_SALT)
    path = reverse("jobs:harvest-file", kwargs={"job_id": job_id, "name": name})
    return f"{path}?{urlencode({'token': token})}"


def download_check(*, token: str, job_id, name: str, now=None) -> int | None:
    """Raise DownloadRefused unless `token` grants file `name` of the job now; returns the
    id of the key it was issued to (None for the portal's links)."""
    try:
        granted = signing.loads(token, salt=_SALT)
    except signing.BadSignature:
        raise DownloadRefused("The download link is not valid.") from None
    if granted.get("job") != str(job_id) or granted.get("name") != name:
        raise DownloadRefused("The download link is not valid.")
    expires_at = datetime.fromtimestamp(granted.get("exp", 0), tz=UTC)
    if (now or timezone.now()) >= expires_at:
        raise DownloadRefused("The download link has expired; read the job again for new links.")
    return granted.get("key")
