"""The playground in a real browser, through the real gateway, worker and engine."""

import pytest
from playwright.sync_api import expect

# Asks pytest-django for the test database; the data the servers see is seeded (committed)
# once per session by the `system` fixture, outside the test's transaction.
pytestmark = pytest.mark.django_db

RUN_PANEL = "#run-area .run-panel"


def run_panel_after(page, submit):
    """The Run panel once `submit()`, a click that creates a run, has put the new run in it:
    the page opens showing the user's latest run, which must not be taken for the new one."""
    panel = page.locator(RUN_PANEL)
    shown = panel.evaluate_all("panels => panels.map(panel => panel.dataset.runId)")
    submit()
    for run_id in shown:
        expect(panel).not_to_have_attribute("data-run-id", run_id)
    return panel


def submit_completion(page, *, prompt, **fields):
    page.goto("/playground/")
    page.fill("#id_prompt", prompt)
    for name, value in fields.items():
        locator = page.locator(f"#id_{name}")
        if isinstance(value, bool):
            locator.set_checked(value)
        elif locator.evaluate("e => e.tagName") == "SELECT":
            locator.select_option(value)
        else:
            locator.fill(str(value))
    return run_panel_after(page, lambda: page.click("#completion-form button[type=submit]"))


def test_streamed_tokens_arrive_before_the_run_finishes_and_the_token_view_hovers(page):
    # Prompt logprobs come with a whole answer only (vLLM refuses them streamed).
    panel = submit_completion(
        page, prompt="Once upon a time", max_tokens=40, temperature=0, logprobs=5, stream=True,
    )  # fmt: skip
    output = page.locator(f"{RUN_PANEL} [data-live-output]")
    expect(output).not_to_be_empty(timeout=60_000)
    # The first tokens are on the page while the run is still running.
    assert panel.get_attribute("data-run-status") == "running"
    partial = output.text_content()
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    final = page.locator(f"{RUN_PANEL} [data-choice-output='0']").text_content()
    assert len(partial) < len(final) and final.startswith(partial)

    strip = page.locator(f"{RUN_PANEL} #plot-tokens")
    expect(strip.locator(".main-svg").first).to_be_visible()
    drag = strip.locator(".nsewdrag").first
    drag.scroll_into_view_if_needed()
    box = drag.bounding_box()
    # The first cell of the last row (generated), then the one next to it.
    drag.hover(position={"x": box["width"] * 0.04, "y": box["height"] * 0.9})
    drag.hover(position={"x": box["width"] * 0.12, "y": box["height"] * 0.9})
    hover = strip.locator(".hoverlayer .hovertext")
    expect(hover).to_contain_text("logprob")
    expect(hover).to_contain_text("rank")
    expect(page.locator(f"{RUN_PANEL} #plot-topk .main-svg").first).to_be_visible()


def test_capture_shows_the_norm_heatmap(page):
    panel = submit_completion(
        page, prompt="The Eiffel Tower is in", max_tokens=1, temperature=0, stream=False,
        capture="all",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    heatmap = page.locator(f"{RUN_PANEL} #plot-heatmap")
    expect(heatmap.locator(".main-svg").first).to_be_visible()
    expect(heatmap).to_contain_text("Residual-stream norm")
    expect(page.locator(f"{RUN_PANEL} #plot-pca .main-svg").first).to_be_visible()
    expect(page.get_by_role("link", name="Download the capture")).to_be_visible()


def test_contrast_vector_steers_against_the_baseline(page):
    page.goto("/playground/")
    page.fill("#id_contrast-name", "wedding")
    page.fill("#id_contrast-layer", "8")
    page.fill("#id_contrast-positive", "Love, wedding, bride, marriage")
    page.fill("#id_contrast-negative", "Hate, war, anger, fight")
    page.click("#contrast-form button[type=submit]")
    expect(page.locator("#steering-area .vector-ready")).to_be_visible(timeout=90_000)
    # The library and the steering form reload with the new vector.
    expect(page.locator("#vectors table")).to_contain_text("wedding")
    page.locator("#id_steer-vector").select_option(label="wedding (layer 8)")
    page.fill("#id_steer-prompt", "I think that")
    page.fill("#id_steer-scales", "6")
    page.fill("#id_steer-max_tokens", "8")
    page.click("#steering-form button[type=submit]")
    # Not the finished contrast panel that the steering answer replaces.
    group = page.locator("#steering-area .group-panel:not([data-group-kind=contrast])")
    expect(group).to_have_attribute("data-finished", "true", timeout=90_000)
    expect(group).to_contain_text("Baseline (scale 0)")
    expect(group).to_contain_text("Steered, scale 6")
    expect(group.locator(".output")).to_have_count(2)
    expect(group.locator("[data-plot='diff-6'] .main-svg").first).to_be_visible()
