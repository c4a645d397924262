"""The API keys page: create (secret shown once), rename, pause, resume, revoke, budgets;
htmx partials and plain POST + redirect; other users' keys are 404."""

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from accounts.models import ApiKey, AuditLog, KeyStatus
from accounts.services.auth import AuthError, api_key_authenticate
from accounts.services.keys import api_key_create, api_key_revoke

from .support import HTMX, logged_in, secrets_in


def refusal(secret):
    with pytest.raises(AuthError) as error:
        api_key_authenticate(f"Bearer {secret}")
    return error.value.code


def test_keys_page_is_full_page_without_htmx_and_partial_with_it(approved_client, api_key):
    full = approved_client.get(reverse("keys")).content.decode()
    partial = approved_client.get(reverse("keys"), **HTMX).content.decode()
    assert full.lstrip().lower().startswith("<!doctype html>")
    assert 'id="key-list"' in full
    assert partial.lstrip().startswith('<div id="key-list">')
    assert "<html" not in partial
    assert f"acs-{api_key.prefix}" in partial


def test_create_key_without_js_redirects_and_shows_secret_once(approved_client, approved_user):
    response = approved_client.post(reverse("keys"), {"name": "laptop"})
    assert response.status_code == 302
    assert response["Location"] == reverse("keys")
    key = ApiKey.objects.get(user=approved_user, name="laptop")
    page = approved_client.get(reverse("keys")).content.decode()
    [secret] = secrets_in(page)
    assert secret.startswith(f"acs-{key.prefix}-")
    assert 'data-copy="secret-' in page
    assert secrets_in(approved_client.get(reverse("keys")).content.decode()) == []
    assert api_key_authenticate(f"Bearer {secret}").pk == key.pk
    assert AuditLog.objects.filter(action="key.create", actor=approved_user).exists()


def test_create_key_with_htmx_returns_partial_with_the_secret(approved_client, approved_user):
    response = approved_client.post(reverse("keys"), {"name": "cluster"}, **HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" not in html
    [secret] = secrets_in(html)
    assert api_key_authenticate(f"Bearer {secret}").name == "cluster"
    assert secrets_in(approved_client.get(reverse("keys")).content.decode()) == []


def test_create_key_without_name_shows_error_next_to_the_field(approved_client):
    response = approved_client.post(reverse("keys"), {"name": ""}, **HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    block = html.split('name="name"', 1)[1].split('<div class="field', 1)[0]
    assert "This field is required" in block
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize("htmx", [False, True])
def test_pause_and_resume_key(approved_client, api_key, api_secret, approved_user, htmx):
    headers = HTMX if htmx else {}
    response = approved_client.post(reverse("key_disable", args=[api_key.pk]), **headers)
    assert response.status_code == (200 if htmx else 302)
    assert refusal(api_secret) == "key_disabled"
    if htmx:
        assert "Resume" in response.content.decode()
    approved_client.post(reverse("key_enable", args=[api_key.pk]), **headers)
    assert api_key_authenticate(f"Bearer {api_secret}").pk == api_key.pk
    actions = list(
        AuditLog.objects.filter(actor=approved_user, target_id=str(api_key.pk))
        .order_by("id")
        .values_list("action", "before", "after")
    )
    assert actions[-2:] == [
        ("key.disable", {"status": "active"}, {"status": "disabled"}),
        ("key.enable", {"status": "disabled"}, {"status": "active"}),
    ]


def test_resuming_an_active_key_is_an_error_not_a_crash(approved_client, api_key):
    response = approved_client.post(reverse("key_enable", args=[api_key.pk]), **HTMX)
    assert response.status_code == 200
    assert "cannot be changed" in response.content.decode()


def test_revoke_needs_confirmation_without_js_and_is_permanent(
    approved_client, api_key, api_secret
):
    confirm = approved_client.get(reverse("key_revoke", args=[api_key.pk]))
    assert confirm.status_code == 200
    assert "permanent" in confirm.content.decode()
    api_key.refresh_from_db()
    assert api_key.status == KeyStatus.ACTIVE

    response = approved_client.post(reverse("key_revoke", args=[api_key.pk]))
    assert response.status_code == 302
    assert refusal(api_secret) == "key_revoked"
    again = approved_client.post(reverse("key_enable", args=[api_key.pk]), **HTMX)
    assert "cannot be changed" in again.content.decode()
    assert refusal(api_secret) == "key_revoked"


def test_revoke_with_htmx_answers_the_keys_card_in_place_with_the_confirmation(
    approved_client, api_key
):
    other, _ = api_key_create(user=api_key.user, name="second key", acting_user=None)
    page = approved_client.get(reverse("keys")).content.decode()
    assert f'hx-target="#key-{api_key.pk}"' in page.split(f'id="key-{api_key.pk}"', 1)[1]
    response = approved_client.post(reverse("key_revoke", args=[api_key.pk]), **HTMX)
    html = response.content.decode()
    # The card alone, for its own place: the list puts revoked keys last, away from the click.
    assert html.lstrip().startswith(f'<article class="card key" id="key-{api_key.pk}"')
    assert html.count("<article") == 1 and "second key" not in html
    assert '<span class="badge revoked">Revoked</span>' in html
    assert (
        '<p class="notice" role="status">Revoked “first key” '
        f"(acs-{api_key.prefix}-…): programs using it now get key_revoked.</p>"
    ) in html
    assert AuditLog.objects.filter(action="key.revoke", target_id=str(api_key.pk)).exists()
    reloaded = approved_client.get(reverse("keys")).content.decode()
    assert reloaded.index(f'id="key-{other.pk}"') < reloaded.index(f'id="key-{api_key.pk}"')
    assert 'class="notice"' not in reloaded


def test_a_refused_status_change_with_htmx_shows_the_error_in_the_card(approved_client, api_key):
    response = approved_client.post(reverse("key_enable", args=[api_key.pk]), **HTMX)
    html = response.content.decode()
    assert html.lstrip().startswith(f'<article class="card key" id="key-{api_key.pk}"')
    assert '<ul class="errorlist" role="alert"><li>' in html and "cannot be changed" in html


def test_revoke_without_js_confirms_at_the_top_of_the_page(approved_client, api_key):
    response = approved_client.post(reverse("key_revoke", args=[api_key.pk]), follow=True)
    html = response.content.decode()
    messages = html.split('<div id="messages"', 1)[1].split("</div>", 1)[0]
    assert f"Revoked “first key” (acs-{api_key.prefix}-…)" in messages
    assert 'class="notice"' not in html


def test_rename_key(approved_client, api_key):
    response = approved_client.post(
        reverse("key_rename", args=[api_key.pk]), {f"rename-{api_key.pk}-name": "renamed"}, **HTMX
    )
    assert "renamed" in response.content.decode()
    api_key.refresh_from_db()
    assert api_key.name == "renamed"
    row = AuditLog.objects.get(action="key.rename")
    assert (row.before, row.after) == ({"name": "first key"}, {"name": "renamed"})


@pytest.mark.parametrize("name", ["key_rename", "key_budget", "key_disable", "key_enable"])
def test_another_users_key_is_404(other_user, api_key, name):
    response = logged_in(other_user).post(reverse(name, args=[api_key.pk]), {})
    assert response.status_code == 404


def test_another_users_key_revoke_is_404(other_user, api_key):
    client = logged_in(other_user)
    assert client.get(reverse("key_revoke", args=[api_key.pk])).status_code == 404
    assert client.post(reverse("key_revoke", args=[api_key.pk])).status_code == 404
    api_key.refresh_from_db()
    assert api_key.status == KeyStatus.ACTIVE


def test_keys_page_refuses_accounts_that_are_not_approved(pending_user, suspended_user):
    for user in (pending_user, suspended_user):
        response = logged_in(user).get(reverse("keys"))
        assert response.status_code == 403
        assert "approved accounts" in response.content.decode()


def test_keys_page_needs_login(db):
    from django.test import Client

    response = Client().get(reverse("keys"))
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


def budget_post(key, **values):
    data = {
        "monthly_token_budget": key.monthly_token_budget,
        "daily_token_budget": key.daily_token_budget,
        "monthly_input_budget": "",
        "monthly_output_budget": "",
        **values,
    }
    return {f"budget-{key.pk}-{name}": value for name, value in data.items()}


def test_user_sets_key_budget_within_account_budget(approved_client, api_key, approved_user):
    cap = approved_user.monthly_token_budget
    response = approved_client.post(
        reverse("key_budget", args=[api_key.pk]),
        budget_post(
            api_key, monthly_token_budget=cap, daily_token_budget=1000, monthly_output_budget=500
        ),
    )
    assert response.status_code == 302
    api_key.refresh_from_db()
    assert (api_key.monthly_token_budget, api_key.daily_token_budget) == (cap, 1000)
    assert api_key.monthly_output_budget == 500
    row = AuditLog.objects.get(action="key.budget_set")
    assert row.actor == approved_user
    assert row.before["daily_token_budget"] != 1000
    assert row.after["daily_token_budget"] == 1000


@pytest.mark.parametrize("htmx", [False, True])
def test_saving_key_budgets_confirms_it(approved_client, api_key, htmx):
    response = approved_client.post(
        reverse("key_budget", args=[api_key.pk]),
        budget_post(api_key, daily_token_budget=1234),
        follow=not htmx,
        **(HTMX if htmx else {}),
    )
    html = response.content.decode()
    api_key.refresh_from_db()
    assert api_key.daily_token_budget == 1234
    if htmx:
        # Where the button that saved them was: above it, the budgets still open.
        card = html.split(f'id="key-{api_key.pk}"', 1)[1].split("</article>", 1)[0]
        budgets = card.split("<details open>\n          <summary>Budgets</summary>", 1)[1]
        form = budgets.split("</form>", 1)[0]
        assert form.index(
            '<p class="notice" role="status">Budgets of “first key” saved.</p>'
        ) < form.index("Save budgets</button>")
    else:
        messages = html.split('<div id="messages"', 1)[1].split("</div>", 1)[0]
        assert "Budgets of “first key” saved." in messages


def test_key_budget_above_account_budget_is_a_field_error(approved_client, api_key, approved_user):
    before = api_key.monthly_token_budget
    response = approved_client.post(
        reverse("key_budget", args=[api_key.pk]),
        budget_post(api_key, monthly_token_budget=approved_user.monthly_token_budget + 1),
        **HTMX,
    )
    assert response.status_code == 200
    html = response.content.decode()
    field = f'name="budget-{api_key.pk}-monthly_token_budget"'
    block = html.split(field, 1)[1].split('<div class="field', 1)[0]
    assert "At most your account" in block
    api_key.refresh_from_db()
    assert api_key.monthly_token_budget == before
    assert not AuditLog.objects.filter(action="key.budget_set").exists()


def test_negative_budget_is_a_field_error(approved_client, api_key):
    response = approved_client.post(
        reverse("key_budget", args=[api_key.pk]), budget_post(api_key, daily_token_budget=-5)
    )
    assert response.status_code == 200
    assert response.context["rows"][0]["budget_form"].errors["daily_token_budget"]


def test_daily_budget_above_the_keys_monthly_budget_is_a_field_error(approved_client, api_key):
    before = (api_key.monthly_token_budget, api_key.daily_token_budget)
    response = approved_client.post(
        reverse("key_budget", args=[api_key.pk]),
        budget_post(
            api_key,
            monthly_token_budget=50_000,
            daily_token_budget=60_000,
            monthly_output_budget=70_000,
        ),
    )
    assert response.status_code == 200
    errors = response.context["rows"][0]["budget_form"].errors
    assert errors["daily_token_budget"] == ["At most the key's monthly budget (50,000 tokens)."]
    assert errors["monthly_output_budget"] == ["At most the key's monthly budget (50,000 tokens)."]
    api_key.refresh_from_db()
    assert (api_key.monthly_token_budget, api_key.daily_token_budget) == before


def test_playground_key_is_managed_pausable_but_not_renamable_or_revocable(
    approved_client, approved_user
):
    key, _ = api_key_create(
        user=approved_user, name="Playground", acting_user=None, is_playground=True
    )
    page = approved_client.get(reverse("keys")).content.decode()
    assert "managed" in page
    assert reverse("key_revoke", args=[key.pk]) not in page
    assert reverse("key_rename", args=[key.pk]) not in page
    assert approved_client.post(reverse("key_revoke", args=[key.pk])).status_code == 403
    assert (
        approved_client.post(
            reverse("key_rename", args=[key.pk]), {f"rename-{key.pk}-name": "x"}
        ).status_code
        == 403
    )
    assert approved_client.post(reverse("key_disable", args=[key.pk])).status_code == 302
    key.refresh_from_db()
    assert (key.name, key.status) == ("Playground", KeyStatus.DISABLED)


def test_keys_page_shows_budget_panel_per_key(approved_client, api_key):
    html = approved_client.get(reverse("keys")).content.decode()
    assert "Key, this month (tokens)" in html
    assert "Account, this month (tokens)" in html
    assert "UTC" in html


@pytest.mark.parametrize("htmx", [False, True])
def test_keys_beyond_the_accounts_cap_are_refused_with_a_clear_message(
    approved_client, approved_user, settings, htmx
):
    settings.ACS_MAX_KEYS_PER_ACCOUNT = 2
    for name in ("one", "two"):
        api_key_create(user=approved_user, name=name, acting_user=approved_user)
    response = approved_client.post(reverse("keys"), {"name": "three"}, **(HTMX if htmx else {}))
    assert response.status_code == 200
    html = response.content.decode()
    assert ("<html" in html) is not htmx
    assert "This account holds 2 keys, the most it may (2)" in html
    assert set(ApiKey.objects.values_list("name", flat=True)) == {"one", "two"}


def test_revoked_and_playground_keys_leave_room_and_staff_can_raise_the_cap(
    approved_user, settings
):
    settings.ACS_MAX_KEYS_PER_ACCOUNT = 1
    api_key_create(user=approved_user, name="playground", acting_user=None, is_playground=True)
    first, _ = api_key_create(user=approved_user, name="one", acting_user=None)
    with pytest.raises(ValidationError):
        api_key_create(user=approved_user, name="two", acting_user=None)
    api_key_revoke(key=first, acting_user=approved_user)
    api_key_create(user=approved_user, name="two", acting_user=None)
    approved_user.key_limit = 2
    approved_user.save()
    api_key_create(user=approved_user, name="three", acting_user=None)
