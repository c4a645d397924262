"""The Jobs page loads plotly.js only when it may draw: a finished harvest's chart, or an
active job whose next poll may bring one."""

import pytest

from api.jobs.models import HarvestJob
from api.jobs.services import harvests
from infra.lifecycle import WorkStatus
from tests.conftest import PASSWORD

from .test_jobs_page import _harvest

PLOTLY = "vendor/plotly-acs-"


@pytest.fixture
def logged_in(client, approved_user):
    client.login(email=approved_user.email, password=PASSWORD)
    return client


@pytest.mark.django_db
def test_a_page_without_charts_does_not_load_plotly(logged_in):
    html = logged_in.get("/jobs/").content.decode()
    assert "No harvest jobs yet." in html
    assert PLOTLY not in html


@pytest.mark.django_db
def test_a_page_with_an_active_harvest_loads_plotly(logged_in, api_key):
    job = _harvest(api_key)
    HarvestJob.objects.filter(pk=job.pk).update(status=WorkStatus.RUNNING)
    assert PLOTLY in logged_in.get("/jobs/").content.decode()


@pytest.mark.django_db
def test_a_page_with_only_a_cancelled_harvest_does_not_load_plotly(logged_in, api_key):
    job = _harvest(api_key)
    harvests.harvest_job_cancel(job=job)
    assert PLOTLY not in logged_in.get("/jobs/").content.decode()
