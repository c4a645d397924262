"""Portal services: the one-time secret reveal, budget validation, and races on
PostgreSQL with real concurrent connections."""

import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from accounts.models import AccessApplication, ApiKey, AuditLog, User, UserStatus
from accounts.services.applications import application_approve
from accounts.services.keys import api_key_create, api_key_reveal_store, api_key_reveals_take
from metering import windows
from metering.forms import account_budget_form, key_budget_form
from metering.limits import api_key_budget_set, user_budget_set


def run_concurrently(count, work):
    """Run `work()` in `count` threads (each on its own database connection) at once and
    return what each returned or raised."""
    barrier = threading.Barrier(count)
    results = [None] * count

    def worker(index):
        try:
            barrier.wait()
            results[index] = work()
        except Exception as error:  # the test inspects what was raised
            results[index] = error
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_reveal_is_stored_encrypted_and_taken_once(approved_user):
    key, secret = api_key_create(user=approved_user, name="k", acting_user=None)
    api_key_reveal_store(key=key, secret=secret)
    stored = ApiKey.objects.get(pk=key.pk).pending_reveal
    assert stored and secret not in stored and key.prefix not in stored
    assert [(k.pk, s) for k, s in api_key_reveals_take(user=approved_user)] == [(key.pk, secret)]
    assert api_key_reveals_take(user=approved_user) == []


def test_reveal_that_cannot_be_decrypted_is_cleared_without_a_secret(approved_user):
    key, _ = api_key_create(user=approved_user, name="k", acting_user=None)
    ApiKey.objects.filter(pk=key.pk).update(pending_reveal="garbage")
    [(taken, secret)] = api_key_reveals_take(user=approved_user)
    assert (taken.pk, secret) == (key.pk, None)
    assert ApiKey.objects.get(pk=key.pk).pending_reveal == ""


def test_owner_cannot_raise_staff_quotas(approved_user, api_key):
    with pytest.raises(ValidationError) as error:
        api_key_budget_set(
            key=api_key, acting_user=approved_user, budgets={"monthly_harvest_quota": 10**6}
        )
    assert "monthly_harvest_quota" in error.value.message_dict


@pytest.mark.parametrize("acting", ["owner", "staff", "system"])
def test_an_unknown_budget_is_a_validation_error_naming_it(
    approved_user, staff_user, api_key, acting
):
    actor = {"owner": approved_user, "staff": staff_user, "system": None}[acting]
    with pytest.raises(ValidationError) as error:
        api_key_budget_set(key=api_key, acting_user=actor, budgets={"hourly_budget": 5})
    assert error.value.messages == [
        "Unknown budget hourly_budget; the budgets are monthly_token_budget,"
        " daily_token_budget, monthly_input_budget, monthly_output_budget,"
        " monthly_activation_quota, monthly_harvest_quota."
    ]
    with pytest.raises(ValidationError) as error:
        user_budget_set(user=approved_user, acting_user=actor, budgets={"daily_token_budget": 5})
    assert error.value.messages == [
        "Unknown budget daily_token_budget; the budgets are monthly_token_budget,"
        " monthly_activation_quota, monthly_harvest_quota."
    ]
    assert not AuditLog.objects.filter(action__endswith="budget_set").exists()


def test_budget_forms_have_a_field_per_window_that_their_reader_may_set(api_key):
    key_windows = [w for w in windows.WINDOWS if w.scope == windows.KEY]
    assert list(key_budget_form(api_key).fields) == [
        "monthly_token_budget",
        "daily_token_budget",
        "monthly_input_budget",
        "monthly_output_budget",
    ]
    assert list(key_budget_form(api_key, staff=True).fields) == [w.limit for w in key_windows]
    assert list(account_budget_form(api_key.user).fields) == [
        "monthly_token_budget",
        "monthly_activation_quota",
        "monthly_harvest_quota",
    ]
    optional = {
        name for name, field in key_budget_form(api_key).fields.items() if not field.required
    }
    assert optional == {"monthly_input_budget", "monthly_output_budget"}


@pytest.mark.django_db(transaction=True)
def test_concurrent_page_loads_show_a_secret_exactly_once():
    user = User.objects.create_user("race@example.org", "pw", status=UserStatus.APPROVED)
    key, secret = api_key_create(user=user, name="k", acting_user=None)
    api_key_reveal_store(key=key, secret=secret)
    results = run_concurrently(8, lambda: api_key_reveals_take(user=user))
    shown = [s for result in results for _, s in result]
    assert shown == [secret]


@pytest.mark.django_db(transaction=True)
def test_concurrent_approvals_of_one_application_create_one_key():
    staff = User.objects.create_user("boss@example.org", "pw", is_staff=True)
    user = User.objects.create_user("race@example.org", "pw")
    application = AccessApplication.objects.create(
        user=user, planned_use="x", accepted_usage_rules=True
    )
    results = run_concurrently(
        6, lambda: application_approve(application=application, acting_user=staff)
    )
    assert sum(isinstance(r, AccessApplication) for r in results) == 1
    assert all(isinstance(r, (AccessApplication, ValidationError)) for r in results)
    assert ApiKey.objects.filter(user=user).count() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_key_creations_never_pass_the_cap_together(approved_user, settings):
    """Eight threads create keys at once for an account with room for three (real
    PostgreSQL row locks): exactly three succeed."""
    settings.ACS_MAX_KEYS_PER_ACCOUNT = 3
    start = threading.Barrier(8)
    outcomes = []

    def create(index: int) -> None:
        try:
            start.wait()
            api_key_create(user=approved_user, name=f"key {index}", acting_user=None)
            outcomes.append("created")
        except ValidationError:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=create, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["created"] * 3 + ["refused"] * 5
    assert ApiKey.objects.filter(user=approved_user).count() == 3
