"""The operator CLI: acs_accounts, acs_keys, acs_demo."""

import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from django.core import mail
from django.core.management import CommandError, call_command

from accounts.models import ApiKey, AuditLog, KeyStatus, User
from accounts.services.auth import AuthError, api_key_authenticate


def run(*args):
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_create_account_pending_then_approve(db, commit):
    out = run("acs_accounts", "create", "new@example.org", "--password", "pw-123456789")
    user = User.objects.get(email="new@example.org")
    assert user.status == "pending"
    assert user.check_password("pw-123456789")
    assert "Password:" not in out
    with commit():
        out = run("acs_accounts", "approve", "new@example.org")
    assert "approved" in out
    user.refresh_from_db()
    assert user.status == "approved"
    assert ApiKey.objects.get(user=user).name == "Default key"
    assert len(mail.outbox) == 1


def test_create_approved_staff_account_prints_generated_password(db):
    out = run(
        "acs_accounts", "create", "boss@example.org", "--name", "Boss", "--approve", "--staff"
    )
    user = User.objects.get(email="boss@example.org")
    assert (user.status, user.is_staff, user.name) == ("approved", True, "Boss")
    password = next(line for line in out.splitlines() if line.startswith("Password: "))
    assert user.check_password(password.removeprefix("Password: "))


def test_reject_suspend_reactivate(pending_user, approved_user, api_key, api_secret):
    run("acs_accounts", "reject", pending_user.email)
    pending_user.refresh_from_db()
    assert pending_user.status == "rejected"
    run("acs_accounts", "suspend", approved_user.email)
    with pytest.raises(AuthError) as error:
        api_key_authenticate(f"Bearer {api_secret}")
    assert error.value.code == "account_suspended"
    run("acs_accounts", "reactivate", approved_user.email)
    assert api_key_authenticate(f"Bearer {api_secret}").pk == api_key.pk
    assert AuditLog.objects.filter(action="user.suspend", actor=None).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("acs_accounts", "approve", "nobody@example.org"), "No account with e-mail"),
        (("acs_accounts", "suspend", "pat@example.org"), "only approved accounts"),
        (("acs_accounts", "approve", "ada@example.org"), "no pending application"),
        (("acs_accounts", "create", "ada@example.org"), "already exists"),
        (("acs_keys", "create", "nobody@example.org"), "No account with e-mail"),
        (("acs_keys", "create", "pat@example.org"), "only approved accounts get keys"),
        (("acs_keys", "list", "nobody@example.org"), "No account with e-mail"),
        (("acs_keys", "revoke", "zzzzzzzz"), "No API key with prefix"),
        (("acs_keys", "disable", "acs-zzzzzzzz"), "No API key with prefix"),
        (("acs_keys", "enable", "zzzzzzzz"), "No API key with prefix"),
    ],
)
def test_bad_input_is_a_one_line_command_error(approved_user, pending_user, args, message):
    with pytest.raises(CommandError) as error:
        run(*args)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_keys_create_prints_the_secret_alone_on_the_last_line(approved_user):
    out = run(
        "acs_keys",
        "create",
        approved_user.email,
        "--name",
        "ci",
        "--monthly-budget",
        "1000",
        "--daily-budget",
        "100",
    )
    secret = out.rstrip("\n").splitlines()[-1]
    key = api_key_authenticate(f"Bearer {secret}")
    assert (key.name, key.monthly_token_budget, key.daily_token_budget) == ("ci", 1000, 100)
    assert secret not in out.rstrip("\n").splitlines()[0]


def test_keys_list_and_status_changes(approved_user, other_user, api_key, api_secret):
    out = run("acs_keys", "list", approved_user.email)
    assert f"acs-{api_key.prefix}" in out
    assert other_user.email not in out
    run("acs_keys", "disable", api_key.prefix)
    api_key.refresh_from_db()
    assert api_key.status == KeyStatus.DISABLED
    run("acs_keys", "enable", f"acs-{api_key.prefix}")
    run("acs_keys", "revoke", api_key.prefix)
    api_key.refresh_from_db()
    assert api_key.status == KeyStatus.REVOKED
    with pytest.raises(CommandError, match="revoked"):
        run("acs_keys", "enable", api_key.prefix)
    assert "revoked" in run("acs_keys", "list")


def test_keys_create_rejects_negative_budget_as_usage_error(approved_user):
    with pytest.raises(CommandError):
        run("acs_keys", "create", approved_user.email, "--daily-budget", "-1")


def test_acs_demo_is_idempotent_and_prints_the_key_only_once(db, settings):
    settings.SITE_URL = "http://127.0.0.1:8765"
    first = run("acs_demo")
    assert "http://127.0.0.1:8765/" in first
    assert "staff@acs.local" in first and "researcher@acs.local" in first
    # The demo staff enrol their second factor at their first sign-in (no known secret).
    assert "then a second factor: at the first sign-in" in first
    assert "acs_accounts reset-second-factor staff@acs.local" in first
    secret = first.split("shown only this once): ", 1)[1].split()[0]
    key = api_key_authenticate(f"Bearer {secret}")
    assert key.user.email == "researcher@acs.local"
    assert User.objects.get(email="staff@acs.local").is_staff
    # The key was printed, so the API keys page does not show it again.
    assert ApiKey.objects.get(pk=key.pk).pending_reveal == ""

    second = run("acs_demo")
    assert "acs_keys create researcher@acs.local" in second
    assert secret not in second
    assert User.objects.filter(email__endswith="@acs.local").count() == 2
    assert ApiKey.objects.count() == 1


def test_acs_secrets_prints_fresh_long_secrets_and_a_valid_fernet_key():
    first, second = (
        dict(line.split("=", 1) for line in run("acs_secrets").splitlines()) for _ in range(2)
    )
    names = {"SECRET_KEY", "API_KEY_HMAC_SECRET", "PLAYGROUND_KEY_ENCRYPTION_KEY"}
    assert set(first) == set(second) == names
    for name in names:
        assert first[name] != second[name]
    assert len(first["SECRET_KEY"]) >= 50
    assert len(set(first["SECRET_KEY"])) >= 5
    assert len(first["API_KEY_HMAC_SECRET"]) >= 40
    fernet = Fernet(first["PLAYGROUND_KEY_ENCRYPTION_KEY"].encode())
    assert fernet.decrypt(fernet.encrypt(b"acs-secret")) == b"acs-secret"


def test_secrets_are_generated_where_settings_cannot_load_yet():
    """With DEBUG off and no secrets, the settings refuse to load; the first secrets must
    still come out."""
    environment = {"PATH": os.environ["PATH"], "DEBUG": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "accounts.secret_generation"],
        cwd=Path(__file__).resolve().parents[2],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert set(lines) == {"SECRET_KEY", "API_KEY_HMAC_SECRET", "PLAYGROUND_KEY_ENCRYPTION_KEY"}
    Fernet(lines["PLAYGROUND_KEY_ENCRYPTION_KEY"].encode())
