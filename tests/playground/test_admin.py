"""Django admin for the playground's records: listed and shown to staff, never edited nor
added by hand (they are what the API answered and what workers recorded)."""

import uuid

import pytest
from django.test import Client
from django.urls import reverse

from infra.lifecycle import WorkStatus
from playground.models import Run, RunComparison, SteeringScore
from portal.models import JobKind, JobSubmission
from testsupport.second_factor import sign_in


@pytest.fixture
def superuser(staff_user):
    staff_user.is_superuser = True
    staff_user.save()
    return sign_in(Client(), staff_user)


@pytest.fixture
def records(approved_user):
    run_a, run_b = (
        Run.objects.create(user=approved_user, request={"prompt": "Hi"}, error_code=f"code-{n}")
        for n in "ab"
    )
    return [
        run_a,
        RunComparison.objects.create(
            user=approved_user, run_a=run_a, run_b=run_b, error_code="comparison-code"
        ),
        SteeringScore.objects.create(
            user=approved_user, group=uuid.uuid4(), error_code="score-code"
        ),
        JobSubmission.objects.create(
            user=approved_user, kind=JobKind.HARVEST, request={}, error_code="submission-code"
        ),
    ]


@pytest.mark.parametrize("index", range(4))
def test_each_record_is_listed_shown_and_not_editable(superuser, records, index):
    record = records[index]
    meta = record._meta
    changelist = superuser.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"))
    assert changelist.status_code == 200 and record.error_code in changelist.content.decode()
    change_url = reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[record.pk])
    page = superuser.get(change_url)
    assert page.status_code == 200 and record.error_code in page.content.decode()
    assert 'name="status"' not in page.content.decode(), "no field is editable"
    superuser.post(change_url, {"status": WorkStatus.SUCCEEDED, "error_code": "edited"})
    record.refresh_from_db()
    assert record.error_code != "edited" and record.status == WorkStatus.QUEUED
    add = superuser.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_add"))
    assert add.status_code == 403
