"""Every portal form is CSRF-protected."""

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import User

from .support import sign_in


def csrf_client(user=None):
    client = Client(enforce_csrf_checks=True)
    if user is not None:
        sign_in(client, user)
    return client


def test_signup_without_token_is_403(db):
    response = csrf_client().post(
        reverse("apply"),
        {
            "email": "x@example.org",
            "password": "a-long-passphrase-1",
            "name": "X",
            "planned_use": "Y",
            "accepted_usage_rules": "on",
        },
    )
    assert response.status_code == 403
    assert not User.objects.filter(email="x@example.org").exists()


def test_signup_with_token_works(db):
    client = csrf_client()
    client.get(reverse("apply"))
    response = client.post(
        reverse("apply"),
        {
            "email": "x@example.org",
            "password": "a-long-passphrase-1",
            "name": "X",
            "planned_use": "Y",
            "accepted_usage_rules": "on",
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
    )
    assert response.status_code == 302


@pytest.mark.parametrize(
    ("name", "needs_key"),
    [
        ("keys", False),
        ("key_rename", True),
        ("key_budget", True),
        ("key_disable", True),
        ("key_revoke", True),
        ("logout", False),
    ],
)
def test_key_forms_without_token_are_403(approved_user, api_key, name, needs_key):
    url = reverse(name, args=[api_key.pk] if needs_key else [])
    assert csrf_client(approved_user).post(url, {"name": "x"}).status_code == 403
    api_key.refresh_from_db()
    assert (api_key.name, api_key.status) == ("first key", "active")


def test_staff_forms_without_token_are_403(staff_user, pending_user):
    client = csrf_client(staff_user)
    decide = reverse("staff_application_decide", args=[pending_user.applications.get().pk])
    assert client.post(decide, {"decision": "approve"}).status_code == 403
    assert client.post(reverse("staff_spend_cap"), {"paused": "on"}).status_code == 403
    pending_user.refresh_from_db()
    assert pending_user.status == "pending"


def test_pages_render_the_token_for_htmx_and_forms(approved_client):
    html = approved_client.get(reverse("keys")).content.decode()
    assert "csrfmiddlewaretoken" in html
    assert "X-CSRFToken" in html
