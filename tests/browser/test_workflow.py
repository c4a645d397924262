"""Steer from anywhere and a history you can find things in (issue 21, items 4 and 5), in a
real browser through the real gateway, worker and engine."""

import datetime as dt
import io
import uuid

import numpy as np
import pytest
from django.utils import timezone
from playwright.sync_api import expect

from accounts.models import User
from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind, SteeringScore
from playground.vectors.services import steering_vector_create
from tests.conftest import make_user
from tests.playground.conftest import recorded

from .conftest import watched_page
from .test_playground import RUN_PANEL, submit_completion

pytestmark = pytest.mark.django_db

PHONE = {"width": 390, "height": 844}
# A researcher whose history is seeded (committed, for the servers to see): 30 completions,
# 3 sweeps, and prompts with a long unbroken token.
HISTORY_USER = "browser-history@example.org"
LONG_TOKEN = "supercalifragilistic" * 8
# The elements wider than the screen, for the failure message.
OVERFLOWING = """() => [...document.querySelectorAll('body *')]
  .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
  .map(e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + '.' + [...e.classList].join('.')
       + ' ' + Math.round(e.getBoundingClientRect().right))"""


def seeded_run(user, *, kind, prompt, minutes_ago, scale=None) -> Run:
    return Run(
        user=user,
        kind=kind,
        status=WorkStatus.SUCCEEDED,
        scale=scale,
        request={"model": "smollm2-135m", "prompt": prompt},
        created_at=timezone.now() - dt.timedelta(minutes=minutes_ago),
    )


@pytest.fixture(scope="module")
def history_user(system, django_db_blocker):
    with django_db_blocker.unblock():
        user = User.objects.filter(email=HISTORY_USER).first() or make_user(HISTORY_USER)
        if not Run.objects.filter(user=user).exists():
            completions = [
                seeded_run(
                    user,
                    kind=RunKind.COMPLETION,
                    prompt=f"history prompt {index:02d}",
                    minutes_ago=index,
                )
                for index in range(30)
            ]
            sweeps = [
                seeded_run(
                    user,
                    kind=RunKind.SWEEP,
                    prompt=f"sweep prompt {index} {LONG_TOKEN}",
                    minutes_ago=60 + index,
                    scale=2.0,
                )
                for index in range(3)
            ]
            Run.objects.bulk_create(completions + sweeps)
            seed_a_filled_playground(user)
    return user


def seed_a_filled_playground(user) -> None:
    """What a researcher's playground shows after a while: a vector in the library, a
    steering comparison, and a capture as the latest completion run (recorded /v1 answers)."""
    vector = steering_vector_create(
        user=user, name=f"long {LONG_TOKEN[:90]}", model="smollm2-135m",
        layer=4, method="upload", vector=np.ones(576, dtype=np.float32),
        details={"filename": f"{LONG_TOKEN}.npy"},
    )  # fmt: skip
    group = uuid.uuid4()
    for kind, scale, answer in (
        (RunKind.STEERING_BASELINE, 0.0, "steer_baseline.json"),
        (RunKind.STEERING_STEERED, 4.0, "steer_steered.json"),
    ):
        Run.objects.create(
            user=user, kind=kind, group=group, scale=scale, vector=vector,
            status=WorkStatus.SUCCEEDED, response=recorded(answer),
            request={"model": "smollm2-135m", "prompt": f"I think that {LONG_TOKEN}",
                     "max_tokens": 8, "apply_steering_vectors": []},
        )  # fmt: skip
    # Its same-token comparison has ended, so the page does not keep polling for it.
    SteeringScore.objects.create(
        group=group, user=user, status=WorkStatus.FAILED, error_code="not_comparable"
    )
    Run.objects.create(
        user=user, kind=RunKind.COMPLETION, status=WorkStatus.SUCCEEDED,
        response=recorded("capture.json"),
        request={"model": "smollm2-135m", "prompt": f"Hello world, {LONG_TOKEN}",
                 "max_tokens": 1, "output_residual_stream": [0, 4, 8]},
    )  # fmt: skip


@pytest.fixture
def history_page(system, browser, sign_in, expected_http_errors, history_user):
    with watched_page(browser, system, expected_http_errors, sign_in(HISTORY_USER)) as page:
        yield page


def upload_vector(page, name: str, layer: int = 3) -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.random.default_rng(1).standard_normal(576).astype(np.float32))
    page.goto("/playground/")
    page.fill("#id_upload-name", name)
    page.fill("#id_upload-layer", str(layer))
    page.set_input_files(
        "#id_upload-file",
        files=[{"name": f"{name}.npy", "mimeType": "application/octet-stream",
                "buffer": buffer.getvalue()}],
    )  # fmt: skip
    page.click("#upload-form button[type=submit]")
    expect(page.locator("#vectors table")).to_contain_text(name)


def library_row(page, name: str):
    return page.locator(f"#vectors tr[data-vector-name='{name}']")


def test_steer_from_the_main_form_and_see_a_steered_run(page):
    name = f"steer-{uuid.uuid4().hex[:6]}"
    upload_vector(page, name, layer=3)
    page.goto("/playground/")  # the steering forms list the new vector
    steering = page.locator("#completion-steering")
    expect(steering.locator("option", has_text=f"{name} (layer 3)")).to_have_count(1)
    expect(steering).not_to_have_attribute("open", "")
    steering.locator("summary").click()
    page.locator("#id_steer_vector").select_option(label=f"{name} (layer 3)")
    page.fill("#id_steer_scale", "1000")  # within bounds
    page.fill("#id_steer_layers", "3, 99")
    page.fill("#id_prompt", "I think that")
    page.click("#completion-form button[type=submit]")
    # A bad layer is a field error; the steering box stays open to show it.
    expect(page.locator("#completion-steering .errorlist")).to_contain_text(
        "Layer 99 in 'Layers' is out of range"
    )
    expect(page.locator("#completion-steering")).to_have_attribute("open", "")
    page.fill("#id_steer_layers", "3")
    page.fill("#id_steer_scale", "8")
    page.fill("#id_max_tokens", "6")
    page.fill("#id_temperature", "0")
    page.locator("#id_stream").set_checked(False)
    panel = page.locator(RUN_PANEL)
    panel_ids = panel.evaluate_all("panels => panels.map(panel => panel.dataset.runId)")
    page.click("#completion-form button[type=submit]")
    for run_id in panel_ids:
        expect(panel).not_to_have_attribute("data-run-id", run_id)
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    expect(panel.locator(".steered-with")).to_contain_text(f"Steered with {name} × 8 at layer 3")
    sent = panel.locator("details", has_text="Request (exactly as sent)")
    sent.locator("summary").click()
    expect(sent.locator("pre")).to_contain_text('"apply_steering_vectors"')
    expect(sent.locator("pre")).to_contain_text('"scale": 8')


def test_save_a_vector_from_a_capture_and_find_it_in_the_library(page):
    name = f"capture-mean-{uuid.uuid4().hex[:6]}"
    panel = submit_completion(
        page, prompt="The Eiffel Tower is in", max_tokens=1, temperature=0, stream=False,
        capture="layers", capture_layers="3, 8",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    save = panel.locator("details.save-vector")
    save.locator("summary").click()
    expect(save.locator("input[name=positions]")).to_have_value("1-5")
    save.locator("input[name=name]").fill(name)
    save.locator("input[name=positions]").fill("1-99")
    save.locator("button[type=submit]").click()
    expect(page.locator("details.save-vector .errorlist")).to_contain_text("outside 0–5")
    save = page.locator("details.save-vector")
    expect(save.locator("input[name=name]")).to_have_value(name)
    save.locator("select[name=layer]").select_option("8")
    save.locator("input[name=positions]").fill("1-5")
    save.locator("button[type=submit]").click()
    expect(page.locator("details.save-vector .notice")).to_contain_text(f"Saved {name}")
    row = library_row(page, name)
    expect(row).to_contain_text("Mean of a capture")
    expect(row).to_contain_text("Mean at layer 8 of the run on “The Eiffel Tower is in”")
    expect(row).to_contain_text("positions 1, 2, 3, 4, 5")
    # The steering form lists it too.
    expect(page.locator("#id_steer-vector option", has_text=f"{name} (layer 8)")).to_have_count(1)


def test_rename_and_delete_a_vector(page):
    name = f"rename-{uuid.uuid4().hex[:6]}"
    upload_vector(page, name)
    page.goto("/playground/")  # the steering forms list the new vector
    row = library_row(page, name)
    row.locator("summary", has_text="Rename").click()
    # Blank (spaces pass the browser's own check): the server's field error.
    row.locator("input[type=text]").fill("   ")
    row.locator("button", has_text="Save name").click()
    expect(library_row(page, name).locator(".errorlist")).to_contain_text("required")
    library_row(page, name).locator("input[type=text]").fill(f"{name}-renamed")
    library_row(page, name).locator("button", has_text="Save name").click()
    renamed = library_row(page, f"{name}-renamed")
    expect(renamed).to_be_visible()
    expect(page.locator("#id_steer_vector option", has_text=f"{name}-renamed")).to_have_count(1)
    # Dismissing the confirmation keeps the vector; accepting it deletes it.
    page.once("dialog", lambda dialog: dialog.dismiss())
    renamed.locator("a", has_text="Delete").click()
    page.wait_for_timeout(500)
    expect(renamed).to_be_visible()
    page.once("dialog", lambda dialog: dialog.accept())
    renamed.locator("a", has_text="Delete").click()
    expect(renamed).to_have_count(0)
    expect(page.locator("#id_steer_vector option", has_text=f"{name}-renamed")).to_have_count(0)


def test_history_filters_paginate_and_go_back(history_page):
    page = history_page
    page.goto("/playground/runs/")
    history = page.locator("#history")
    expect(history).to_contain_text("Page 1 of 2 (36 runs)")
    page.locator("#id_kind").select_option("completion")
    expect(history).to_contain_text("Page 1 of 2 (31 runs)")
    assert page.url.endswith("/playground/runs/?kind=completion&prompt=&vector=")
    page.click("#history a[rel=next]")
    expect(history).to_contain_text("Page 2 of 2 (31 runs)")
    expect(history).to_contain_text("history prompt 29")
    assert "page=2" in page.url and "kind=completion" in page.url
    page.go_back()
    expect(page.locator("#history")).to_contain_text("Page 1 of 2 (31 runs)")
    expect(page.locator("#history")).to_contain_text("history prompt 00")
    expect(page.locator("#id_kind")).to_have_value("completion")
    page.go_back()
    expect(page.locator("#history")).to_contain_text("Page 1 of 2 (36 runs)")
    # Bookmarkable: the filtered URL loads the filtered page.
    page.goto("/playground/runs/?prompt=sweep+prompt+1")
    expect(page.locator("#history tbody tr")).to_have_count(1)
    expect(page.locator("#id_prompt")).to_have_value("sweep prompt 1")
    # Reload keeps it.
    page.reload()
    expect(page.locator("#history tbody tr")).to_have_count(1)


@pytest.mark.parametrize("path", ["/playground/", "/playground/runs/"])
def test_playground_and_history_do_not_scroll_sideways_at_390_px(history_page, path):
    page = history_page
    page.set_viewport_size(PHONE)
    page.goto(path)
    page.wait_for_load_state("networkidle")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], page.evaluate(OVERFLOWING)
