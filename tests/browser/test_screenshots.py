"""Screenshots of the run page (a finished run with capture), the sweep page and the jobs
page at 1280 and 390 px wide (see `screenshots.py` for the folder). They are taken as a user
of their own, so the jobs and runs they make show on no other test's pages."""

import time
import uuid

import httpx
import pytest
from django.db import connections
from playwright.sync_api import expect

from accounts.models import User
from accounts.services.keys import api_key_create
from tests.conftest import make_user

from .conftest import watched_page
from .screenshots import WIDTHS, save_screenshots
from .test_playground import RUN_PANEL
from .test_run_panel import expect_finished, upload_vector

pytestmark = pytest.mark.django_db

SCREENSHOT_USER = "screenshots@example.org"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def api_secret(system, django_db_blocker):
    """A key of the screenshot user (created, committed, before any test's transaction)."""
    with django_db_blocker.unblock():
        user = User.objects.filter(email=SCREENSHOT_USER).first() or make_user(SCREENSHOT_USER)
        _, secret = api_key_create(user=user, name="screenshots", acting_user=user)
        connections.close_all()
    return secret


@pytest.fixture
def user_page(system, browser, sign_in, expected_http_errors, api_secret):
    """A logged-in page of the screenshot user."""
    with watched_page(browser, system, expected_http_errors, sign_in(SCREENSHOT_USER)) as page:
        yield page


def assert_written(paths, name):
    assert [path.name for path in paths] == [f"{name}-{width}.png" for width in WIDTHS]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in paths)


def assert_fits_the_phone_width(page):
    """Nothing makes the page itself scroll sideways at the last (phone) width."""
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]


def test_run_page_with_a_capture(user_page):
    page = user_page
    page.goto("/playground/")
    page.fill("#id_prompt", 'The "Eiffel Tower" is in')
    page.fill("#id_max_tokens", "4")
    page.fill("#id_temperature", "0")
    page.fill("#id_logprobs", "5")
    page.fill("#id_prompt_logprobs", "3")
    page.locator("#id_capture").select_option("all")
    page.click("#completion-form button[type=submit]")
    panel = page.locator(RUN_PANEL)
    expect_finished(panel)
    page.goto(f"/playground/runs/{panel.get_attribute('data-run-id')}/")
    for name in ("tokens", "topk", "surprisal", "heatmap", "norm_by_layer", "cosine", "pca"):
        expect(page.locator(f"#plot-{name} .main-svg").first).to_be_visible()
    assert_written(save_screenshots(page, "run"), "run")
    assert_fits_the_phone_width(page)


def test_sweep_page(user_page):
    page = user_page
    page.goto("/playground/")
    upload_vector(page, "screenshot")
    page.goto("/playground/")  # the steering form lists the new vector
    page.locator("#id_steer-vector").select_option(label="screenshot (layer 4)")
    page.fill("#id_steer-prompt", "I feel")
    page.fill("#id_steer-scales", "-8, 8, 16")
    page.fill("#id_steer-target_token", " happy")
    page.fill("#id_steer-max_tokens", "3")
    page.click("#steering-form button[type=submit]")
    group = page.locator("#steering-area .group-panel")
    expect(group).to_have_attribute("data-finished", "true", timeout=120_000)
    page.goto(group.get_by_role("link", name="permalink").get_attribute("href"))
    expect(page.locator("[data-plot='sweep'] .main-svg").first).to_be_visible()
    assert_written(save_screenshots(page, "sweep"), "sweep")
    assert_fits_the_phone_width(page)


def test_steering_comparison_page(user_page):
    page = user_page
    page.goto("/playground/")
    upload_vector(page, "compare")
    page.goto("/playground/")
    page.locator("#id_steer-vector").select_option(label="compare (layer 4)")
    page.fill("#id_steer-prompt", "I feel")
    page.fill("#id_steer-scales", "16")
    page.fill("#id_steer-max_tokens", "6")
    page.click("#steering-form button[type=submit]")
    # (Not the panel of an earlier sweep of this user, until the new one replaces it.)
    group = page.locator("#steering-area .group-panel[data-group-kind^=steering]")
    expect(group).to_have_attribute("data-finished", "true", timeout=120_000)
    page.goto(group.get_by_role("link", name="permalink").get_attribute("href"))
    expect(page.locator("[data-plot='diff-16'] .main-svg").first).to_be_visible()
    expect(page.locator("table.arms")).to_contain_text("I feel")
    assert_written(save_screenshots(page, "steering"), "steering")
    assert_fits_the_phone_width(page)


def finished(client: httpx.Client, url: str, done: set[str]) -> dict:
    deadline = time.monotonic() + 60
    while (job := client.get(url).json())["status"] not in done:
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    return job


def test_jobs_page_with_a_harvest_and_a_completion_job(user_page, system, api_secret):
    headers = {"Authorization": f"Bearer {api_secret}"}
    with httpx.Client(base_url=system.web_url, headers=headers, timeout=30) as client:
        harvest = client.post(
            "/v1/harvest",
            json={"model": MODEL, "prompts": ["Hello there", "Paris"], "layers": [2, 8]},
        )
        assert harvest.status_code == 202, harvest.text
        job = client.post(
            "/v1/completion-jobs",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
            headers={"Idempotency-Key": uuid.uuid4().hex},
        )
        assert job.status_code in (200, 201, 202), job.text
        assert finished(client, f"/v1/harvest/{harvest.json()['job_id']}", {"done"})
        assert finished(client, f"/v1/completion-jobs/{job.json()['id']}", {"succeeded"})
    page = user_page
    page.goto("/jobs/")
    chart = page.locator("[data-figure='harvest-norm-figure']")
    chart.scroll_into_view_if_needed()  # below the forms: drawn as it comes into view
    expect(chart.locator(".main-svg").first).to_be_visible()
    assert_written(save_screenshots(page, "jobs"), "jobs")
