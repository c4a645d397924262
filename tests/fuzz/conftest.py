"""The fuzz suite reuses the gateway suite's live server (uvicorn in a thread of the test
process, on the test database) and its lease-writer settings."""

from tests.gateway.conftest import gateway_url, leases_write_at_once  # noqa: F401
