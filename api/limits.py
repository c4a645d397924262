"""The gateway's limits that the contract states: admission enforces the per-key ones, the
body readers the size, and the error table and the OpenAPI document describe them from here."""

# Per key: requests running at once, requests waiting beyond those, and request starts per
# sliding minute (api.admission).
MAX_RUNNING = 16
MAX_WAITING = 64
STARTS_PER_MINUTE = 600
# The same per account, over all its keys, so that a new key brings no fresh share of the
# upstreams: two keys' worth.
ACCOUNT_MAX_RUNNING = 32
ACCOUNT_MAX_WAITING = 128
ACCOUNT_STARTS_PER_MINUTE = 1200

MAX_BODY_BYTES = 8 * 1024 * 1024
