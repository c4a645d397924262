"""Staff's second factor (issue 43.2): a staff member signed in with their password reaches no
staff page and no admin page until they typed a code of their authenticator app (or a
recovery code, each good once) in this session; without an authenticator they are sent to
enrol one first. Wrong codes count in the login throttle as wrong passwords do. Non-staff
sign in as before."""

import re
from base64 import b32decode
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib import admin
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from accounts.models import AuditLog
from accounts.services import second_factor
from tests.conftest import PASSWORD

from .support import HTMX, authenticator_enrolled, sign_in, totp_code
from .test_staff import STAFF_PAGES

CODE_LOCKED = "Too many wrong passwords or codes for this account from your address."
WRONG_CODE = "That code is wrong, or was used already."


@pytest.fixture(autouse=True)
def throttle(settings):
    settings.ACS_LOGIN_FAILURE_LIMIT = 5
    settings.ACS_LOGIN_LOCKOUT_SECONDS = 900


def password_only(user) -> Client:
    """A client signed in with `user`'s password alone (no second factor yet)."""
    client = Client()
    client.force_login(user)
    return client


def is_verified(client) -> bool:
    return "otp_device_id" in client.session


def staff_urls(pending_user, api_key) -> list[tuple[str, str]]:
    """(method, URL) of every staff page and a few of the admin's."""
    ids = {
        "user": pending_user.pk,
        "key": api_key.pk,
        "application": pending_user.applications.get().pk,
    }
    pages = [
        (method, reverse(name, args=[ids[a] for a in args])) for name, method, args in STAFF_PAGES
    ]
    pages += [
        ("get", reverse("usage:staff_overview")),
        ("get", reverse("usage:staff_user", args=[pending_user.pk])),
        ("get", reverse("admin:index")),
        ("get", reverse("admin:accounts_user_changelist")),
        ("get", reverse("admin:accounts_user_change", args=[pending_user.pk])),
        ("get", reverse("admin:password_change")),
    ]
    return pages


def request(client, method: str, url: str):
    """A GET, or a POST of what a staff form sends (an approval, the spend cap paused)."""
    if method == "get":
        return client.get(url)
    return client.post(url, {"decision": "approve", "paused": "on"})


def sent_to(response, name: str) -> str:
    """Asserts `response` redirects to the page `name`; returns where that page goes on to."""
    assert response.status_code == 302
    location = urlsplit(response["Location"])
    assert location.path == reverse(name)
    [next_url] = parse_qs(location.query)["next"]
    return next_url


def verify(client, code, next_url="/"):
    return client.post(reverse("second_factor_verify"), {"code": code, "next": next_url})


def test_staff_without_an_authenticator_reach_no_staff_or_admin_page_and_are_sent_to_enrol(
    staff_user, pending_user, api_key
):
    client = password_only(staff_user)
    for method, url in staff_urls(pending_user, api_key):
        response = request(client, method, url)
        assert sent_to(response, "second_factor_enrol") == url
    assert not AuditLog.objects.exclude(action="key.create").exists()


def test_staff_with_an_authenticator_reach_staff_and_admin_pages_only_after_a_valid_code(
    staff_user, pending_user, api_key
):
    staff_user.is_superuser = True  # the admin's model pages need its permissions
    staff_user.save()
    device = authenticator_enrolled(staff_user)
    client = password_only(staff_user)
    for method, url in staff_urls(pending_user, api_key):
        response = request(client, method, url)
        assert sent_to(response, "second_factor_verify") == url
    assert not AuditLog.objects.exclude(action="key.create").exists()

    response = verify(client, totp_code(device.bin_key), next_url=reverse("admin:index"))
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:index")
    assert is_verified(client)
    for method, url in staff_urls(pending_user, api_key):
        if method == "get":
            assert client.get(url).status_code == 200, url


def test_an_htmx_request_navigates_the_whole_page_to_the_second_factor_and_back(
    staff_user, pending_user
):
    authenticator_enrolled(staff_user)
    application = pending_user.applications.get()
    response = password_only(staff_user).post(
        reverse("staff_application_decide", args=[application.pk]),
        {"decision": "approve"},
        HTTP_HX_CURRENT_URL="http://testserver/staff/applications/?page=2",
        **HTMX,
    )
    assert response.status_code == 200
    assert response["HX-Redirect"] == (
        f"{reverse('second_factor_verify')}?next=%2Fstaff%2Fapplications%2F%3Fpage%3D2"
    )
    pending_user.refresh_from_db()
    assert pending_user.status == "pending"


def test_the_portal_login_sends_staff_on_to_their_second_factor_then_where_they_were_going(
    staff_user,
):
    device = authenticator_enrolled(staff_user)
    client = Client()
    response = client.post(
        reverse("login"),
        {"username": staff_user.email, "password": PASSWORD, "next": "/staff/users/"},
    )
    assert sent_to(response, "second_factor_verify") == "/staff/users/"
    assert client.get(reverse("staff_users")).status_code == 302
    response = verify(client, totp_code(device.bin_key), next_url="/staff/users/")
    assert response["Location"] == "/staff/users/"
    assert client.get(reverse("staff_users")).status_code == 200


def test_the_admin_login_leads_staff_through_their_second_factor(staff_user):
    device = authenticator_enrolled(staff_user)
    client = Client()
    response = client.post(
        reverse("admin:login"),
        {"username": staff_user.email, "password": PASSWORD, "next": "/admin/"},
        follow=True,
    )
    assert [url for url, _ in response.redirect_chain][-2:] == [
        "/admin/",
        f"{reverse('second_factor_verify')}?next=%2Fadmin%2F",
    ]
    response = verify(client, totp_code(device.bin_key), next_url="/admin/")
    assert response["Location"] == "/admin/"
    assert client.get("/admin/").status_code == 200


def test_a_non_staff_users_login_and_pages_are_unchanged(approved_user):
    client = Client()
    response = client.post(
        reverse("login"), {"username": approved_user.email, "password": PASSWORD}
    )
    assert response.status_code == 302
    assert response["Location"] == "/"
    assert client.get(reverse("keys")).status_code == 200
    assert client.get(reverse("home")).status_code == 200
    for name in ("second_factor_verify", "second_factor_enrol"):
        assert client.get(reverse(name)).status_code == 403
    assert not TOTPDevice.objects.exists()


def enrolment_secret(html: str) -> bytes:
    """The secret the enrolment page shows as text, decoded as an app would."""
    text = re.search(r'id="totp-secret" class="secret">([A-Z2-7 ]+)<', html).group(1)
    return b32decode(text.replace(" ", ""))


def test_enrolment_shows_the_secret_takes_a_code_of_it_and_shows_ten_recovery_codes_once(
    staff_user,
):
    # The codes typed below are RFC 6238's (its appendix B: SHA1, T = 59 s, 8 digits 94287082;
    # an app shows the last 6), computed apart from django-otp.
    assert totp_code(b"12345678901234567890", at=59) == "287082"
    client = password_only(staff_user)
    page = client.get(reverse("second_factor_enrol"), {"next": "/staff/audit/"})
    assert "no-store" in page["Cache-Control"]
    html = page.content.decode()
    secret = enrolment_secret(html)
    assert len(secret) == 20
    # The same secret in the otpauth:// URI, under the site's name.
    uri = re.search(r'id="totp-uri" class="secret">([^<]+)<', html).group(1).replace("&amp;", "&")
    query = parse_qs(urlsplit(uri).query)
    assert uri.startswith("otpauth://totp/ACS%20Portal%3Astaff%40example.org?")
    assert b32decode(query["secret"][0]) == secret
    assert query["issuer"] == ["ACS Portal"]
    # Reloading the page shows the same secret (the app holds it already).
    assert enrolment_secret(client.get(reverse("second_factor_enrol")).content.decode()) == secret

    wrong = client.post(reverse("second_factor_enrol"), {"code": "000000"})
    assert WRONG_CODE in wrong.content.decode()
    assert client.get(reverse("staff_audit")).status_code == 302

    shown = client.post(
        reverse("second_factor_enrol"), {"code": totp_code(secret), "next": "/staff/audit/"}
    )
    assert shown.status_code == 200
    assert "no-store" in shown["Cache-Control"]
    codes = re.findall(r"<li><code>([a-z2-7]{8})</code></li>", shown.content.decode())
    assert len(set(codes)) == 10
    assert 'href="/staff/audit/"' in shown.content.decode()
    assert client.get(reverse("staff_audit")).status_code == 200
    [row] = AuditLog.objects.filter(action="user.second_factor_enrolled")
    assert row.actor == staff_user and row.target_id == str(staff_user.pk)
    # Enrolled: the page no longer adds a device, nor shows a secret or the codes again.
    again = client.get(reverse("second_factor_enrol"), follow=True)
    assert not any(code in again.content.decode() for code in codes)
    assert TOTPDevice.objects.filter(user=staff_user).count() == 1

    # A new session (the next sign-in) is asked for a code of the enrolled authenticator.
    later = password_only(staff_user)
    response = later.get(reverse("staff_audit"))
    assert response["Location"].startswith(reverse("second_factor_verify"))


def test_a_wrong_code_is_refused_and_five_lock_the_account_from_that_address(staff_user):
    device = authenticator_enrolled(staff_user)
    client = password_only(staff_user)
    responses = [verify(client, "123456") for _ in range(5)]
    assert all(WRONG_CODE in r.content.decode() for r in responses[:4])
    assert CODE_LOCKED in responses[4].content.decode()
    # The right code is refused unchecked while locked.
    right = verify(client, totp_code(device.bin_key))
    assert right.status_code == 200
    assert f"{CODE_LOCKED} Try again in 15 minutes." in right.content.decode()
    assert not is_verified(client)
    assert client.get(reverse("staff_users")).status_code == 302
    [row] = AuditLog.objects.filter(action="user.login_locked")
    assert row.target_id == str(staff_user.pk)
    assert row.after["scope"] == "pair" and row.after["failures"] == 5


def test_signing_in_again_with_the_password_does_not_forget_wrong_codes(staff_user):
    """Whoever has the password cannot wipe the count of wrong codes by signing in again."""
    authenticator_enrolled(staff_user)
    for _ in range(4):
        assert WRONG_CODE in verify(password_only(staff_user), "123456").content.decode()
    client = Client()
    client.post(reverse("login"), {"username": staff_user.email, "password": PASSWORD})
    assert CODE_LOCKED in verify(client, "654321").content.decode()


def test_wrong_passwords_and_wrong_codes_count_together(staff_user):
    authenticator_enrolled(staff_user)
    for _ in range(3):
        Client().post(reverse("login"), {"username": staff_user.email, "password": "wrong"})
    client = password_only(staff_user)
    verify(client, "123456")
    assert CODE_LOCKED in verify(client, "123456").content.decode()


def test_a_code_of_the_authenticator_is_taken_once(staff_user):
    device = authenticator_enrolled(staff_user)
    code = totp_code(device.bin_key)
    assert verify(password_only(staff_user), code).status_code == 302
    replayed = password_only(staff_user)
    assert WRONG_CODE in verify(replayed, code).content.decode()
    assert not is_verified(replayed)


def test_a_recovery_code_works_once(staff_user):
    device = second_factor.second_factor_enrolment(user=staff_user)
    codes = second_factor.second_factor_enrol(device=device)
    first = password_only(staff_user)
    response = verify(first, codes[3].upper(), next_url="/staff/users/")
    assert response["Location"] == "/staff/users/"
    page = first.get("/staff/users/")
    assert page.status_code == 200
    assert "You signed in with a recovery code; 9 left." in page.content.decode()

    second = password_only(staff_user)
    assert WRONG_CODE in verify(second, codes[3]).content.decode()
    assert not is_verified(second)
    assert verify(second, codes[4]).status_code == 302


def test_a_verified_session_goes_straight_on_and_only_to_this_site(staff_user):
    device = authenticator_enrolled(staff_user)
    client = password_only(staff_user)
    response = verify(client, totp_code(device.bin_key), next_url="https://evil.example/")
    assert response["Location"] == "/"
    again = client.get(reverse("second_factor_verify"), {"next": "/staff/audit/"})
    assert again["Location"] == "/staff/audit/"


def test_staff_reset_a_lost_second_factor_from_the_admin_with_an_audit_row(staff_user, other_user):
    other_user.is_staff = True
    other_user.save()
    device = authenticator_enrolled(other_user)
    lost = password_only(other_user)
    verify(lost, totp_code(device.bin_key))
    assert lost.get(reverse("staff_users")).status_code == 200
    staff_user.is_superuser = True
    staff_user.save()
    sign_in(Client(), staff_user).post(
        reverse("admin:accounts_user_changelist"),
        {"action": "reset_second_factor", "_selected_action": [other_user.pk]},
    )
    assert not TOTPDevice.objects.filter(user=other_user).exists()
    # Sessions verified by the removed authenticator are verified no more.
    response = lost.get(reverse("staff_users"))
    assert response["Location"].startswith(reverse("second_factor_enrol"))
    [row] = AuditLog.objects.filter(action="user.second_factor_reset")
    assert row.actor == staff_user and row.target_id == str(other_user.pk)


def test_operators_reset_a_second_factor_from_the_command_line(staff_user, capsys):
    device = second_factor.second_factor_enrolment(user=staff_user)
    second_factor.second_factor_enrol(device=device)
    call_command("acs_accounts", "reset-second-factor", staff_user.email)
    assert "second factor is reset" in capsys.readouterr().out
    assert not TOTPDevice.objects.filter(user=staff_user).exists()
    assert not StaticDevice.objects.filter(user=staff_user).exists()
    assert AuditLog.objects.filter(action="user.second_factor_reset", actor=None).exists()


def test_the_admin_shows_no_authenticator_secret_nor_recovery_code():
    assert not admin.site.is_registered(TOTPDevice)
    assert not admin.site.is_registered(StaticDevice)
