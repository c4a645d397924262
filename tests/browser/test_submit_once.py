"""Double-clicking a playground button that creates runs sends one submission: one run for
"Send request", one baseline-and-steered group for "Run baseline and steered"."""

import io

import numpy as np
import pytest
from playwright.sync_api import expect

from playground.models import Run

from .conftest import BROWSER_USER
from .test_playground import run_panel_after

pytestmark = pytest.mark.django_db

# How long a second, unwanted submission would take at most to reach the server after the
# first one's answer is on the page (it is sent at once, or queued behind the first).
SECOND_SUBMISSION_GRACE_MS = 3000


@pytest.fixture
def console_errors(page):
    errors = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    return errors


def user_runs():
    return Run.objects.filter(user__email=BROWSER_USER)


def test_double_clicking_send_request_creates_one_run(page, console_errors):
    before = set(user_runs().values_list("id", flat=True))
    page.goto("/playground/")
    page.fill("#id_prompt", "Hello")
    page.fill("#id_max_tokens", "1")
    panel = run_panel_after(page, lambda: page.dblclick("#completion-form button[type=submit]"))
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    page.wait_for_timeout(SECOND_SUBMISSION_GRACE_MS)
    created = user_runs().exclude(id__in=before)
    assert created.count() == 1
    assert panel.get_attribute("data-run-id") == str(created.get().id)
    assert console_errors == []


def test_double_clicking_run_baseline_and_steered_creates_one_group(page, console_errors):
    buffer = io.BytesIO()
    np.save(buffer, np.full(576, 0.1, dtype=np.float32))
    page.goto("/playground/")
    page.fill("#id_upload-name", "double-click")
    page.fill("#id_upload-layer", "4")
    page.set_input_files(
        "#id_upload-file",
        files=[
            {"name": "v.npy", "mimeType": "application/octet-stream", "buffer": buffer.getvalue()}
        ],
    )
    page.click("#upload-form button[type=submit]")
    expect(page.locator("#vectors table")).to_contain_text("double-click")
    page.goto("/playground/")  # the steering form lists the new vector
    before = set(user_runs().values_list("id", flat=True))
    page.locator("#id_steer-vector").select_option(label="double-click (layer 4)")
    page.fill("#id_steer-prompt", "I think that")
    page.fill("#id_steer-scales", "2")
    page.fill("#id_steer-max_tokens", "2")
    page.dblclick("#steering-form button[type=submit]")
    group = page.locator("#steering-area .group-panel")
    expect(group).to_have_attribute("data-finished", "true", timeout=90_000)
    page.wait_for_timeout(SECOND_SUBMISSION_GRACE_MS)
    created = user_runs().exclude(id__in=before)
    assert created.count() == 2
    assert len({run.group for run in created}) == 1
    assert console_errors == []
