"""The portal's Jobs page: the user's jobs, in-place refresh while one is active, download
links, and the mean-norm chart of a finished harvest."""

import json
import re
import uuid
from datetime import timedelta

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from accounts.models import UserStatus
from api.jobs.models import CompletionJob, HarvestJob
from api.jobs.services import completion_jobs, harvests, statistics
from api.jobs.storage import STATS_NAME, Tensor, harvest_file_write, safetensors_bytes
from infra.lifecycle import WorkStatus
from portal.models import JobKind, JobSubmission
from tests.conftest import PASSWORD
from tests.playground.test_views import MODEL

HTMX = {"HTTP_HX_REQUEST": "true"}

BODY = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1}


@pytest.fixture
def logged_in(client, approved_user):
    client.login(email=approved_user.email, password=PASSWORD)
    return client


def _harvest(api_key, prompts=("Hello there.", "Residual streams.")):
    job, _ = harvests.harvest_job_submit(
        key=api_key,
        model="smollm2-135m",
        prompts=list(prompts),
        layers=[2, 4],
        add_special_tokens=True,
    )
    return job


@pytest.mark.django_db
def test_the_page_needs_an_approved_login(client, pending_user):
    assert client.get("/jobs/").status_code == 302
    client.login(email=pending_user.email, password=PASSWORD)
    assert pending_user.status == UserStatus.PENDING
    assert client.get("/jobs/").status_code == 403


@pytest.mark.django_db
def test_active_jobs_are_polled_in_place(logged_in, api_key):
    job = _harvest(api_key)
    HarvestJob.objects.filter(pk=job.pk).update(status=WorkStatus.RUNNING, prompts_done=1)
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
    job, _ = completion_jobs.completion_job_submit(key=api_key, idempotency_key="k", payload=BODY)
    CompletionJob.objects.filter(pk=job.pk).update(
        status=WorkStatus.FAILED,
        error_code="budget_exceeded",
        error_message="No budget <left>.",
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
    html = response.content.decode()
    assert "Cancelled" in html
    assert f"Harvest job {str(job.pk)[:8]} cancelled" in html  # the message, out of band
    job.refresh_from_db()
    assert job.status == WorkStatus.CANCELLED


@pytest.mark.django_db
def test_cancel_asks_first_with_js_and_on_its_own_page_without(logged_in, api_key):
    job = _harvest(api_key)
    url = f"/jobs/harvest/{job.pk}/cancel"
    page = logged_in.get("/jobs/").content.decode()
    assert f'href="{url}" hx-post="{url}"' in page
    assert f'hx-confirm="Cancel harvest job {str(job.pk)[:8]}?' in page

    confirmation = logged_in.get(url)
    assert confirmation.status_code == 200
    assert f'<form method="post" action="{url}">' in confirmation.content.decode()
    job.refresh_from_db()
    assert job.status == WorkStatus.QUEUED

    done = logged_in.post(url, follow=True)
    assert f"Harvest job {str(job.pk)[:8]} cancelled" in done.content.decode()
    job.refresh_from_db()
    assert job.status == WorkStatus.CANCELLED


@pytest.mark.django_db
def test_a_running_job_cancelled_from_the_page_is_followed_until_its_worker_stops(
    logged_in, api_key
):
    job = _harvest(api_key)
    lease = timezone.now() + timedelta(minutes=10)
    HarvestJob.objects.filter(pk=job.pk).update(status=WorkStatus.RUNNING, lease_expires_at=lease)
    html = logged_in.post(f"/jobs/harvest/{job.pk}/cancel", headers={"HX-Request": "true"})
    html = html.content.decode()
    assert "Cancelled" in html and "Stopping after its current batch" in html
    assert 'hx-trigger="every 2s"' in html  # the page keeps reading the job
    # The worker stops and keeps what it wrote: the page stops polling and lists it.
    stats = statistics.ActivationStats(n_layers=2, hidden_size=4)
    harvest_file_write(job.storage_prefix, "stats.safetensors", stats.safetensors())
    HarvestJob.objects.filter(pk=job.pk).update(
        lease_expires_at=None,
        files=["shard_00000.safetensors", "stats.safetensors", "manifest.json"],
    )
    html = logged_in.get("/jobs/").content.decode()
    assert "Stopping" not in html and 'hx-trigger="every' not in html
    assert "manifest.json</a>" in html


@pytest.mark.django_db
def test_a_pending_job_cancelled_is_not_followed(logged_in, api_key):
    job = _harvest(api_key)
    harvests.harvest_job_cancel(job=job)
    html = logged_in.get("/jobs/").content.decode()
    assert "Cancelled" in html and "Stopping" not in html and 'hx-trigger="every' not in html


@pytest.mark.django_db
def test_a_cancelled_job_lists_the_shards_it_wrote(logged_in, api_key):
    job = _harvest(api_key)
    harvests.harvest_job_cancel(job=job)
    stats = statistics.ActivationStats(n_layers=2, hidden_size=4)
    harvest_file_write(job.storage_prefix, "stats.safetensors", stats.safetensors())
    HarvestJob.objects.filter(pk=job.pk).update(
        prompts_done=1, files=["shard_00000.safetensors", "stats.safetensors", "manifest.json"]
    )
    html = logged_in.get("/jobs/").content.decode()
    assert "Cancelled" in html
    assert "manifest.json</a>" in html
    assert "shard 0</a>" in html


@pytest.mark.django_db
def test_completion_result_download_is_the_stored_body(logged_in, client, api_key, other_user):
    job, _ = completion_jobs.completion_job_submit(key=api_key, idempotency_key="r", payload=BODY)
    assert logged_in.get(f"/jobs/completion/{job.pk}/result.json").status_code == 404
    CompletionJob.objects.filter(pk=job.pk).update(
        status=WorkStatus.SUCCEEDED, result_status=200, result_body={"choices": []}
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
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.SUCCEEDED, job.error
    page = logged_in.get("/jobs/")
    html = page.content.decode()
    assert f"/v1/harvest/{job.pk}/files/manifest.json?token=" in html
    assert f"/v1/harvest/{job.pk}/files/shard_00000.safetensors?token=" in html
    figure = page.context["figure"]
    assert figure["data"][0]["x"] == [2, 4]
    norms = figure["data"][0]["y"]
    assert len(norms) == 2 and all(value > 0 for value in norms)
    assert 'data-figure="harvest-norm-figure"' in html


def _finished_harvest(api_key, norms):
    """A done harvest job with a stats file of these per-layer mean norms (no engine)."""
    job = _harvest(api_key)
    stats = {"norm_mean": Tensor.from_array(np.asarray(norms, dtype=np.float32))}
    harvest_file_write(job.storage_prefix, STATS_NAME, safetensors_bytes(stats))
    HarvestJob.objects.filter(pk=job.pk).update(
        status=WorkStatus.SUCCEEDED, prompts_done=2, files=[STATS_NAME]
    )
    return job


@pytest.mark.django_db
def test_the_plot_link_swaps_the_chart_in_and_scrolls_to_it_or_loads_the_page_at_it(
    logged_in, api_key
):
    older = _finished_harvest(api_key, [1.0, 2.0])
    newer = _finished_harvest(api_key, [3.0, 4.0])
    page = logged_in.get("/jobs/")
    html = page.content.decode()
    # The newest is plotted; the older one's link names the chart's place on the page,
    # which a browser without JS scrolls to, and htmx swaps the list and shows the chart.
    assert page.context["plotted"] == newer
    link = re.search(r'<a href="\?plot=' + str(older.pk) + r"[^>]*>plot</a>", html).group(0)
    assert f'href="?plot={older.pk}#harvest-norm-chart"' in link
    assert f'hx-get="?plot={older.pk}"' in link
    assert f'hx-push-url="?plot={older.pk}#harvest-norm-chart"' in link
    assert 'hx-swap="outerHTML show:#harvest-norm-chart:top"' in link
    assert 'id="harvest-norm-chart"' in html

    fragment = logged_in.get("/jobs/", {"plot": str(older.pk)}, **HTMX)
    assert fragment.content.decode().lstrip().startswith('<div id="jobs" hx-history="false"')
    assert fragment.context["figure"]["data"][0]["y"] == [1.0, 2.0]
    restored = logged_in.get(
        "/jobs/", {"plot": str(older.pk)}, **HTMX, HTTP_HX_HISTORY_RESTORE_REQUEST="true"
    )
    assert restored.content.decode().lstrip().lower().startswith("<!doctype html>")
    assert restored.context["plotted"] == older
    for response in (page, fragment, restored):
        assert "HX-Request" in response["Vary"]


# ---------------------------------------------------------------------------------------
# Submitting jobs from the page


@pytest.fixture
def model_list(monkeypatch):
    monkeypatch.setattr("portal.jobs_views.model_cards", lambda: [MODEL])


COMPLETION_POST = {
    "completion-model": "smollm2-135m",
    "completion-prompt": "Once upon a time",
    "completion-max_tokens": "4",
}
HARVEST_POST = {"harvest-model": "smollm2-135m", "harvest-layers": ["7", "15"]}


@pytest.mark.django_db
def test_the_page_offers_both_submit_forms(logged_in, model_list):
    html = logged_in.get("/jobs/").content.decode()
    assert 'hx-post="/jobs/completion/"' in html and 'action="/jobs/completion/"' in html
    assert 'hx-post="/jobs/harvest/"' in html and 'enctype="multipart/form-data"' in html
    assert 'name="harvest-layers" value="29"' in html


@pytest.mark.django_db
def test_a_completion_job_submitted_without_js_is_queued_and_listed(
    logged_in, approved_user, model_list
):
    response = logged_in.post("/jobs/completion/", COMPLETION_POST)
    assert response.status_code == 302 and response["Location"] == "/jobs/"
    submission = JobSubmission.objects.get(user=approved_user)
    assert submission.kind == JobKind.COMPLETION
    assert submission.request == {
        "model": "smollm2-135m",
        "prompt": "Once upon a time",
        "max_tokens": 4,
    }
    page = logged_in.get("/jobs/").content.decode()
    assert "Completion job" in page and "Queued" in page
    assert 'hx-trigger="every 2s"' in page  # polled until it is sent


@pytest.mark.django_db
def test_a_harvest_submitted_with_htmx_answers_the_list_and_fresh_forms(
    logged_in, approved_user, model_list
):
    upload = SimpleUploadedFile("prompts.txt", b"first prompt\nsecond prompt\n")
    response = logged_in.post(
        "/jobs/harvest/", {**HARVEST_POST, "harvest-prompts_file": upload}, **HTMX
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="jobs"')
    assert "Harvest job" in html
    assert '<section id="job-forms" class="grid" hx-swap-oob="true">' in html
    submission = JobSubmission.objects.get(user=approved_user)
    assert submission.request["prompts"] == ["first prompt", "second prompt"]
    assert submission.request["layers"] == [7, 15]


@pytest.mark.django_db
@pytest.mark.parametrize("htmx", [False, True])
def test_a_harvest_is_sent_with_exactly_the_layers_ticked(
    logged_in, approved_user, model_list, htmx
):
    page = logged_in.get("/jobs/").content.decode()
    boxes = re.findall(r'<input[^>]*name="harvest-layers"[^>]*>', page)
    assert len(boxes) == 30 and not any("checked" in box for box in boxes)
    logged_in.post(
        "/jobs/harvest/",
        {**HARVEST_POST, "harvest-layers": ["0", "12", "29"], "harvest-prompts": "a"},
        **(HTMX if htmx else {}),
    )
    submission = JobSubmission.objects.get(user=approved_user)
    assert submission.request["layers"] == [0, 12, 29]


@pytest.mark.parametrize("headers", [{}, HTMX], ids=["plain", "htmx"])
@pytest.mark.parametrize(
    ("name", "content"),
    [("prompts.txt", b"first prompt\nsecond\x00prompt\n"), ("p.jsonl", b'"ok"\n"a\\u0000b"\n')],
)
def test_a_prompts_file_with_a_nul_is_a_field_error_not_a_500(
    logged_in, approved_user, model_list, name, content, headers
):
    upload = SimpleUploadedFile(name, content)
    response = logged_in.post(
        "/jobs/harvest/", {**HARVEST_POST, "harvest-prompts_file": upload}, **headers
    )
    assert response.status_code == (200 if headers else 400)
    assert "Line 2 holds a NUL character" in response.content.decode()
    assert not JobSubmission.objects.filter(user=approved_user).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("headers", [{}, HTMX], ids=["plain", "htmx"])
def test_a_completion_job_of_several_prompts_all_empty_lines_is_a_field_error(
    logged_in, approved_user, model_list, headers
):
    response = logged_in.post(
        "/jobs/completion/",
        {**COMPLETION_POST, "completion-prompt": "\n", "completion-several_prompts": "on"},
        **headers,
    )
    assert response.status_code == (200 if headers else 400)
    html = response.content.decode()
    message = "Several prompts: one per line, and every line here is empty."
    assert message in html and 'id="id_completion-prompt"' in html.split(message)[0]
    assert not JobSubmission.objects.filter(user=approved_user).exists()


@pytest.mark.django_db
def test_bad_input_without_js_is_a_400_page_with_the_field_error(
    logged_in, approved_user, model_list
):
    response = logged_in.post("/jobs/harvest/", HARVEST_POST)
    assert response.status_code == 400
    assert "Give at least one prompt, here or as a file." in response.content.decode()
    assert not JobSubmission.objects.filter(user=approved_user).exists()


@pytest.mark.django_db
def test_bad_input_with_htmx_replaces_only_the_forms(logged_in, approved_user, model_list):
    response = logged_in.post(
        "/jobs/completion/", {**COMPLETION_POST, "completion-max_tokens": "0"}, **HTMX
    )
    assert response.status_code == 200
    assert response["HX-Retarget"] == "#job-forms"
    assert response["HX-Reswap"] == "outerHTML"
    html = response.content.decode()
    assert html.lstrip().startswith('<section id="job-forms"')
    assert "Ensure this value is greater than or equal to 1." in html
    assert not JobSubmission.objects.filter(user=approved_user).exists()


@pytest.mark.django_db
def test_posting_the_same_form_twice_submits_once(logged_in, approved_user, model_list):
    token = str(uuid.uuid4())
    for _ in range(2):
        logged_in.post("/jobs/completion/", {**COMPLETION_POST, "completion-submit_token": token})
    assert JobSubmission.objects.filter(user=approved_user).count() == 1


@pytest.mark.django_db
def test_a_refused_submission_shows_the_apis_error(logged_in, approved_user, model_list):
    JobSubmission.objects.create(
        user=approved_user,
        kind=JobKind.HARVEST,
        request={},
        status=WorkStatus.FAILED,
        error_code="harvest_quota_exceeded",
        error_message="No harvest jobs left <this month>.",
    )
    html = logged_in.get("/jobs/").content.decode()
    assert "Refused" in html
    assert "harvest_quota_exceeded: No harvest jobs left &lt;this month&gt;." in html
    assert "hx-trigger" not in html


def test_the_playground_and_jobs_pages_list_models_from_the_database_and_create_no_key(
    logged_in, approved_user, redis_client
):
    """A page GET neither creates the user's playground key nor asks /v1/models (the gateway
    is not running here): the model list is read from the database, and the key is made by
    the first run or job submitted."""
    from accounts.models import ApiKey
    from api.models import LanguageModel

    LanguageModel.objects.create(
        name="db-model", upstream_urls=["http://127.0.0.1:9"], max_model_len=64, n_layers=4,
        hidden_size=8, vocab_size=1000, supports_activations=True,
    )  # fmt: skip
    for url in ("/playground/", "/jobs/"):
        page = logged_in.get(url)
        assert page.status_code == 200
        assert '<option value="db-model"' in page.content.decode()
    assert not ApiKey.objects.filter(user=approved_user, is_playground=True).exists()
