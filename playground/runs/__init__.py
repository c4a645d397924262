"""Runs: one /v1 request each, submitted from the playground's page and sent by a worker with
the user's playground key; the run page, its live stream, its figures and downloads, and the
history of runs."""
