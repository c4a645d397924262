"""The portal's Jobs page: the user's jobs, in-place refresh while one is active, download
links, and the mean-norm chart of a finished harvest."""

import json

import pytest

from accounts.models import UserStatus
from api.jobs import services
from api.jobs.models import CompletionJob, CompletionJobStatus, HarvestJob, HarvestJobStatus
from tests.conftest import PASSWORD

BODY = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1}


@pytest.fixture
def logged_in(client, approved_user):
    client.login(email=approved_user.email, password=PASSWORD)
    return client


def _harvest(api_key, prompts=("Hello there.", "Residual streams.")):
    return services.harvest_job_submit(
        key=api_key,
        model="smollm2-135m",
        prompts=list(prompts),
        layers=[2, 4],
        add_special_tokens=True,
    )


@pytest.mark.django_db
def test_the_page_needs_an_approved_login(client, pending_user):
    assert client.get("/jobs/").status_code == 302
    client.login(email=pending_user.email, password=PASSWORD)
    assert pending_user.status == UserStatus.PENDING
    assert client.get("/jobs/").status_code == 403


@pytest.mark.django_db
def test_active_jobs_are_polled_in_place(logged_in, api_key):
    job = _harvest(api_key)
    HarvestJob.objects.filter(pk=job.pk).update(status=HarvestJobStatus.RUNNING, prompts_done=1)
    page = logged_in.get("/jobs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "<html" in html
    assert 'hx-trigger="every 2s"' in html
    assert '<progress value="1" max="2">' in html
    assert "Cancel" in html

    partial = logged_in.get("/jobs/", headers={"HX-Request": "true"})
    fragment = partial.content.decode()
    assert "<html" not in fragment
    assert fragment.lstrip().startswith('<div id="jobs"')
    assert 'hx-trigger="every 2s"' in fragment


@pytest.mark.django_db
def test_polling_stops_when_no_job_is_active(logged_in, api_key):
    job, _ = services.completion_job_submit(key=api_key, idempotency_key="k", payload=BODY)
    CompletionJob.objects.filter(pk=job.pk).update(
        status=CompletionJobStatus.FAILED,
        result_status=429,
        result_body={"error": {"code": "budget_exceeded", "message": "No budget <left>."}},
    )
    fragment = logged_in.get("/jobs/", headers={"HX-Request": "true"}).content.decode()
    assert "hx-trigger" not in fragment
    assert "budget_exceeded" in fragment
    assert "No budget &lt;left&gt;." in fragment


@pytest.mark.django_db
def test_other_users_jobs_are_not_listed(client, other_user, api_key):
    _harvest(api_key)
    client.login(email=other_user.email, password=PASSWORD)
    assert "No harvest jobs yet." in client.get("/jobs/").content.decode()


@pytest.mark.django_db
def test_cancel_from_the_page(logged_in, api_key):
    job = _harvest(api_key)
    response = logged_in.post(f"/jobs/harvest/{job.pk}/cancel", headers={"HX-Request": "true"})
    assert response.status_code == 200
    assert "Cancelled" in response.content.decode()
    job.refresh_from_db()
    assert job.status == HarvestJobStatus.CANCELLED


@pytest.mark.django_db
def test_completion_result_download_is_the_stored_body(logged_in, client, api_key, other_user):
    job, _ = services.completion_job_submit(key=api_key, idempotency_key="r", payload=BODY)
    assert logged_in.get(f"/jobs/completion/{job.pk}/result.json").status_code == 404
    CompletionJob.objects.filter(pk=job.pk).update(
        status=CompletionJobStatus.SUCCEEDED, result_status=200, result_body={"choices": []}
    )
    response = logged_in.get(f"/jobs/completion/{job.pk}/result.json")
    assert json.loads(response.content) == {"choices": []}
    assert "result.json" in logged_in.get("/jobs/").content.decode()
    client.logout()
    client.login(email=other_user.email, password=PASSWORD)
    assert client.get(f"/jobs/completion/{job.pk}/result.json").status_code == 404


@pytest.mark.django_db
def test_a_finished_harvest_has_download_links_and_a_norm_chart(
    logged_in, api_key, engine_model, redis_client
):
    job = _harvest(api_key)
    services.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == HarvestJobStatus.DONE, job.error
    page = logged_in.get("/jobs/")
    html = page.content.decode()
    assert f"/v1/harvest/{job.pk}/files/manifest.json?token=" in html
    assert f"/v1/harvest/{job.pk}/files/shard_00000.safetensors?token=" in html
    figure = page.context["figure"]
    assert figure["data"][0]["x"] == [2, 4]
    norms = figure["data"][0]["y"]
    assert len(norms) == 2 and all(value > 0 for value in norms)
    assert 'data-figure="harvest-norm-figure"' in html
