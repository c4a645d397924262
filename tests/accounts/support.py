"""Helpers shared by the portal tests."""

import re

from django.test import Client

# Headers of a request htmx sends.
HTMX = {"HTTP_HX_REQUEST": "true"}
SECRET_PATTERN = re.compile(r"acs-[a-z0-9]{8}-[A-Za-z0-9_-]{40,}")


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def secrets_in(html: str) -> list[str]:
    return SECRET_PATTERN.findall(html)
