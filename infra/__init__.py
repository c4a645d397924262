"""What every app stands on and nothing of the apps: Redis clients (`redis`), Celery sends
(`tasks`), the database faults a process lives through (`database`), work that outlives a
request (`background`), the lifecycle of background work (`lifecycle`), answers to htmx
(`htmx`) and CSV cells a spreadsheet reads as data (`spreadsheet`). Imports no project app."""
