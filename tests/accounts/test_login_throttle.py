"""Login throttling: too many wrong passwords lock one account and IP address pair, an account
from addresses it has not signed in from (for longer at each lock) or an address across
accounts, with a clear message and an audit row, counted in PostgreSQL so that it holds while
Redis is down. The owner still signs in from an address they signed in from before."""

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts import login_throttle
from accounts.models import AuditLog, LoginAddress, LoginThrottle
from infra.redis import redis_sync_reset
from tests.conftest import PASSWORD

from .support import logged_in

ATTACKER_IP = "203.0.113.7"
HOME_IP = "192.0.2.50"
LOCKED_MESSAGE = "Too many wrong passwords for this account from your address"
ACCOUNT_LOCKED = "Too many wrong passwords for this account. Try again in"
ADDRESS_LOCKED = "Too many wrong passwords from your address. Try again in"


@pytest.fixture(autouse=True)
def throttle(settings):
    settings.ACS_LOGIN_FAILURE_LIMIT = 5
    settings.ACS_LOGIN_LOCKOUT_SECONDS = 900
    settings.ACS_LOGIN_ACCOUNT_FAILURE_LIMIT = 20
    settings.ACS_LOGIN_ADDRESS_FAILURE_LIMIT = 12
    settings.ACS_LOGIN_LOCKOUT_MAX_SECONDS = 86400
    settings.ACS_LOGIN_KNOWN_ADDRESS_SECONDS = 90 * 86400


def log_in(client, email, password, ip=ATTACKER_IP):
    return client.post(reverse("login"), {"username": email, "password": password}, REMOTE_ADDR=ip)


def is_logged_in(client) -> bool:
    return "_auth_user_id" in client.session


def fail(client, email, times, ip=ATTACKER_IP):
    return [log_in(client, email, "wrong-password", ip) for _ in range(times)]


def lock_account_from_twenty_addresses(email):
    responses = [log_in(Client(), email, "wrong-password", ip=f"198.51.100.{i}") for i in range(20)]
    assert ACCOUNT_LOCKED in responses[-1].content.decode()


def signs_in(email, ip) -> bool:
    client = Client()
    response = log_in(client, email, PASSWORD, ip)
    return response.status_code == 302 and is_logged_in(client)


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
    assert row.after == {"scope": "pair", "ip": ATTACKER_IP, "failures": 5, "lockout_seconds": 900}


def test_an_unknown_account_is_locked_too(db):
    *_, fifth = fail(Client(), "nobody@example.org", 5)
    assert LOCKED_MESSAGE in fifth.content.decode()
    assert not AuditLog.objects.filter(action="user.login_locked").exists()


def test_the_lock_expires(approved_user):
    client = Client()
    fail(client, approved_user.email, 5)
    assert LOCKED_MESSAGE in log_in(client, approved_user.email, PASSWORD).content.decode()
    [lock] = LoginThrottle.objects.exclude(locked_until=None)
    assert 890 < (lock.locked_until - timezone.now()).total_seconds() <= 900
    _lock_ends(lock)  # as if the 15 minutes had passed
    assert log_in(client, approved_user.email, PASSWORD).status_code == 302
    assert is_logged_in(client)


def _lock_ends(row):
    """Move `row`'s lock (and the window that follows it) into the past, as time would."""
    shift = row.locked_until - timezone.now() + timedelta(seconds=1)
    LoginThrottle.objects.filter(pk=row.pk).update(
        locked_until=row.locked_until - shift, window_started_at=row.window_started_at - shift
    )


def test_a_successful_login_forgets_earlier_failures(approved_user):
    client = Client()
    fail(client, approved_user.email, 4)
    assert log_in(client, approved_user.email, PASSWORD).status_code == 302
    client.logout()
    fail(client, approved_user.email, 4)
    assert log_in(client, approved_user.email, PASSWORD).status_code == 302


def test_guesses_spread_over_many_addresses_lock_the_account_everywhere(approved_user):
    """20 wrong passwords from 20 addresses: then the right one is refused from a 21st."""
    responses = [
        log_in(Client(), approved_user.email, "wrong-password", ip=f"198.51.100.{i}")
        for i in range(20)
    ]
    assert all(ACCOUNT_LOCKED not in r.content.decode() for r in responses[:-1])
    assert ACCOUNT_LOCKED in responses[-1].content.decode()
    client = Client()
    refused = log_in(client, approved_user.email, PASSWORD, ip="192.0.2.200")
    assert f"{ACCOUNT_LOCKED} 15 minutes" in refused.content.decode()
    assert not is_logged_in(client)
    [row] = AuditLog.objects.filter(action="user.login_locked")
    assert row.target_id == str(approved_user.pk)
    assert row.after == {
        "scope": "account",
        "ip": "198.51.100.19",
        "failures": 20,
        "lockout_seconds": 900,
    }


def test_an_accounts_lockouts_grow_and_its_owners_login_does_not_reset_them(
    approved_user, settings
):
    settings.ACS_LOGIN_ACCOUNT_FAILURE_LIMIT = 3
    account = LoginThrottle.objects.filter(scope="account")

    def lock_for(expected_minutes):
        for i in range(3):
            last = log_in(Client(), approved_user.email, "wrong-password", ip=f"198.51.100.{i}")
        assert f"{ACCOUNT_LOCKED} {expected_minutes} minutes" in last.content.decode()
        _lock_ends(account.get())

    for expected_minutes in (15, 30, 60):
        lock_for(expected_minutes)
    lockouts = [
        row.after["lockout_seconds"]
        for row in AuditLog.objects.filter(action="user.login_locked").order_by("created_at")
    ]
    assert lockouts == [900, 1800, 3600]
    assert signs_in(approved_user.email, "192.0.2.1")
    # A fresh start at each of the owner's logins would let the guessing go on unhindered.
    lock_for(120)


def test_the_owner_signs_in_from_a_known_address_while_the_account_is_locked(approved_user):
    assert signs_in(approved_user.email, HOME_IP)
    lock_account_from_twenty_addresses(approved_user.email)
    assert signs_in(approved_user.email, HOME_IP)


def test_a_new_address_is_refused_while_locked_even_after_the_owner_signed_in(approved_user):
    assert signs_in(approved_user.email, HOME_IP)
    lock_account_from_twenty_addresses(approved_user.email)
    assert signs_in(approved_user.email, HOME_IP)
    client = Client()
    refused = log_in(client, approved_user.email, PASSWORD, ip="192.0.2.200")
    assert refused.status_code == 200
    assert f"{ACCOUNT_LOCKED} 15 minutes" in refused.content.decode()
    assert not is_logged_in(client)


def test_an_address_is_known_only_for_a_while_after_its_last_login(approved_user, settings):
    assert signs_in(approved_user.email, HOME_IP)
    lock_account_from_twenty_addresses(approved_user.email)
    assert signs_in(approved_user.email, HOME_IP)
    LoginAddress.objects.update(
        last_login_at=timezone.now() - timedelta(seconds=settings.ACS_LOGIN_KNOWN_ADDRESS_SECONDS)
    )
    client = Client()
    refused = log_in(client, approved_user.email, PASSWORD, ip=HOME_IP)
    assert ACCOUNT_LOCKED in refused.content.decode()
    assert not is_logged_in(client)


def test_guesses_from_a_known_address_lock_that_address_not_the_account(approved_user, settings):
    settings.ACS_LOGIN_ACCOUNT_FAILURE_LIMIT = 3
    assert signs_in(approved_user.email, HOME_IP)
    client = Client()
    *_, fifth = fail(client, approved_user.email, 5, ip=HOME_IP)
    assert LOCKED_MESSAGE in fifth.content.decode()
    assert LOCKED_MESSAGE in log_in(client, approved_user.email, PASSWORD, HOME_IP).content.decode()
    assert not is_logged_in(client)
    assert signs_in(approved_user.email, "192.0.2.9")


def test_staff_lift_an_accounts_lock_from_the_admin_with_an_audit_row(approved_user, staff_user):
    for i in range(20):
        log_in(Client(), approved_user.email, "wrong-password", ip=f"198.51.100.{i}")
    client = Client()
    assert ACCOUNT_LOCKED in log_in(client, approved_user.email, PASSWORD).content.decode()
    staff_user.is_superuser = True
    staff_user.save()
    admin = logged_in(staff_user)
    admin.post(
        reverse("admin:accounts_user_changelist"),
        {"action": "lift_login_lock", "_selected_action": [approved_user.pk]},
    )
    assert log_in(client, approved_user.email, PASSWORD, ip="192.0.2.9").status_code == 302
    [row] = AuditLog.objects.filter(action="user.login_unlocked")
    assert row.actor == staff_user and row.target_id == str(approved_user.pk)


def test_an_address_guessing_across_accounts_is_locked_for_every_account(approved_user):
    responses = [log_in(Client(), f"user{i}@example.org", "wrong-password") for i in range(12)]
    assert ADDRESS_LOCKED in responses[-1].content.decode()
    # The right password of a real account, from that address: refused unchecked.
    assert ADDRESS_LOCKED in log_in(Client(), approved_user.email, PASSWORD).content.decode()
    elsewhere = Client()
    assert log_in(elsewhere, approved_user.email, PASSWORD, ip="192.0.2.9").status_code == 302
    [row] = AuditLog.objects.filter(action="login.address_locked")
    assert row.target_type == "loginthrottle"
    assert row.after == {
        "scope": "address",
        "ip": ATTACKER_IP,
        "failures": 12,
        "lockout_seconds": 900,
    }


def test_throttling_holds_while_redis_is_down(approved_user, settings):
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens there
    redis_sync_reset()
    try:
        client = Client()
        *_, fifth = fail(client, approved_user.email, 5)
        assert LOCKED_MESSAGE in fifth.content.decode()
        assert LOCKED_MESSAGE in log_in(client, approved_user.email, PASSWORD).content.decode()
        assert not is_logged_in(client)
    finally:
        redis_sync_reset()


@pytest.mark.django_db(transaction=True)
def test_concurrent_guesses_from_many_addresses_lock_the_account_exactly_once(approved_user):
    start = threading.Barrier(20)

    def guess(i):
        try:
            start.wait()
            return login_throttle.login_failed(username=approved_user.email, ip=f"10.0.0.{i}")
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=20) as pool:
        locks = list(pool.map(guess, range(20)))

    assert [lock.scope for lock in locks if lock] == ["account"]
    assert AuditLog.objects.filter(action="user.login_locked").count() == 1
    assert login_throttle.login_lock(username=approved_user.email, ip="10.9.9.9").scope == "account"


def test_counts_that_no_longer_matter_are_pruned(approved_user):
    fail(Client(), approved_user.email, 5)  # the pair is locked; account and address counted
    assert LoginThrottle.objects.count() == 3
    assert login_throttle.login_throttles_prune() == 0
    later = timezone.now() + timedelta(days=1, hours=1)
    assert login_throttle.login_throttles_prune(now=later) == 3


def test_addresses_no_longer_known_are_pruned(approved_user, other_user, settings):
    assert signs_in(approved_user.email, HOME_IP)
    assert signs_in(other_user.email, HOME_IP)
    LoginAddress.objects.filter(user=approved_user).update(
        last_login_at=timezone.now() - timedelta(seconds=settings.ACS_LOGIN_KNOWN_ADDRESS_SECONDS)
    )
    assert login_throttle.login_throttles_prune() == 1
    assert list(LoginAddress.objects.values_list("user", flat=True)) == [other_user.pk]


def admin_log_in(client, email, password, ip=ATTACKER_IP):
    return client.post(
        reverse("admin:login"),
        {"username": email, "password": password, "next": "/admin/"},
        REMOTE_ADDR=ip,
    )


def test_a_hundred_wrong_passwords_on_the_admin_login_lock_it_as_on_the_portals(
    staff_user, approved_user
):
    """The admin's login counts in the same throttle: locked at the fifth wrong password from
    one address, the right one refused while locked, one audit row as for /login/."""
    client = Client()
    responses = [admin_log_in(client, staff_user.email, "wrong-password") for _ in range(100)]
    assert all(LOCKED_MESSAGE not in r.content.decode() for r in responses[:4])
    assert all(LOCKED_MESSAGE in r.content.decode() for r in responses[4:])
    refused = admin_log_in(client, staff_user.email, PASSWORD)
    assert refused.status_code == 200
    assert f"{LOCKED_MESSAGE}. Try again in 15 minutes." in refused.content.decode()
    assert not is_logged_in(client)
    # Locked on both login pages alike, for the pair only.
    assert LOCKED_MESSAGE in log_in(Client(), staff_user.email, PASSWORD).content.decode()
    assert admin_log_in(Client(), staff_user.email, PASSWORD, ip=HOME_IP).status_code == 302
    [row] = AuditLog.objects.filter(action="user.login_locked")
    assert row.target_id == str(staff_user.pk)
    assert row.after == {"scope": "pair", "ip": ATTACKER_IP, "failures": 5, "lockout_seconds": 900}
    # /login/'s lock of another account, for comparison: the same row.
    fail(Client(), approved_user.email, 5)
    portal = AuditLog.objects.filter(action="user.login_locked").exclude(pk=row.pk).get()
    assert portal.after == row.after


def test_the_admin_login_counts_a_non_staff_accounts_wrong_passwords_not_its_right_one(
    approved_user,
):
    client = Client()
    for _ in range(6):
        refused = admin_log_in(client, approved_user.email, PASSWORD)
        assert "Please enter the correct" in refused.content.decode()
    assert not LoginThrottle.objects.exists()
    *_, fifth = [admin_log_in(client, approved_user.email, "wrong-password") for _ in range(5)]
    assert LOCKED_MESSAGE in fifth.content.decode()


def test_the_admins_password_change_checks_the_old_password_through_the_throttle(staff_user):
    client = logged_in(staff_user)

    def change(old_password):
        return client.post(
            reverse("admin:password_change"),
            {
                "old_password": old_password,
                "new_password1": "a-new-long-passphrase-7",
                "new_password2": "a-new-long-passphrase-7",
            },
            REMOTE_ADDR=ATTACKER_IP,
        )

    responses = [change("wrong-password") for _ in range(5)]
    assert all(
        "Your old password was entered incorrectly" in r.content.decode() for r in responses[:4]
    )
    assert LOCKED_MESSAGE in responses[4].content.decode()
    refused = change(PASSWORD)
    assert refused.status_code == 200
    assert LOCKED_MESSAGE in refused.content.decode()
    staff_user.refresh_from_db()
    assert staff_user.check_password(PASSWORD)
    assert (
        AuditLog.objects.filter(action="user.login_locked", target_id=str(staff_user.pk)).count()
        == 1
    )


def test_a_login_without_a_password_says_so_and_counts_nothing(approved_user):
    response = Client().post(reverse("login"), {"username": approved_user.email, "password": ""})
    assert response.status_code == 200
    assert "This field is required." in response.content.decode()
    assert not LoginThrottle.objects.exists()
