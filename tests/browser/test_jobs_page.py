"""The Jobs page's forms in a real browser: each job goes through /v1 (worker, gateway,
engine), appears in the list and finishes; cancelling a harvest asks first and keeps the
batches it wrote."""

import pytest
from django.conf import settings
from playwright.sync_api import expect

from accounts.models import User
from api import upstream
from api.jobs.models import CompletionJob, HarvestJob

from .conftest import BROWSER_USER, HARVEST_USER

pytestmark = pytest.mark.django_db


def submit_completion_job(page, *, prompt: str, max_tokens: int):
    """Submit a completion job on the Jobs page; its row once it succeeded."""
    page.goto("/jobs/")
    rows = page.locator("#completion-jobs tbody tr")
    before = rows.count()
    page.fill("#id_completion-prompt", prompt)
    page.fill("#id_completion-max_tokens", str(max_tokens))
    page.click("#completion-job-form button[type=submit]")
    expect(rows).to_have_count(before + 1, timeout=60_000)
    expect(rows.first).to_contain_text("Succeeded", timeout=120_000)
    return rows.first


def test_a_completion_job_from_the_form_is_listed_and_succeeds(page):
    row = submit_completion_job(page, prompt="Once upon a time", max_tokens=3)
    job = CompletionJob.objects.get(pk=row.get_attribute("data-job-id"))
    assert job.user.email == BROWSER_USER
    assert job.key.is_playground
    assert job.request == {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 3}
    assert job.result_body["usage"]["completion_tokens"] == 3
    expect(row.locator("a", has_text="result.json")).to_be_visible()


def test_a_harvest_uploaded_as_jsonl_is_listed_and_done_with_its_files(harvest_page):
    page = harvest_page
    page.goto("/jobs/")
    page.set_input_files(
        "#id_harvest-prompts_file",
        files=[
            {
                "name": "prompts.jsonl",
                "mimeType": "application/jsonl",
                "buffer": b'"The quick brown fox."\n{"prompt": "Residual streams."}\n',
            }
        ],
    )
    page.check("input[name='harvest-layers'][value='3']")
    rows = page.locator("#harvest-jobs tbody tr")
    before = rows.count()
    page.click("#harvest-job-form button[type=submit]")
    expect(rows).to_have_count(before + 1, timeout=60_000)
    row = rows.first
    expect(row).to_contain_text("Done", timeout=180_000)
    expect(row.locator("td").nth(2)).to_have_text("3")
    expect(row).to_contain_text("2/2 prompts")
    expect(row.locator("a", has_text="shard 0")).to_be_visible()
    job = HarvestJob.objects.get(pk=row.get_attribute("data-job-id"))
    assert job.user.email == HARVEST_USER
    assert job.key.is_playground and job.n_prompts == 2


def test_cancelling_a_harvest_asks_first_and_keeps_the_batches_it_wrote(harvest_page, engine_gate):
    """The engine answers the first batch's captures and holds the second's until the job is
    cancelled: the job is caught mid-way on any CPU."""
    page = harvest_page
    batch = settings.ACS_HARVEST_BATCH_SIZE
    tenant = upstream.tenant_of(User.objects.get(email=HARVEST_USER).pk)

    def harvest_capture(request) -> bool:
        return request.path == "/v1/completions" and request.headers.get("x-acs-tenant") == tenant

    with engine_gate.hold(harvest_capture, after=batch):
        cancel_a_running_harvest(page, engine_gate, batch=batch)


def cancel_a_running_harvest(page, engine_gate, *, batch: int) -> None:
    prompts = "\n".join(f"Prompt {i} reads the residual stream of a model." for i in range(160))
    page.goto("/jobs/")
    page.fill("#id_harvest-prompts", prompts)
    page.click("#harvest-job-form button[type=submit]")
    row = page.locator("#harvest-jobs tbody tr").first
    expect(row).to_contain_text(f"{batch}/160 prompts", timeout=120_000)
    assert engine_gate.holding.wait(timeout=120)
    job_id = row.get_attribute("data-job-id")

    questions = []
    page.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.dismiss()))
    row.locator("a", has_text="Cancel").click()
    assert HarvestJob.objects.get(pk=job_id).is_active
    page.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.accept()))
    row.locator("a", has_text="Cancel").click()
    expect(page.locator("#messages")).to_contain_text(f"Harvest job {job_id[:8]} cancelled")
    expect(row).to_contain_text("Cancelled")
    assert (
        questions == [f"Cancel harvest job {job_id[:8]}? The batches it wrote so far are kept."] * 2
    )

    # The worker keeps what it wrote when it notices, before the batch it would start next;
    # the page follows the job until then, without a reload.
    expect(row).to_contain_text("Stopping after its current batch")
    engine_gate.release()
    expect(row.locator("a", has_text="shard 0")).to_be_visible(timeout=60_000)
    expect(row).not_to_contain_text("Stopping")
