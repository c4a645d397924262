"""Staff pages: applications queue, users, per-user page, audit log, spend cap."""

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import AccessApplication, AuditLog, ServiceSettings, UserStatus
from accounts.services.auth import AuthError, api_key_authenticate
from metering.windows import ACCOUNT, of_scope

from .support import HTMX, logged_in

STAFF_PAGES = [
    ("staff_applications", "get", []),
    ("staff_users", "get", []),
    ("staff_audit", "get", []),
    ("staff_spend_cap", "get", []),
    ("staff_spend_cap", "post", []),
    ("staff_user_detail", "get", ["user"]),
    ("staff_user_status", "post", ["user"]),
    ("staff_user_budget", "post", ["user"]),
    ("staff_key_budget", "post", ["key"]),
    ("staff_key_status", "post", ["key"]),
    ("staff_application_decide", "post", ["application"]),
]


@pytest.mark.parametrize(("name", "method", "args"), STAFF_PAGES)
def test_staff_pages_refuse_non_staff(approved_user, api_key, pending_user, name, method, args):
    ids = {
        "user": pending_user.pk,
        "key": api_key.pk,
        "application": pending_user.applications.get().pk,
    }
    url = reverse(name, args=[ids[a] for a in args])
    response = getattr(logged_in(approved_user), method)(url, {"decision": "approve"})
    assert response.status_code == 403
    assert "staff" in response.content.decode()
    pending_user.refresh_from_db()
    assert pending_user.status == UserStatus.PENDING
    assert not AuditLog.objects.exclude(action="key.create").exists()


def test_staff_pages_send_anonymous_visitors_to_login(db):
    response = Client().get(reverse("staff_applications"))
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


@pytest.mark.parametrize(("name", "args"), [(n, a) for n, m, a in STAFF_PAGES if m == "get"])
def test_staff_pages_render_for_staff(staff_client, pending_user, name, args):
    url = reverse(name, args=[pending_user.pk] if args else [])
    assert staff_client.get(url).status_code == 200


def test_queue_lists_pending_first_with_details(staff_client, pending_user, approved_user):
    decided = AccessApplication.objects.create(
        user=approved_user, planned_use="Old approved one.", status="approved"
    )
    html = staff_client.get(reverse("staff_applications")).content.decode()
    assert html.index("Probing truthfulness directions.") < html.index("Old approved one.")
    assert pending_user.email in html
    assert reverse("staff_application_decide", args=[pending_user.applications.get().pk]) in html
    assert reverse("staff_application_decide", args=[decided.pk]) not in html


def test_queue_is_full_page_without_htmx_and_partial_with_it(staff_client, pending_user):
    full = staff_client.get(reverse("staff_applications")).content.decode()
    partial = staff_client.get(reverse("staff_applications"), **HTMX).content.decode()
    assert full.lstrip().lower().startswith("<!doctype html>")
    assert partial.lstrip().startswith('<div id="application-queue">')
    assert "<html" not in partial
    assert pending_user.email in partial


def test_approve_with_htmx_answers_the_decided_card_with_the_message_in_it(
    staff_client, pending_user, commit
):
    application = pending_user.applications.get()
    with commit():
        response = staff_client.post(
            reverse("staff_application_decide", args=[application.pk]),
            {"decision": "approve", "note": ""},
            **HTMX,
        )
    assert response.status_code == 200
    html = response.content.decode()
    # The card the form targets, in place: the message is where the person clicked.
    assert html.lstrip().startswith(
        f'<article class="card application approved" id="application-{application.pk}"'
    )
    assert html.count("<article") == 1
    assert '<span class="badge approved">Approved</span>' in html
    assert reverse("staff_application_decide", args=[application.pk]) not in html
    assert (
        f'<p class="notice" role="status">Approved {pending_user.email}: they are e-mailed'
    ) in html
    assert "hx-swap-oob" not in html
    # Nothing is left over for the top of the next page.
    queue = staff_client.get(reverse("staff_applications")).content.decode()
    assert f"Approved {pending_user.email}:" not in queue


def test_a_refused_decision_with_htmx_shows_the_error_in_the_card(staff_client, pending_user):
    application = pending_user.applications.get()
    response = staff_client.post(
        reverse("staff_application_decide", args=[application.pk]), {"decision": "x"}, **HTMX
    )
    html = response.content.decode()
    assert html.lstrip().startswith(
        f'<article class="card application pending" id="application-{application.pk}"'
    )
    assert '<ul class="errorlist" role="alert"><li>Choose approve or reject.</li></ul>' in html


def test_approving_without_htmx_confirms_with_a_message(staff_client, pending_user, commit):
    application = pending_user.applications.get()
    with commit():
        response = staff_client.post(
            reverse("staff_application_decide", args=[application.pk]),
            {"decision": "approve", "note": ""},
            follow=True,
        )
    assert f"Approved {pending_user.email}" in response.content.decode()


def test_reject_asks_for_confirmation_first_without_js(staff_client, pending_user, commit):
    application = pending_user.applications.get()
    url = reverse("staff_application_decide", args=[application.pk])
    asked = staff_client.post(url, {"decision": "reject", "note": "Too vague."})
    assert asked.status_code == 200
    html = asked.content.decode()
    assert f"Reject the application of {pending_user.email}?" in html
    assert '<input type="hidden" name="confirmed" value="true">' in html
    assert ">Too vague.</textarea>" in html
    pending_user.refresh_from_db()
    assert pending_user.status == UserStatus.PENDING

    with commit():
        done = staff_client.post(
            url, {"decision": "reject", "note": "Too vague.", "confirmed": "true"}, follow=True
        )
    assert f"Rejected the application of {pending_user.email}" in done.content.decode()
    pending_user.refresh_from_db()
    assert pending_user.status == UserStatus.REJECTED


def test_unconfirmed_reject_over_htmx_puts_the_question_in_the_applications_place(
    staff_client, pending_user
):
    application = pending_user.applications.get()
    response = staff_client.post(
        reverse("staff_application_decide", args=[application.pk]),
        {"decision": "reject", "note": ""},
        **HTMX,
    )
    assert response["HX-Retarget"] == f"#application-{application.pk}"
    assert (
        response.content.decode()
        .lstrip()
        .startswith(f'<article class="card" id="application-{application.pk}">')
    )
    pending_user.refresh_from_db()
    assert pending_user.status == UserStatus.PENDING


def test_suspend_and_reactivate(staff_client, staff_user, api_key, api_secret, approved_user):
    url = reverse("staff_user_status", args=[approved_user.pk])
    response = staff_client.post(url, {"action": "suspend", "note": "abuse report"})
    assert response.status_code == 302
    with pytest.raises(AuthError) as error:
        api_key_authenticate(f"Bearer {api_secret}")
    assert error.value.code == "account_suspended"
    row = AuditLog.objects.get(action="user.suspend")
    assert (row.actor, row.note) == (staff_user, "abuse report")
    assert (row.before["status"], row.after["status"]) == ("approved", "suspended")

    staff_client.post(url, {"action": "reactivate"})
    assert api_key_authenticate(f"Bearer {api_secret}").pk == api_key.pk
    assert AuditLog.objects.filter(action="user.reactivate", actor=staff_user).exists()


def test_suspending_a_pending_account_is_refused_clearly(staff_client, pending_user):
    response = staff_client.post(
        reverse("staff_user_status", args=[pending_user.pk]), {"action": "suspend"}
    )
    assert response.status_code == 200
    assert "only approved accounts can become suspended" in response.content.decode()
    pending_user.refresh_from_db()
    assert pending_user.status == UserStatus.PENDING


def account_budgets(user, **changed) -> dict:
    """The account budget form's fields as `user` has them, with `changed`."""
    fields = {window.limit: getattr(user, window.limit) for window in of_scope(ACCOUNT)}
    return {**fields, **changed}


def test_staff_sets_account_budget_audited(staff_client, staff_user, approved_user):
    response = staff_client.post(
        reverse("staff_user_budget", args=[approved_user.pk]),
        {"monthly_token_budget": 123, "monthly_activation_quota": 7, "monthly_harvest_quota": 2},
    )
    assert response.status_code == 302
    approved_user.refresh_from_db()
    assert approved_user.monthly_token_budget == 123
    assert (approved_user.monthly_activation_quota, approved_user.monthly_harvest_quota) == (7, 2)
    row = AuditLog.objects.get(action="user.budget_set")
    assert row.actor == staff_user
    assert row.after == {
        "monthly_token_budget": 123,
        "monthly_activation_quota": 7,
        "monthly_harvest_quota": 2,
    }
    assert row.before["monthly_token_budget"] != 123


def test_staff_may_set_key_budget_beyond_account_budget(staff_client, staff_user, api_key):
    cap = api_key.user.monthly_token_budget
    data = {
        "monthly_token_budget": cap * 2,
        "daily_token_budget": 10,
        "monthly_input_budget": "",
        "monthly_output_budget": "",
        "monthly_activation_quota": 3,
        "monthly_harvest_quota": 0,
    }
    prefix = f"staff-budget-{api_key.pk}"
    response = staff_client.post(
        reverse("staff_key_budget", args=[api_key.pk]),
        {f"{prefix}-{k}": v for k, v in data.items()},
    )
    assert response.status_code == 302
    api_key.refresh_from_db()
    assert api_key.monthly_token_budget == cap * 2
    assert api_key.monthly_activation_quota == 3
    row = AuditLog.objects.get(action="key.budget_set")
    assert row.actor == staff_user
    assert row.after["monthly_harvest_quota"] == 0


def test_staff_key_budget_form_errors_show_on_the_user_page(staff_client, api_key):
    prefix = f"staff-budget-{api_key.pk}"
    response = staff_client.post(
        reverse("staff_key_budget", args=[api_key.pk]), {f"{prefix}-daily_token_budget": "x"}
    )
    assert response.status_code == 200
    form = response.context["rows"][0]["budget_form"]
    assert "daily_token_budget" in form.errors


def test_staff_revoking_a_key_is_asked_first_then_confirmed_and_audited(
    staff_client, staff_user, api_key
):
    url = reverse("staff_key_status", args=[api_key.pk])
    asked = staff_client.post(url, {"action": "revoke"})
    assert asked.status_code == 200
    html = asked.content.decode()
    assert f"Revoke “first key” of {api_key.user.email}?" in html
    assert '<input type="hidden" name="confirmed" value="true">' in html
    api_key.refresh_from_db()
    assert api_key.status == "active"
    assert not AuditLog.objects.filter(action="key.revoke").exists()

    done = staff_client.post(url, {"action": "revoke", "confirmed": "true"}, follow=True)
    api_key.refresh_from_db()
    assert api_key.status == "revoked"
    assert AuditLog.objects.get(action="key.revoke").actor == staff_user
    assert (
        f"Revoked “first key” (acs-{api_key.prefix}-…) of {api_key.user.email}."
        in done.content.decode()
    )


def test_staff_pausing_a_key_is_not_asked_and_confirmed(staff_client, api_key):
    response = staff_client.post(
        reverse("staff_key_status", args=[api_key.pk]), {"action": "disable"}, follow=True
    )
    api_key.refresh_from_db()
    assert api_key.status == "disabled"
    assert f"Paused “first key” (acs-{api_key.prefix}-…)" in response.content.decode()


def test_user_list_search_and_status_filter(staff_client, approved_user, pending_user):
    html = staff_client.get(reverse("staff_users"), {"q": "ada"}).content.decode()
    assert approved_user.email in html
    assert pending_user.email not in html
    html = staff_client.get(reverse("staff_users"), {"status": "pending"}).content.decode()
    assert pending_user.email in html
    assert approved_user.email not in html


def test_user_detail_shows_applications_keys_and_audit(staff_client, pending_user, commit):
    with commit():
        staff_client.post(
            reverse("staff_application_decide", args=[pending_user.applications.get().pk]),
            {"decision": "approve"},
        )
    html = staff_client.get(reverse("staff_user_detail", args=[pending_user.pk])).content.decode()
    assert "Probing truthfulness directions." in html
    assert "Default key" in html
    assert "user.approve" in html
    assert "acs-" in html and "Key, today (tokens)" in html


def test_audit_log_filters(staff_client, staff_user, approved_user, api_key):
    staff_client.post(
        reverse("staff_user_budget", args=[approved_user.pk]),
        account_budgets(approved_user, monthly_token_budget=5),
    )
    page = staff_client.get(reverse("staff_audit"), {"action": "user."})
    rows = list(page.context["page"])
    assert [r.action for r in rows] == ["user.budget_set"]
    rows = list(staff_client.get(reverse("staff_audit"), {"actor": "staff@"}).context["page"])
    assert {r.actor for r in rows} == {staff_user}
    rows = list(
        staff_client.get(reverse("staff_audit"), {"target": api_key.prefix}).context["page"]
    )
    assert [r.action for r in rows] == ["key.create"]


def test_the_audit_log_shows_each_changed_field_as_before_arrow_after(
    staff_client, approved_user, api_key
):
    prefix = f"staff-budget-{api_key.pk}"
    budgets = {
        "monthly_token_budget": api_key.monthly_token_budget,
        "daily_token_budget": 2_500,
        "monthly_input_budget": 40_000,
        "monthly_output_budget": "",
        "monthly_activation_quota": api_key.monthly_activation_quota,
        "monthly_harvest_quota": api_key.monthly_harvest_quota,
    }
    staff_client.post(
        reverse("staff_key_budget", args=[api_key.pk]),
        {f"{prefix}-{name}": value for name, value in budgets.items()},
    )
    html = staff_client.get(reverse("staff_audit"), {"action": "key.budget_set"}).content.decode()
    row = html.split('<table class="audit">', 1)[1].split("</table>", 1)[0]
    daily = f"{api_key.daily_token_budget:,}"
    assert f"<li><code>daily_token_budget</code>: {daily} → 2,500</li>" in row
    assert "<li><code>monthly_input_budget</code>: none → 40,000</li>" in row
    # Unchanged budgets are not listed; no Python dict reprs.
    assert "monthly_token_budget" not in row and "monthly_output_budget" not in row
    assert "{&#x27;" not in row and "{'" not in row


def test_audit_changes_of_a_creation_list_the_new_values_under_dotted_names(api_key):
    row = AuditLog.objects.get(action="key.create")
    changes = {field: (before, after) for field, before, after in row.changes()}
    assert changes["name"] == ("—", "first key")
    assert changes["budgets.daily_token_budget"] == ("—", f"{api_key.daily_token_budget:,}")
    assert changes["budgets.monthly_input_budget"] == ("—", "none")


def test_an_audit_row_that_changed_nothing_says_so(staff_client, approved_user):
    budget = approved_user.monthly_token_budget
    staff_client.post(
        reverse("staff_user_budget", args=[approved_user.pk]),
        account_budgets(approved_user, monthly_token_budget=budget),
    )
    row = AuditLog.objects.get(action="user.budget_set")
    assert row.changes() == []
    html = staff_client.get(reverse("staff_audit"), {"action": "user."}).content.decode()
    assert '<span class="help">no change</span>' in html


def test_spend_cap_switch(staff_client, staff_user):
    response = staff_client.post(
        reverse("staff_spend_cap"), {"paused": "on", "reason": "monthly bill reached"}
    )
    assert response.status_code == 302
    current = ServiceSettings.current()
    assert current.spend_cap_paused
    assert current.spend_cap_reason == "monthly bill reached"
    assert AuditLog.objects.get(action="service.spend_cap").actor == staff_user
    assert "paused" in staff_client.get(reverse("staff_spend_cap")).content.decode()
    staff_client.post(reverse("staff_spend_cap"), {"reason": ""})
    assert not ServiceSettings.current().spend_cap_paused


def test_staff_see_the_accounts_quotas_and_each_keys_on_the_users_page(
    staff_client, approved_user, api_key
):
    html = staff_client.get(reverse("staff_user_detail", args=[approved_user.pk])).content
    html = html.decode()
    for label in (
        "Account activation requests, this month",
        "Account harvest jobs, this month",
        "Activation requests, this month",
        "Harvest jobs, this month",
    ):
        assert label in html, label
