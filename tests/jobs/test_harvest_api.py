"""POST/GET/DELETE /v1/harvest and the signed downloads: validation, quota and concurrency
limits, cancel, ownership, and URL tampering and expiry."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from unittest import mock
from urllib.parse import parse_qs, urlparse

import pytest
from django.db import connection
from django.utils import timezone
from safetensors import deserialize

from accounts.services.keys import api_key_create, api_key_disable, api_key_revoke
from accounts.services.users import user_suspend
from api.jobs import selectors, tasks
from api.jobs.models import HarvestJob
from api.jobs.services import harvests
from api.jobs.storage import MANIFEST_NAME, harvest_file_write
from infra.lifecycle import WorkStatus
from metering import windows
from metering.models import UsagePeriod

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "smollm2-135m", "prompts": ["Hello there.", "Residual streams."]}


def _post(client, body=BODY, **headers):
    return client.post(
        "/v1/harvest", data=json.dumps(body), content_type="application/json", **headers
    )


def _done_job(api_client):
    job_id = _post(api_client, {**BODY, "layers": [3, 5]}).json()["job_id"]
    tasks.harvest_job_run_task.apply((job_id,)).get()
    return job_id


def test_submit_returns_202_pending_with_quartile_layers_by_default(
    api_client, engine_model, sent_tasks
):
    response = _post(api_client)
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "pending"
    assert (body["model"], body["n_prompts"]) == ("smollm2-135m", 2)
    assert HarvestJob.objects.get(pk=body["job_id"]).layers == [7, 15, 22]
    assert sent_tasks.ids("api.jobs.tasks.harvest_job_run_task") == [body["job_id"]]


def test_layers_all_means_every_layer(api_client, engine_model):
    job_id = _post(api_client, {**BODY, "layers": "all"}).json()["job_id"]
    assert HarvestJob.objects.get(pk=job_id).layers == list(range(30))


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({**BODY, "layers": [30]}, "30"),
        ({**BODY, "layers": [1, 1]}, "twice"),
        ({**BODY, "layers": []}, "at least one"),
        ({**BODY, "prompts": []}, "prompts"),
        ({**BODY, "prompts": ["fine", ""]}, "prompts.1"),
        ({**BODY, "prompts": ["x"] * 4097}, "prompts"),
        ({**BODY, "prompt": "x"}, "prompt"),
    ],
)
def test_bad_harvest_bodies_are_400_naming_the_problem(api_client, engine_model, body, words):
    response = _post(api_client, body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert words in response.json()["error"]["message"]
    assert not HarvestJob.objects.exists()


def test_unknown_model_is_model_not_found(api_client, engine_model):
    response = _post(api_client, {**BODY, "model": "gpt-7"})
    assert response.json()["error"]["code"] == "model_not_found"


def test_a_model_without_activations_is_refused(api_client, engine_model):
    engine_model.supports_activations = False
    engine_model.save(update_fields=["supports_activations"])
    response = _post(api_client)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "activation_engine_unconfigured"


def test_a_body_over_the_cap_is_413(api_client, engine_model):
    response = _post(api_client, {**BODY, "prompts": ["x" * (9 * 1024 * 1024)]})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_the_monthly_harvest_quota_is_429_harvest_quota_exceeded(api_client, api_key, engine_model):
    api_key.monthly_harvest_quota = 1
    api_key.save(update_fields=["monthly_harvest_quota"])
    assert _post(api_client).status_code == 202
    response = _post(api_client)
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "harvest_quota_exceeded"
    assert "Retry-After" not in response
    assert HarvestJob.objects.count() == 1


def test_a_key_may_run_two_jobs_at_once_then_gets_429_with_retry_after(
    api_client, api_key, engine_model
):
    first = _post(api_client).json()["job_id"]
    assert _post(api_client).status_code == 202
    response = _post(api_client)
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "harvest_jobs_limit"
    assert int(response["Retry-After"]) > 0
    used = UsagePeriod.objects.get(key=api_key, period=windows.MONTH.name)
    assert used.harvest_jobs == 2

    assert api_client.delete(f"/v1/harvest/{first}").status_code == 200
    assert _post(api_client).status_code == 202


def test_a_harvest_resent_with_its_idempotency_key_is_the_same_job_counted_once(
    api_client, api_key, engine_model, sent_tasks
):
    first = _post(api_client, HTTP_IDEMPOTENCY_KEY="harvest-1")
    again = _post(api_client, HTTP_IDEMPOTENCY_KEY="harvest-1")
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json() == first.json()
    assert HarvestJob.objects.count() == 1
    assert UsagePeriod.objects.get(key=api_key, period=windows.MONTH.name).harvest_jobs == 1
    assert len(sent_tasks.ids("api.jobs.tasks.harvest_job_run_task")) == 1
    # Without a key, a resend is a new job, as before.
    assert _post(api_client).status_code == 202
    assert HarvestJob.objects.count() == 2


def test_a_harvest_idempotency_key_reused_for_other_prompts_is_409(api_client, engine_model):
    first = _post(api_client, HTTP_IDEMPOTENCY_KEY="harvest-2").json()["job_id"]
    other = {**BODY, "prompts": ["Something else."]}
    response = _post(api_client, other, HTTP_IDEMPOTENCY_KEY="harvest-2")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "idempotency_key_reused"
    assert first in response.json()["error"]["message"]
    assert response["X-Should-Retry"] == "false"
    assert HarvestJob.objects.count() == 1


def test_a_resend_is_the_same_job_even_when_the_key_runs_its_maximum_of_jobs(
    api_client, engine_model
):
    first = _post(api_client, HTTP_IDEMPOTENCY_KEY="harvest-3")
    assert _post(api_client).status_code == 202  # the key now runs two
    again = _post(api_client, HTTP_IDEMPOTENCY_KEY="harvest-3")
    assert again.status_code == 200
    assert again.json()["job_id"] == first.json()["job_id"]


def test_concurrent_harvest_submits_with_one_idempotency_key_create_one_job(
    approved_user, api_key, sent_tasks
):
    keys = [api_key] + [
        api_key_create(user=approved_user, name=f"key {i}", acting_user=None)[0] for i in range(3)
    ]
    start = threading.Barrier(12)

    def submit(index):
        try:
            start.wait()
            job, created = harvests.harvest_job_submit(
                key=keys[index % len(keys)],
                model="smollm2-135m",
                prompts=["Hello there."],
                layers=[3],
                add_special_tokens=True,
                idempotency_key="race",
            )
            return str(job.pk), created
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(submit, range(12)))

    assert HarvestJob.objects.count() == 1
    assert {job_id for job_id, _ in outcomes} == {str(HarvestJob.objects.get().pk)}
    assert sum(created for _, created in outcomes) == 1
    key_months = UsagePeriod.objects.filter(period=windows.MONTH.name, key__isnull=False)
    assert sum(row.harvest_jobs for row in key_months) == 1  # one job of the quota


def test_cancel_a_pending_job_then_cancelling_again_is_409(api_client, engine_model):
    job_id = _post(api_client).json()["job_id"]
    response = api_client.delete(f"/v1/harvest/{job_id}")
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    assert response.json()["completed_at"]
    again = api_client.delete(f"/v1/harvest/{job_id}")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "harvest_not_cancellable"
    harvests.harvest_job_execute(job_id=job_id)
    assert HarvestJob.objects.get(pk=job_id).status == WorkStatus.CANCELLED


def test_a_running_job_shows_progress(api_client, engine_model):
    job_id = _post(api_client).json()["job_id"]
    HarvestJob.objects.filter(pk=job_id).update(status=WorkStatus.RUNNING, prompts_done=1)
    body = api_client.get(f"/v1/harvest/{job_id}").json()
    assert body["status"] == "running"
    assert body["progress"] == {"prompts_done": 1, "n_prompts": 2}
    assert body["result"] is None


def test_a_done_job_has_signed_urls_that_work_without_an_api_key(
    api_client, client, engine_model, redis_client
):
    job_id = _done_job(api_client)
    body = api_client.get(f"/v1/harvest/{job_id}").json()
    assert body["status"] == "done", body["error"]
    assert body["progress"] == {"prompts_done": 2, "n_prompts": 2}
    result = body["result"]
    assert result["urls_expire_at"] > body["completed_at"]
    anonymous = client.__class__()
    manifest = json.loads(b"".join(anonymous.get(result["manifest_url"]).streaming_content))
    assert manifest["layers"] == [3, 5]
    assert len(result["shard_urls"]) == len(manifest["shards"]) == 1
    shard = anonymous.get(result["shard_urls"][0])
    assert shard.status_code == 200
    names = [name for name, _ in deserialize(b"".join(shard.streaming_content))]
    assert sorted(names) == ["prompt_0", "prompt_1", "tokens_0", "tokens_1"]
    stats = anonymous.get(result["stats_url"])
    assert sorted(n for n, _ in deserialize(b"".join(stats.streaming_content))) == [
        "mean",
        "norm_mean",
        "positions",
        "std",
    ]


def _with_token(url, token):
    parsed = urlparse(url)
    return f"{parsed.path}?token={token}"


def test_a_tampered_download_url_is_403(api_client, client, engine_model, redis_client):
    job_id = _done_job(api_client)
    result = api_client.get(f"/v1/harvest/{job_id}").json()["result"]
    manifest_token = parse_qs(urlparse(result["manifest_url"]).query)["token"][0]
    stats_path = urlparse(result["stats_url"]).path
    anonymous = client.__class__()
    for url in (
        _with_token(result["manifest_url"], manifest_token[:-2] + "xx"),
        f"{stats_path}?token={manifest_token}",
        urlparse(result["manifest_url"]).path,
    ):
        response = anonymous.get(url)
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "download_url_invalid"


def test_an_expired_download_url_is_403(api_client, client, engine_model, redis_client, settings):
    job_id = _done_job(api_client)
    result = api_client.get(f"/v1/harvest/{job_id}").json()["result"]
    anonymous = client.__class__()
    later = timezone.now() + timedelta(seconds=settings.ACS_HARVEST_URL_MAX_AGE_SECONDS + 1)
    with mock.patch("api.jobs.signing.timezone.now", return_value=later):
        response = anonymous.get(result["manifest_url"])
    assert response.status_code == 403
    assert "expired" in response.json()["error"]["message"]


def test_another_users_harvest_job_is_404(api_client, client, engine_model, other_user):
    job_id = _post(api_client).json()["job_id"]
    _, other_secret = api_key_create(user=other_user, name="eve", acting_user=None)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {other_secret}"}
    assert client.get(f"/v1/harvest/{job_id}", **auth).status_code == 404
    assert client.delete(f"/v1/harvest/{job_id}", **auth).status_code == 404
    assert HarvestJob.objects.get(pk=job_id).status == WorkStatus.QUEUED


def _finished_job_with_a_manifest(api_key) -> HarvestJob:
    """A done job whose only file is its manifest (no engine needed)."""
    job = HarvestJob.objects.create(
        user=api_key.user,
        key=api_key,
        model="smollm2-135m",
        prompts=["hello"],
        layers=[1],
        n_prompts=1,
        prompts_done=1,
        status=WorkStatus.SUCCEEDED,
        finished_at=timezone.now(),
        files=[MANIFEST_NAME],
    )
    harvest_file_write(job.storage_prefix, MANIFEST_NAME, b'{"shards": []}')
    return job


def _manifest_url_from_the_api(api_client, job) -> str:
    return urlparse(api_client.get(f"/v1/harvest/{job.pk}").json()["result"]["manifest_url"])


def _download(client, url):
    return client.__class__().get(f"{url.path}?{url.query}")


@pytest.mark.parametrize(
    ("withdraw", "code"),
    [
        (lambda key: api_key_revoke(key=key, acting_user=None), "key_revoked"),
        (lambda key: api_key_disable(key=key, acting_user=None), "key_disabled"),
        (lambda key: user_suspend(user=key.user, acting_user=None), "account_suspended"),
    ],
    ids=["key revoked", "key paused", "account suspended"],
)
def test_a_signed_url_stops_working_once_its_owner_may_not_use_the_api(
    api_client, client, api_key, withdraw, code
):
    job = _finished_job_with_a_manifest(api_key)
    url = _manifest_url_from_the_api(api_client, job)
    assert _download(client, url).status_code == 200
    withdraw(api_key)
    refused = _download(client, url)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == code


def test_a_signed_url_keeps_working_when_another_key_of_the_owner_is_revoked(
    api_client, client, api_key, approved_user
):
    job = _finished_job_with_a_manifest(api_key)
    url = _manifest_url_from_the_api(api_client, job)
    other, _ = api_key_create(user=approved_user, name="other", acting_user=None)
    api_key_revoke(key=other, acting_user=None)
    assert _download(client, url).status_code == 200


def test_the_portals_links_stop_working_once_the_account_is_suspended(client, api_key):
    job = _finished_job_with_a_manifest(api_key)
    url = urlparse(selectors.harvest_download_links(job=job)["manifest_url"])
    assert _download(client, url).status_code == 200
    user_suspend(user=api_key.user, acting_user=None)
    refused = _download(client, url)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "account_suspended"
