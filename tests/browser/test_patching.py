"""The activation patching page as a researcher uses it, on the real engine: a small grid runs
(reloaded mid-run, its submit button double-clicked), its numbers (log p of the target and
the logit difference against the corrupted target, the baselines and the noise floor)
match an independent computation with torch forward hooks
(`tests/engine/patching_reference.py`), each cell opens its run, a large grid is cancelled
and says what ran, bad input gets field errors, and at 390 px the page does not scroll
sideways. Screenshots of a grid by its logit difference at 1280 and 390 px."""

import json
import re

import pytest
from playwright.sync_api import expect

from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind
from tests.patching_numbers import (
    LOGPROB_TOLERANCE,
    assert_causal_tracing_picture,
    compare_grid,
    reference_grid,
)

from .conftest import BROWSER_USER
from .screenshots import WIDTHS, save_screenshots

pytestmark = pytest.mark.django_db

CLEAN = "The capital of France is"
CORRUPTED = "The capital of Italy is"
TARGET = " Paris"
WRONG = " Rome"
LAYERS = "0, 12, 29"
SUBMIT = "#patching-form button[type=submit]"
GRID = ".patching-grid"
# A grid on the CPU engine: 21 short requests through one worker.
GRID_TIMEOUT_MS = 240_000


def fill_grid_form(
    page, *, clean=CLEAN, corrupted=CORRUPTED, target=TARGET, wrong=WRONG, layers=LAYERS,
    metric="logit_diff",
):  # fmt: skip
    page.goto("/playground/patching/")
    page.fill("#id_patch-clean_prompt", clean)
    page.fill("#id_patch-corrupted_prompt", corrupted)
    page.fill("#id_patch-target", target)
    page.fill("#id_patch-corrupted_target", wrong)
    page.select_option("#id_patch-metric", metric)
    page.fill("#id_patch-layers", layers)


def capture_count(user_email: str) -> int:
    return Run.objects.filter(user__email=user_email, kind=RunKind.PATCHING_CAPTURE).count()


def expect_grid_finished(grid) -> None:
    """Wait until the grid has finished; if it does not, say what each of its runs is doing."""
    try:
        expect(grid).to_have_attribute("data-finished", "true", timeout=GRID_TIMEOUT_MS)
    except AssertionError:
        group = grid.get_attribute("id").removeprefix("grid-")
        runs = Run.objects.filter(group=group).order_by("created_at")
        states = [(r.kind, r.meta.get("role"), r.status, r.error_code, r.attempts) for r in runs]
        raise AssertionError(f"grid {group} did not finish: {states}") from None


def two_decimals(value: float) -> str:
    """`value` as the grid shows it: two decimals, and no sign on one that rounds to zero (a
    cell whose patch changes nothing has an effect of about ±0.001 in bfloat16)."""
    text = f"{value:.2f}"
    return "0.00" if text == "-0.00" else text


def test_a_grid_runs_through_a_reload_and_matches_torch_hooks(page):
    before = capture_count(BROWSER_USER)
    fill_grid_form(page)
    page.dblclick(SUBMIT)
    grid = page.locator(GRID)
    expect(grid).to_be_visible()
    expect(grid.get_by_role("status")).to_contain_text("requests finished")
    page.reload()
    grid = page.locator(GRID)
    expect_grid_finished(grid)
    # 2 captures, the clean baseline, 3 repeats and 3 layers × 5 positions.
    expect(grid.get_by_role("status")).to_contain_text("Done: 21 requests")
    # The double click made one grid.
    assert capture_count(BROWSER_USER) == before + 2

    header = grid.locator("thead th")
    expect(header).to_have_text(
        ["Layer", "0 The", "1 ·capital", "2 ·of", "3 ·France ·Italy", "4 ·is"], use_inner_text=True
    )
    expect(grid.locator("tbody th")).to_have_text(["0", "12", "29"])
    numbers = json.loads(page.locator("#patching-numbers").text_content())
    assert numbers["metric"] == "logit_diff"
    reference = reference_grid(numbers)
    found = compare_grid(numbers, reference, LOGPROB_TOLERANCE[reference["compute_dtype"]])
    records = numbers["runs"]
    # The page shows the logit difference's effects; ≈ marks a cell within the noise floor.
    floor = numbers["metrics"]["logit_diff"]["noise_floor"]
    assert floor >= 0 and len(numbers["metrics"]["logit_diff"]["repeats"]) == 3
    for record in (r for r in records if r["role"] == "cell"):
        shown = grid.locator(
            f"td[data-layer='{record['layer']}'][data-position='{record['position']}']"
        )
        mark = "≈" if record["logit_diff_within_floor"] else ""
        expect(shown).to_have_text(mark + two_decimals(record["logit_diff_effect"]))
    assert_causal_tracing_picture(found.effects, last_layer=29)
    print(
        f"patching grid vs float32 torch hooks ({reference['compute_dtype']} engine): "
        f"{found.describe()}; "
        f"noise floor of the logit difference {floor:.4f} nats over 3 repeats "
        f"{numbers['metrics']['logit_diff']['repeats']}, of log p(target) "
        f"{numbers['metrics']['logprob']['noise_floor']:.4f} nats; float32 clean "
        f"{reference['clean']}, corrupted {reference['corrupted']}"
    )

    cell = grid.locator("td[data-layer='12'][data-position='3'] a")
    run = next(
        r["run"] for r in records if (r["role"], r["layer"], r["position"]) == ("cell", 12, 3)
    )
    cell.click()
    expect(page).to_have_url(f"/playground/runs/{run}/")
    expect(page.locator("body")).to_contain_text("position_indices")


def test_a_large_grid_is_cancelled_and_its_unsent_runs_are_never_sent(page):
    fill_grid_form(page, layers="")
    page.click(SUBMIT)
    # The page may still show the previous grid until the new one is swapped in.
    grid = page.locator(GRID, has_text="30 layers × 5 positions")
    grid.get_by_role("button", name="Cancel the grid").click()
    grid = page.locator(GRID)
    expect(grid.get_by_role("status")).to_contain_text("Cancelled", timeout=30_000)
    expect_grid_finished(grid)
    # What ran and what was never sent, not "n of n requests finished".
    expect(grid.get_by_role("status")).to_contain_text("Ran: ")
    expect(grid.get_by_role("status")).not_to_contain_text("requests finished")
    group = page.locator(GRID).get_attribute("id").removeprefix("grid-")
    runs = Run.objects.filter(group=group)
    assert not runs.filter(status__in=(WorkStatus.QUEUED, WorkStatus.RUNNING)).exists()
    # 30 layers × 5 positions + the clean baseline and 3 repeats + 2 captures: cancelled
    # while capturing, no patched run was created; cancelled later, the queued ones were
    # never sent.
    sent = runs.exclude(status=WorkStatus.CANCELLED)
    assert sent.count() < 156
    assert runs.filter(kind=RunKind.PATCHED).count() in (0, 154)
    expect(grid.get_by_role("button", name="Cancel the grid")).to_have_count(0)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"corrupted": "The capital city of Italy is"},
            "#id_patch-corrupted_prompt",
            "The corrupted prompt is 6 tokens and the clean prompt 5",
        ),
        ({"target": " a b c d e f g h i"}, "#id_patch-target", "At most 8 tokens; this is 9"),
        ({"wrong": ""}, "#id_patch-corrupted_target", "compares the target with the corrupted"),
        ({"layers": "0, 30"}, "#id_patch-layers", "Layer 30 in 'Layers' is out of range"),
    ],
)
def test_bad_input_gets_an_error_beside_its_field(page, fields, field, message):
    fill_grid_form(page, **fields)
    page.click(SUBMIT)
    error = page.locator(f"{field} ~ .errorlist")
    expect(error).to_contain_text(message)


def test_the_patching_page_fits_a_phone_and_is_photographed(page):
    fill_grid_form(page, layers="0, 15")
    page.click(SUBMIT)
    grid = page.locator(GRID, has_text="2 layers × 5 positions")
    expect_grid_finished(grid)
    expect(grid.locator(".metric-picker strong")).to_have_text(
        "logit difference, target − corrupted target"
    )
    expect(grid.locator(".noise-floor")).to_contain_text("nats")
    save_screenshots(page, "patching")
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]
    expect(grid.locator("td[data-position='3'] a").first).to_be_visible()
    # The other metric, picked on the page.
    grid.locator("[data-metric-link=logprob]").click()
    expect(page.locator(GRID)).to_have_attribute("data-metric", "logprob")
    expect(page).to_have_url(re.compile(r"metric=logprob"))
