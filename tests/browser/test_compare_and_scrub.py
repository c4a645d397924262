"""Two runs compared, and a sweep scrubbed, in a real browser: "compare with…" from a run
page leads to the comparison (token diff, activation difference, then the same-token scoring
through the workers); a sweep's slider changes its text, figure and chart marker in place,
by mouse or keyboard. Both fit a 390 px screen; screenshots at 1280 and 390 px.

Every page a test visits is watched by the `page` fixture (see `conftest.PageWatch`)."""

import io
import re

import numpy as np
import pytest
from playwright.sync_api import expect

from .screenshots import WIDTHS, save_screenshots
from .test_playground import submit_completion
from .test_run_panel import expect_finished

pytestmark = pytest.mark.django_db


def finished_run_id(page, **fields) -> str:
    panel = submit_completion(page, **fields)
    expect_finished(panel)
    expect(panel).to_have_attribute("data-run-status", "succeeded")
    return panel.get_attribute("data-run-id")


def expect_drawn(page, selector):
    expect(page.locator(f"{selector} .main-svg").first).to_be_visible(timeout=60_000)


def fits_the_phone_width(page) -> bool:
    page.set_viewport_size({"width": WIDTHS[-1], "height": 900})
    return page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]


def changed_tokens(page, side: str) -> list[str]:
    return page.locator(f"[data-diff-side='{side}'] .tok.changed").all_text_contents()


def test_compare_with_another_run_shows_the_diff_and_scores_the_same_tokens(page):
    common = {"max_tokens": 3, "temperature": 0, "stream": False, "capture": "all"}
    first = finished_run_id(page, prompt="The Eiffel Tower is in", **common)
    second = finished_run_id(page, prompt="The Eiffel Tower stands in", **common)
    page.goto(f"/playground/runs/{second}/")
    page.get_by_role("link", name="compare with…").click()
    page.locator("select[name=b]").select_option(first)
    page.click("form.compare-pick button[type=submit]")
    expect(page).to_have_url(re.compile(rf"/playground/compare/\?a={second}&b={first}$"))

    assert " stands" in changed_tokens(page, "a") and " is" in changed_tokens(page, "b")
    assert "The" not in changed_tokens(page, "a") + changed_tokens(page, "b")
    expect_drawn(page, "[data-plot='activation-difference']")
    expect(page.get_by_text("Positions are aligned by index, up to the shorter")).to_be_visible()

    # A double click queues the scoring once; the panel follows it until it is done.
    page.get_by_role("button", name="Score on the same tokens").dblclick()
    status = page.locator("[data-comparison-status]")
    pending = re.compile("^(none|queued|running)$")
    expect(status).not_to_have_attribute("data-comparison-status", pending, timeout=120_000)
    assert status.get_attribute("data-comparison-status") == "succeeded", status.inner_text()
    expect_drawn(page, "[data-plot='logprob-a']")
    expect_drawn(page, "[data-plot='logprob-b']")
    expect(page.locator("[data-mean-delta='a']")).to_contain_text("nats/token")
    # The permalink shows the same after a reload.
    page.reload()
    expect_drawn(page, "[data-plot='logprob-b']")
    assert fits_the_phone_width(page)
    save_screenshots(page, "comparison")
    assert fits_the_phone_width(page)


def upload_noise_vector(page, name: str) -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.random.default_rng(1).standard_normal(576).astype(np.float32))
    page.goto("/playground/")
    page.fill("#id_upload-name", name)
    page.fill("#id_upload-layer", "6")
    page.set_input_files(
        "#id_upload-file",
        files=[
            {"name": "n.npy", "mimeType": "application/octet-stream", "buffer": buffer.getvalue()}
        ],
    )
    page.click("#upload-form button[type=submit]")
    expect(page.locator("#vectors table")).to_contain_text(name)


def marked_scale(page):
    return page.locator("[data-plot='sweep']").evaluate(
        "div => (div.layout.shapes || []).filter(s => s.name === 'current-scale').map(s => s.x0)"
    )


def shown_diff_figures(page) -> list[str]:
    return page.locator(".figure[data-figure-name^='diff-']:not([hidden])").evaluate_all(
        "figures => figures.map(f => f.dataset.figureName)"
    )


def test_scrubbing_a_sweep_changes_text_figure_and_marker_without_reloading(page):
    upload_noise_vector(page, "scrub")
    page.goto("/playground/")  # the steering form lists the new vector
    page.locator("#id_steer-vector").select_option(label="scrub (layer 6)")
    page.fill("#id_steer-prompt", "I feel")
    page.fill("#id_steer-scales", "-8, 8, 16")
    page.fill("#id_steer-target_token", " happy")
    page.fill("#id_steer-max_tokens", "4")
    page.click("#steering-form button[type=submit]")
    group = page.locator("#steering-area .group-panel[data-group-kind=sweep]")
    expect(group).to_have_attribute("data-finished", "true", timeout=180_000)
    page.goto(group.get_by_role("link", name="permalink").get_attribute("href"))
    expect_drawn(page, "[data-plot='sweep']")
    steps = page.evaluate(
        "JSON.parse(document.getElementById("
        "document.querySelector('[data-sweep-scrub]').dataset.sweepScrub).textContent)"
    )
    assert [step["scale"] for step in steps] == [-8, 0, 8, 16]
    slider = page.locator("[data-scrub-slider]")
    text = page.locator("[data-scrub-text]")
    url = page.url
    page.evaluate("window.notReloaded = true")

    # It opens at the largest scale.
    expect(slider).to_have_value("3")
    expect(text).to_have_text(steps[3]["text"])
    assert marked_scale(page) == [16] and shown_diff_figures(page) == ["diff-16"]

    # The keyboard: Home goes to the first scale, an arrow to the next.
    slider.focus()
    page.keyboard.press("Home")
    expect(page.locator("[data-scrub-label]")).to_have_text("-8 (steered)")
    expect(text).to_have_text(steps[0]["text"])
    expect(slider).to_have_attribute("aria-valuetext", "-8 (steered)")
    assert marked_scale(page) == [-8] and shown_diff_figures(page) == ["diff--8"]
    expect_drawn(page, "[data-plot='diff--8']")
    page.keyboard.press("ArrowRight")
    expect(page.locator("[data-scrub-summary]")).to_contain_text(
        "The baseline: nothing to compare."
    )
    expect(text).to_have_text(steps[1]["text"])
    assert marked_scale(page) == [0] and shown_diff_figures(page) == []
    expect(page.locator(f".card.current[data-run='{steps[1]['run']}']")).to_be_visible()

    # A value set as a drag sets it (an input event, as from the mouse).
    slider.fill("2")
    expect(text).to_have_text(steps[2]["text"])
    expect(page.locator("[data-scrub-summary]")).to_contain_text("nats/token")
    assert marked_scale(page) == [8] and shown_diff_figures(page) == ["diff-8"]

    assert page.url == url and page.evaluate("window.notReloaded") is True
    assert fits_the_phone_width(page)
    save_screenshots(page, "sweep-scrubbed")
    assert fits_the_phone_width(page)
