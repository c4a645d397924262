"""Writes of the playground, one module per domain (as Zulip's `actions/<domain>.py`):
`keys` (the managed playground key), `runs` (creating, failing and sweeping runs),
`run_execution` (a run sent to /v1 by a Celery worker, `tasks.run_execute_task`, with the
user's playground key through `acs_client`, exactly as an outside client would), `vectors`
(the steering-vector library: uploads, contrast pairs and steering runs), `scores` (steering
compared on the same tokens) and `submissions` (jobs asked for on the Jobs page).
"""
