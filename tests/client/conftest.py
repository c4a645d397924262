"""acs_client against the live gateway (uvicorn in a thread) in front of the stub upstream,
with the job fixtures of tests/jobs: Celery sends recorded, so a test runs each worker step
itself, and a temporary MEDIA_ROOT."""

from tests.gateway.conftest import (  # noqa: F401 (fixtures)
    gateway_url,
    leases_write_at_once,
    model,
    stub,
    stub_upstream,
)
from tests.jobs.conftest import media_root, sent_tasks  # noqa: F401 (fixtures)
