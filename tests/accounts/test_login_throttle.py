"""Login throttling: too many wrong passwords lock one account and IP address pair for a while,
with a clear message and an audit row; other addresses and accounts keep working."""

import time

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import AuditLog
from tests.conftest import PASSWORD

ATTACKER_IP = "203.0.113.7"
LOCKED_MESSAGE = "Too many wrong passwords for this account from your address"


@pytest.fixture(autouse=True)
def throttle(settings, redis_client):
    settings.ACS_LOGIN_FAILURE_LIMIT = 5
    settings.ACS_LOGIN_LOCKOUT_SECONDS = 900


def log_in(client, email, password, ip=ATTACKER_IP):
    return client.post(reverse("login"), {"username": email, "password": password}, REMOTE_ADDR=ip)


def is_logged_in(client) -> bool:
    return "_auth_user_id" in client.session


def fail(client, email, times, ip=ATTACKER_IP):
    return [log_in(client, email, "wrong-password", ip) for _ in range(times)]


def test_right_password_after_five_wrong_ones_is_refused_with_the_message(approved_user):
    client = Client()
    *first, fifth = fail(client, approved_user.email, 5)
    assert all(LOCKED_MESSAGE not in r.content.decode() for r in first)
    assert LOCKED_MESSAGE in fifth.content.decode()
    response = log_in(client, approved_user.email, PASSWORD)
    assert response.status_code == 200
    assert LOCKED_MESSAGE in response.content.decode()
    assert "Try again in 15 minutes" in response.content.decode()
    assert not is_logged_in(client)


def test_another_address_and_another_account_are_unaffected(approved_user, other_user):
    fail(Client(), approved_user.email, 5)
    from_elsewhere = Client()
    assert (
        log_in(from_elsewhere, approved_user.email, PASSWORD, ip="198.51.100.1").status_code == 302
    )
    assert is_logged_in(from_elsewhere)
    other_account = Client()
    assert log_in(other_account, other_user.email, PASSWORD).status_code == 302
    assert is_logged_in(other_account)


def test_the_lock_writes_one_audit_row(approved_user):
    fail(Client(), approved_user.email, 8)
    rows = AuditLog.objects.filter(action="user.login_locked")
    assert rows.count() == 1
    row = rows.get()
    assert row.actor is None
    assert row.target_id == str(approved_user.pk)
    assert row.after == {"ip": ATTACKER_IP, "failures": 5, "lockout_seconds": 900}


def test_an_unknown_account_is_locked_too(db):
    *_, fifth = fail(Client(), "nobody@example.org", 5)
    assert LOCKED_MESSAGE in fifth.content.decode()
    assert not AuditLog.objects.filter(action="user.login_locked").exists()


def test_the_lock_expires(approved_user, redis_client):
    client = Client()
    fail(client, approved_user.email, 5)
    assert LOCKED_MESSAGE in log_in(client, approved_user.email, PASSWORD).content.decode()
    [lock] = redis_client.keys("login:failures:*")
    assert 890 < redis_client.ttl(lock) <= 900
    redis_client.expire(lock, 1)  # as if the 15 minutes had passed
    deadline = time.monotonic() + 15
    while log_in(client, approved_user.email, PASSWORD).status_code != 302:
        assert time.monotonic() < deadline, "the lock did not expire"
        time.sleep(0.25)
    assert is_logged_in(client)


def test_a_successful_login_forgets_earlier_failures(approved_user):
    client = Client()
    fail(client, approved_user.email, 4)
    assert log_in(client, approved_user.email, PASSWORD).status_code == 302
    client.logout()
    fail(client, approved_user.email, 4)
    assert log_in(client, approved_user.email, PASSWORD).status_code == 302
