"""The activation patching page as a researcher uses it, on the real engine: a small grid runs
(reloaded mid-run, its submit button double-clicked), its heatmap's numbers match an
independent computation with torch forward hooks (`tests/engine/patching_reference.py`), each
cell opens its run, a large grid is cancelled, bad input gets field errors, and at 390 px the
page does not scroll sideways. Screenshots at 1280 and 390 px."""

import json
import subprocess

import pytest
from playwright.sync_api import expect

from playground.models import Run, RunKind, RunStatus
from tests.servers import ENGINE_PYTHON, REPO_ROOT

from .conftest import BROWSER_USER
from .screenshots import WIDTHS, save_screenshots

pytestmark = pytest.mark.django_db

CLEAN = "The capital of France is"
CORRUPTED = "The capital of Italy is"
TARGET = " Paris"
LAYERS = "0, 12, 29"
SUBMIT = "#patching-form button[type=submit]"
GRID = ".patching-grid"
# A grid on the CPU engine: 17 short requests through one worker.
GRID_TIMEOUT_MS = 240_000
# How far the page's logprobs may sit from the float32 reference: the engine computes in
# bfloat16 on this kind of machine (tests/engine/test_fidelity.py, TOLERANCES: up to 0.46
# nats measured for reported logprobs) or float32 (1e-3, plus the patch vector sent as
# bfloat16, relative step 2**-8 of clean − corrupted).
LOGPROB_TOLERANCE = {"bfloat16": 0.5, "float32": 0.02}


def fill_grid_form(page, *, clean=CLEAN, corrupted=CORRUPTED, target=TARGET, layers=LAYERS):
    page.goto("/playground/patching/")
    page.fill("#id_patch-clean_prompt", clean)
    page.fill("#id_patch-corrupted_prompt", corrupted)
    page.fill("#id_patch-target", target)
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
    spec = {key: numbers[key] for key in ("clean_ids", "corrupted_ids", "target_id")}
    spec.update(layers=numbers["layers"], positions=numbers["positions"])
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
    expect(grid.get_by_role("status")).to_contain_text("Done: 17 requests")
    # The double click made one grid.
    assert capture_count(BROWSER_USER) == before + 2

    header = grid.locator("thead th")
    expect(header).to_have_text(
        ["Layer", "0 The", "1 ·capital", "2 ·of", "3 ·France ·Italy", "4 ·is"], use_inner_text=True
    )
    expect(grid.locator("tbody th")).to_have_text(["0", "12", "29"])
    numbers = json.loads(page.locator("#patching-numbers").text_content())
    reference = reference_grid(numbers)
    tolerance = LOGPROB_TOLERANCE[reference["compute_dtype"]]
    corrupted = reference["corrupted"]
    gap = reference["clean"] - corrupted
    assert gap > 3, "the prompts must differ in the target's logprob for the test to mean much"
    assert abs(numbers["clean_logprob"] - reference["clean"]) <= tolerance
    assert abs(numbers["corrupted_logprob"] - corrupted) <= tolerance
    errors, effect_errors = [], []
    for cell in numbers["cells"]:
        expected = reference["cells"][f"{cell['layer']},{cell['position']}"]
        where = f"layer {cell['layer']}, position {cell['position']}"
        errors.append(abs(cell["logprob"] - expected))
        assert errors[-1] <= tolerance, where
        effect_errors.append(abs(cell["effect"] - (expected - corrupted) / gap))
        # The effect divides differences of logprobs each within `tolerance` by the gap.
        assert effect_errors[-1] <= 3 * tolerance / gap, where
        shown = grid.locator(
            f"td[data-layer='{cell['layer']}'][data-position='{cell['position']}']"
        )
        expect(shown).to_have_text(two_decimals(cell["effect"]))
    # Causal tracing's picture: in early and middle layers the country's position (3) carries
    # the answer; by the last layer only the last position (4) can still change it.
    effect = {(c["layer"], c["position"]): c["effect"] for c in numbers["cells"]}
    assert effect[0, 3] > 0.8 and effect[12, 3] > 0.8 and effect[29, 3] < 0.1
    assert effect[29, 4] > 0.8 and effect[0, 4] < 0.2
    print(
        f"patching grid vs float32 torch hooks ({reference['compute_dtype']} engine): "
        f"max |Δ logprob| {max(errors):.4f} nats, max |Δ effect| {max(effect_errors):.4f}, "
        f"clean {numbers['clean_logprob']:.4f} vs "
        f"{reference['clean']:.4f}, corrupted {numbers['corrupted_logprob']:.4f} vs "
        f"{reference['corrupted']:.4f}"
    )

    cell = grid.locator("td[data-layer='12'][data-position='3'] a")
    cell.click()
    expect(page).to_have_url(f"/playground/runs/{numbers['cells'][8]['run']}/")
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
    group = page.locator(GRID).get_attribute("id").removeprefix("grid-")
    runs = Run.objects.filter(group=group)
    assert not runs.filter(status__in=(RunStatus.QUEUED, RunStatus.RUNNING)).exists()
    # 30 layers × 5 positions + 2 captures: cancelled while capturing, no patched run was
    # created; cancelled later, the queued ones were never sent.
    sent = runs.exclude(error_code="cancelled")
    assert sent.count() < 152
    assert runs.filter(kind=RunKind.PATCHED).count() in (0, 150)
    expect(grid.get_by_role("button", name="Cancel the grid")).to_have_count(0)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"corrupted": "The capital city of Italy is"},
            "#id_patch-corrupted_prompt",
            "The corrupted prompt is 6 tokens and the clean prompt 5",
        ),
        ({"target": " Parisian"}, "#id_patch-target", "The target must be one token; it is 2"),
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
    save_screenshots(page, "patching")
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]
    expect(grid.locator("td[data-position='3'] a").first).to_be_visible()
