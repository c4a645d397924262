"""Every response of the API keys page may carry a new key's secret: none may be cached."""

import pytest
from django.urls import reverse

from accounts.services.keys import api_key_create, api_key_reveal_store

from .support import HTMX, secrets_in


def assert_not_stored(response):
    assert "no-store" in response["Cache-Control"]
    assert "private" in response["Cache-Control"]


def test_keys_page_showing_a_waiting_secret_is_not_stored(approved_client, approved_user):
    key, secret = api_key_create(user=approved_user, name="approved", acting_user=None)
    api_key_reveal_store(key=key, secret=secret)
    response = approved_client.get(reverse("keys"))
    assert secrets_in(response.content.decode()) == [secret]
    assert_not_stored(response)


def test_htmx_key_creation_showing_the_secret_is_not_stored(approved_client):
    response = approved_client.post(reverse("keys"), {"name": "cluster"}, **HTMX)
    assert len(secrets_in(response.content.decode())) == 1
    assert_not_stored(response)


@pytest.mark.parametrize("htmx", [False, True])
def test_keys_page_is_never_stored(approved_client, api_key, htmx):
    response = approved_client.get(reverse("keys"), **(HTMX if htmx else {}))
    assert_not_stored(response)


def test_key_actions_answering_with_the_key_list_are_not_stored(approved_client, api_key):
    response = approved_client.post(
        reverse("key_rename", args=[api_key.pk]), {f"rename-{api_key.pk}-name": "new"}, **HTMX
    )
    assert response.status_code == 200
    assert_not_stored(response)
