"""The gateway's limits that the contract states: admission enforces the per-key ones, the
body readers the size, and the error table and the OpenAPI document describe them from here."""

# Per key: requests running at once, requests waiting beyond those, and request starts per
# sliding minute (api.admission).
MAX_RUNNING = 16
MAX_WAITING = 64
STARTS_PER_MINUTE = 600

MAX_BODY_BYTES = 8 * 1024 * 1024
