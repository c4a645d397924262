"""The activation patching page as a researcher uses it, on the real engine: a small grid runs
(reloaded mid-run, its submit button double-clicked), its numbers (log p of the target and
the logit difference against the corrupted target, the baselines and the noise floor)
match an independent computation with torch forward hooks
(`tests/engine/patching_reference.py`), each cell opens its run, a large grid is cancelled
and says what ran, bad input gets field errors, and at 390 px the page does not scroll
sideways. Screenshots of a grid by its logit difference at 1280 and 390 px."""

import json
import re
import subprocess

import pytest
from playwright.sync_api import expect

from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind
from testsupport.servers import ENGINE_PYTHON, REPO_ROOT

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
# How far the page's logprobs may sit from the float32 reference: the engine computes in
# bfloat16 on this kind of machine (tests/engine/test_fidelity.py, TOLERANCES: up to 0.46
# nats measured for reported logprobs) or float32 (1e-3, plus the patch vector sent as
# bfloat16, relative step 2**-8 of clean − corrupted).
LOGPROB_TOLERANCE = {"bfloat16": 0.5, "float32": 0.02}


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
        runs = Run.objects.filter(group=group).order_by("queued_at")
        states = [(r.kind, r.meta.get("role"), r.status, r.error_code, r.attempts) for r in runs]
        raise AssertionError(f"grid {group} did not finish: {states}") from None


def reference_grid(numbers: dict) -> dict:
    """The grid from transformers' float32 model with forward hooks, in the engine's
    virtualenv (the web virtualenv has no torch)."""
    spec = {key: numbers[key] for key in ("clean_ids", "corrupted_ids", "layers", "positions")}
    spec["targets"] = [target["ids"] for target in numbers["targets"]]
    answer = subprocess.run(
        [str(ENGINE_PYTHON), "tests/engine/patching_reference.py"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
        timeout=600,
    )
    return json.loads(answer.stdout)


def metrics(scores: list[float]) -> dict[str, float]:
    """log p(target) and the logit difference from the two targets' scores."""
    return {"logprob": scores[0], "logit_diff": scores[0] - scores[1]}


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
    tolerance = LOGPROB_TOLERANCE[reference["compute_dtype"]]
    clean, corrupted = metrics(reference["clean"]), metrics(reference["corrupted"])
    assert clean["logprob"] - corrupted["logprob"] > 3, "the prompts must differ in the target"
    assert clean["logit_diff"] - corrupted["logit_diff"] > 3
    records = numbers["runs"]
    errors, effect_errors, effects = [], [], {"logprob": {}, "logit_diff": {}}
    for metric, bound in (("logprob", tolerance), ("logit_diff", 2 * tolerance)):
        summary = numbers["metrics"][metric]
        assert abs(summary["clean"] - clean[metric]) <= bound, metric
        assert abs(summary["corrupted"] - corrupted[metric]) <= bound, metric
        gap = clean[metric] - corrupted[metric]
        for record in (r for r in records if r["role"] == "cell"):
            where = (metric, record["layer"], record["position"])
            value = metrics(reference["cells"][f"{record['layer']},{record['position']}"])[metric]
            errors.append(abs(record[metric] - value))
            assert errors[-1] <= bound, where
            effect = record[f"{metric}_effect"]
            effect_errors.append(abs(effect - (value - corrupted[metric]) / gap))
            # The effect divides differences of values each within `bound` by the gap.
            assert effect_errors[-1] <= 3 * bound / gap, where
            effects[metric][record["layer"], record["position"]] = effect
    # The page shows the logit difference's effects; ≈ marks a cell within the noise floor.
    floor = numbers["metrics"]["logit_diff"]["noise_floor"]
    assert floor >= 0 and len(numbers["metrics"]["logit_diff"]["repeats"]) == 3
    for record in (r for r in records if r["role"] == "cell"):
        shown = grid.locator(
            f"td[data-layer='{record['layer']}'][data-position='{record['position']}']"
        )
        mark = "≈" if record["logit_diff_within_floor"] else ""
        expect(shown).to_have_text(mark + two_decimals(record["logit_diff_effect"]))
    # Causal tracing's picture, by either metric: in early and middle layers the country's
    # position (3) carries the answer; by the last layer only the last position (4) can.
    for metric, effect in effects.items():
        assert effect[0, 3] > 0.8 and effect[12, 3] > 0.8 and effect[29, 3] < 0.1, metric
        assert effect[29, 4] > 0.8 and effect[0, 4] < 0.2, metric
    print(
        f"patching grid vs float32 torch hooks ({reference['compute_dtype']} engine): "
        f"max |Δ value| {max(errors):.4f} nats, max |Δ effect| {max(effect_errors):.4f}; "
        f"noise floor of the logit difference {floor:.4f} nats over 3 repeats "
        f"{numbers['metrics']['logit_diff']['repeats']}, of log p(target) "
        f"{numbers['metrics']['logprob']['noise_floor']:.4f} nats; float32 clean {clean}, "
        f"corrupted {corrupted}"
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
    sent = runs.exclude(error_code="cancelled")
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
        ({"layers": "0, 30"}, "#id_patch-layers", "No such layer: 30"),
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
