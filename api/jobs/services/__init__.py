"""Writes for completion jobs and harvest jobs, by domain: `completion_jobs`, `harvests`,
`harvest_output` (the files), `statistics`, and what both kinds share (`idempotency`; their
claim and sweep are `infra.lifecycle`'s). Submits run in the web process; `*_execute`
functions run in a Celery worker, called by the thin tasks in `api.jobs.tasks`."""
