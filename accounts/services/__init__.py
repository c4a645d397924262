"""Writes of the accounts app, one module per domain (as Zulip's `actions/<domain>.py`):
`audit`, `auth` (key format, hashing and the checks of a credential), `keys`,
`applications` (sign-up and access decisions), `users` (account status), `service`
(service-wide switches) and `login` (lock audit). The budget and usage writes are
`metering`'s.
"""
