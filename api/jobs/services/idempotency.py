"""What both kinds of job share at submit: the Idempotency-Key conflict, and the fingerprint
of a request that tells a resent submit from another."""

import hashlib
import json

from ..models import CompletionJob, HarvestJob


class IdempotencyKeyReused(Exception):
    """The Idempotency-Key already names a job (completion or harvest) with another body."""

    def __init__(self, job: CompletionJob | HarvestJob):
        super().__init__(f"Idempotency-Key already used for job {job.pk} with another body.")
        self.job = job


def request_fingerprint(payload: dict) -> str:
    """sha256 of the body's canonical JSON (sorted keys, no whitespace): two bodies that
    decode to the same JSON have the same fingerprint."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
