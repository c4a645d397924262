"""Django admin: every model is registered and its actions go through the services."""

import pytest
from django.contrib import admin
from django.urls import reverse

from accounts import models
from accounts.models import AuditLog, KeyStatus
from metering import models as metering_models

from .support import logged_in


@pytest.fixture
def superuser(staff_user):
    staff_user.is_superuser = True
    staff_user.save()
    return staff_user


MODELS = [
    models.User,
    models.AccessApplication,
    models.ApiKey,
    models.ServiceSettings,
    models.AuditLog,
    metering_models.UsagePeriod,
    metering_models.BudgetReservation,
    metering_models.UsageRecord,
    metering_models.UsageDaily,
]


@pytest.mark.parametrize("model", MODELS)
def test_every_model_has_a_working_changelist(superuser, api_key, model):
    assert admin.site.is_registered(model)
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    assert logged_in(superuser).get(url).status_code == 200


def test_admin_key_change_page_never_shows_hashes(superuser, api_key):
    url = reverse("admin:accounts_apikey_change", args=[api_key.pk])
    html = logged_in(superuser).get(url).content.decode()
    assert api_key.secret_hash not in html


def test_admin_actions_call_audited_services(superuser, pending_user, api_key, commit):
    client = logged_in(superuser)
    application = pending_user.applications.get()
    with commit():
        client.post(
            reverse("admin:accounts_accessapplication_changelist"),
            {"action": "approve", "_selected_action": [application.pk]},
        )
    pending_user.refresh_from_db()
    assert pending_user.status == "approved"
    client.post(
        reverse("admin:accounts_apikey_changelist"),
        {"action": "revoke", "_selected_action": [api_key.pk]},
    )
    api_key.refresh_from_db()
    assert api_key.status == KeyStatus.REVOKED
    actions = set(AuditLog.objects.filter(actor=superuser).values_list("action", flat=True))
    assert {"user.approve", "key.revoke"} <= actions
