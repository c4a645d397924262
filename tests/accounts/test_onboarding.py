"""Sign-up → staff approval → e-mail → key shown once → key works; rejection and
re-application."""

import pytest
from django.core import mail
from django.test import Client
from django.urls import reverse

from accounts.models import AccessApplication, ApiKey, ApplicationStatus, AuditLog, User
from accounts.services.auth import api_key_authenticate

from .support import logged_in, secrets_in

SIGNUP = {
    "email": "Grace@Example.org",
    "password": "a-long-and-unusual-passphrase",
    "name": "Grace Hopper",
    "organisation": "Navy Research",
    "planned_use": "Finding refusal directions in the residual stream.",
    "prior_work": "A paper on linear probes.",
    "profile_link": "https://example.org/grace",
    "accepted_usage_rules": "on",
}


def sign_up(client, **changes):
    return client.post(reverse("apply"), {**SIGNUP, **changes})


def decide(staff_client, application, decision, note=""):
    """Decide as staff do, a rejection confirmed (see test_staff for the confirmation)."""
    return staff_client.post(
        reverse("staff_application_decide", args=[application.pk]),
        {"decision": decision, "note": note, "confirmed": "true"},
    )


def test_signup_creates_pending_account_with_application_and_logs_in(db):
    client = Client()
    response = sign_up(client)
    assert response.status_code == 302
    user = User.objects.get(email="grace@example.org")
    assert user.status == "pending"
    assert user.check_password(SIGNUP["password"])
    application = user.applications.get()
    assert application.status == ApplicationStatus.PENDING
    assert application.planned_use == SIGNUP["planned_use"]
    assert application.profile_link == SIGNUP["profile_link"]
    assert application.accepted_usage_rules
    home = client.get("/")
    assert "Your application is being reviewed" in home.content.decode()


@pytest.mark.parametrize(
    ("field", "changes", "message"),
    [
        ("accepted_usage_rules", {"accepted_usage_rules": ""}, "Accept the usage rules"),
        ("profile_link", {"profile_link": "not a url"}, "Enter a valid URL"),
        ("password", {"password": "short"}, "too short"),
        ("planned_use", {"planned_use": ""}, "This field is required"),
        ("email", {"email": "ada@example.org"}, "already exists"),
    ],
)
def test_signup_errors_are_shown_next_to_their_field(approved_user, field, changes, message):
    response = sign_up(Client(), **changes)
    assert response.status_code == 200
    form = response.context["form"]
    assert any(message in error for error in form.errors[field])
    html = response.content.decode()
    # The error list follows the field's own input inside the same field block.
    block = html.split(f'name="{field}"', 1)[1].split('<div class="field', 1)[0]
    assert message in block.replace("&#x27;", "'")
    assert User.objects.filter(email="grace@example.org").count() == 0


def test_application_approval_emails_and_shows_key_once_which_then_works(
    db, staff_client, staff_user, commit
):
    client = Client()
    sign_up(client)
    application = AccessApplication.objects.get(user__email="grace@example.org")

    with commit():
        response = decide(staff_client, application, "approve", note="Welcome!")
    assert response.status_code == 302

    user = User.objects.get(email="grace@example.org")
    assert user.status == "approved"
    assert user.monthly_token_budget > 0
    key = ApiKey.objects.get(user=user)
    assert key.name == "Default key"

    assert len(mail.outbox) == 1
    message = mail.outbox[0]
    assert message.to == ["grace@example.org"]
    assert "/keys/" in message.body
    assert "acs-" not in message.body  # the secret is never e-mailed

    first = client.get(reverse("keys"))
    shown = secrets_in(first.content.decode())
    assert len(shown) == 1
    assert shown[0].startswith(f"acs-{key.prefix}-")
    second = client.get(reverse("keys"))
    assert secrets_in(second.content.decode()) == []
    assert f"acs-{key.prefix}" in second.content.decode()

    assert api_key_authenticate(f"Bearer {shown[0]}").pk == key.pk
    actions = set(AuditLog.objects.filter(actor=staff_user).values_list("action", flat=True))
    assert {"user.approve", "key.create"} <= actions


def test_rejection_emails_the_note_and_the_applicant_may_apply_again(
    pending_user, staff_client, staff_user, commit
):
    application = pending_user.applications.get()
    with commit():
        decide(staff_client, application, "reject", note="Tell us more about your method.")
    pending_user.refresh_from_db()
    assert pending_user.status == "rejected"
    assert len(mail.outbox) == 1
    assert "Tell us more about your method." in mail.outbox[0].body
    assert AuditLog.objects.filter(actor=staff_user, action="user.reject").exists()

    client = logged_in(pending_user)
    home = client.get("/").content.decode()
    assert "Tell us more about your method." in home
    assert 'href="/apply/"' in home

    form = client.get(reverse("apply"))
    assert form.status_code == 200
    assert "email" not in form.context["form"].fields  # re-application: no new account
    response = client.post(
        reverse("apply"),
        {"planned_use": "Sparse autoencoders on layer 12.", "accepted_usage_rules": "on"},
    )
    assert response.status_code == 302
    pending_user.refresh_from_db()
    assert pending_user.status == "pending"
    assert pending_user.applications.count() == 2
    assert pending_user.applications.first().status == ApplicationStatus.PENDING

    with commit():
        decide(staff_client, pending_user.applications.first(), "approve")
    pending_user.refresh_from_db()
    assert pending_user.status == "approved"


def test_pending_and_approved_users_cannot_apply_again(pending_user, approved_user):
    for user in (pending_user, approved_user):
        response = logged_in(user).post(
            reverse("apply"), {"planned_use": "Again.", "accepted_usage_rules": "on"}
        )
        assert response.status_code == 302
        assert user.applications.filter(status="pending").count() == (user == pending_user)


def test_deciding_an_application_twice_is_refused(pending_user, staff_client, commit):
    application = pending_user.applications.get()
    with commit():
        decide(staff_client, application, "approve")
    response = decide(staff_client, application, "reject")
    assert response.status_code == 200
    assert "already approved" in response.content.decode()
    pending_user.refresh_from_db()
    assert pending_user.status == "approved"


def test_login_and_logout(approved_user):
    client = Client()
    page = client.get(reverse("login"))
    assert page.status_code == 200
    response = client.post(reverse("login"), {"username": approved_user.email, "password": "wrong"})
    assert response.status_code == 200
    assert "correct" in response.content.decode()  # "Please enter a correct email..."
    response = client.post(
        reverse("login"),
        {"username": approved_user.email, "password": "correct-horse-battery-staple"},
    )
    assert response.status_code == 302
    assert client.get("/").context["user"] == approved_user
    assert client.post(reverse("logout")).status_code == 302
    assert not client.get("/").context["user"].is_authenticated


def test_anonymous_landing_explains_and_links_apply_and_login(db):
    html = Client().get("/").content.decode()
    assert "interpretability" in html
    assert 'href="/apply/"' in html
    assert 'href="/login/"' in html


def test_suspended_user_sees_notice(suspended_user):
    html = logged_in(suspended_user).get("/").content.decode()
    assert "suspended" in html
