"""Helpers shared by the portal tests."""

import re

from django.test import Client

from testsupport.second_factor import TOTP_KEY, authenticator_enrolled, sign_in, totp_code

# Headers of a request htmx sends.
HTMX = {"HTTP_HX_REQUEST": "true"}
SECRET_PATTERN = re.compile(r"acs-[a-z0-9]{8}-[A-Za-z0-9_-]{40,}")


def logged_in(user) -> Client:
    """A client signed in as `user`, for staff with their second factor passed (`sign_in`)."""
    return sign_in(Client(), user)


def secrets_in(html: str) -> list[str]:
    return SECRET_PATTERN.findall(html)


__all__ = [
    "HTMX",
    "SECRET_PATTERN",
    "TOTP_KEY",
    "authenticator_enrolled",
    "logged_in",
    "secrets_in",
    "sign_in",
    "totp_code",
]
