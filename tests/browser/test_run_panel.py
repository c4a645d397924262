"""The playground's Run panel as a person uses it at 1280×900: it comes into view on submit,
a form error stays in view, capture switches streaming off, a reload or Back keeps the run,
tokens with quotes and markup are shown as typed, and a streamed run's timings are real."""

import io
import re

import numpy as np
import pytest
from playwright.sync_api import expect

from playground.plots import STRIP_WIDTH

from .test_playground import RUN_PANEL, run_panel_after, submit_completion

pytestmark = pytest.mark.django_db

DESKTOP = {"width": 1280, "height": 900}
SEND = "#completion-form button[type=submit]"
STEER = "#steering-form button[type=submit]"


def scroll_to_bottom_of_view(page, selector):
    """Scroll as a person does to reach a button far down the page: until it shows at the
    bottom edge."""
    page.locator(selector).evaluate("button => button.scrollIntoView({block: 'end'})")


def playground_at_desktop_size(page):
    page.set_viewport_size(DESKTOP)
    page.goto("/playground/")


def expect_finished(panel):
    """Wait for the finished run's panel: reloaded, with its stored output and timings, after
    its event stream ended (its status changes a moment before)."""
    expect(panel.get_by_role("button", name="Re-run")).to_be_visible(timeout=60_000)


def test_sending_brings_the_run_panel_into_view(page):
    playground_at_desktop_size(page)
    page.fill("#id_prompt", "Hello")
    page.fill("#id_max_tokens", "2")
    scroll_to_bottom_of_view(page, SEND)
    panel = run_panel_after(page, lambda: page.click(SEND))
    expect(panel.locator("[data-run-badge]")).to_be_in_viewport()
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=60_000)
    expect(panel.locator("[data-choice-output='0']")).to_be_in_viewport()


def upload_vector(page, name: str) -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.full(576, 0.1, dtype=np.float32))
    page.fill("#id_upload-name", name)
    page.fill("#id_upload-layer", "4")
    page.set_input_files(
        "#id_upload-file",
        files=[
            {"name": "v.npy", "mimeType": "application/octet-stream", "buffer": buffer.getvalue()}
        ],
    )
    page.click("#upload-form button[type=submit]")
    expect(page.locator("#vectors table")).to_contain_text(name)


def test_steering_and_sweep_bring_their_runs_into_view_and_stay_after_reload(page):
    playground_at_desktop_size(page)
    upload_vector(page, "in-view")
    page.goto("/playground/")  # the steering form lists the new vector
    page.locator("#id_steer-vector").select_option(label="in-view (layer 4)")
    page.fill("#id_steer-prompt", "I think that")
    page.fill("#id_steer-max_tokens", "2")
    for scales, runs in (("2", 2), ("2, 4", 3)):
        page.fill("#id_steer-scales", scales)
        scroll_to_bottom_of_view(page, STEER)
        page.click(STEER)
        cards = page.locator("#steering-area .group-panel .card")
        expect(cards).to_have_count(runs)
        expect(cards.first).to_be_in_viewport(ratio=1)
        expect(page.locator("#steering-area .group-panel")).to_have_attribute(
            "data-finished", "true", timeout=60_000
        )
        expect(cards.first.locator(".output")).to_be_in_viewport()
    # A reload keeps the sweep, drawn.
    page.reload()
    expect(page.locator("#steering-area .group-panel .card")).to_have_count(3)
    expect(page.locator("#steering-area #plot-sweep .main-svg").first).to_be_visible()


def test_a_validation_error_stays_in_view(page):
    playground_at_desktop_size(page)
    page.fill("#id_prompt", "Hello")
    page.fill("#id_max_tokens", "99999")
    page.click(SEND)  # Playwright scrolls the button to the middle of the view first
    error = page.locator("#completion-form .errorlist")
    expect(error).to_contain_text("output-work cap")
    expect(error).to_be_in_viewport(ratio=1)
    expect(page.locator("#id_max_tokens")).to_be_focused()
    expect(page.locator("#history-heading")).not_to_be_in_viewport()


def test_choosing_capture_switches_streaming_off_with_a_note(page):
    playground_at_desktop_size(page)
    page.fill("#id_prompt", "The Eiffel Tower is in")
    page.fill("#id_max_tokens", "1")
    note = page.locator("[data-stream-off-note]")
    expect(page.locator("#id_stream")).to_be_checked()
    expect(note).to_be_hidden()
    page.locator("#id_capture").select_option("all")
    expect(page.locator("#id_stream")).not_to_be_checked()
    expect(note).to_be_visible()
    expect(note).to_contain_text("Streaming is now off")
    panel = run_panel_after(page, lambda: page.click(SEND))
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=60_000)
    expect(panel.locator("#plot-heatmap .main-svg").first).to_be_visible()


def test_reloading_mid_run_shows_the_run_streaming_to_its_end(page):
    submit_completion(page, prompt="Once upon a time", max_tokens=64, temperature=0, stream=True)
    panel = page.locator(RUN_PANEL)
    output = panel.locator("[data-live-output]")
    expect(output).not_to_be_empty(timeout=60_000)
    run_id = panel.get_attribute("data-run-id")
    partial = output.text_content()

    reloaded = page.reload()
    # The page itself shows the run, still running, following its event stream.
    html = reloaded.text()
    assert f'data-run-id="{run_id}"' in html and "data-events-url" in html
    expect(panel).to_have_attribute("data-run-id", run_id)
    expect_finished(panel)
    final = panel.locator("[data-choice-output='0']").text_content()
    assert final.startswith(partial) and len(final) > len(partial)


def test_back_from_the_run_page_shows_the_last_run(page):
    panel = submit_completion(page, prompt="Hello", max_tokens=2, stream=False)
    expect_finished(panel)
    run_id = panel.get_attribute("data-run-id")
    text = panel.locator("[data-choice-output='0']").text_content()
    panel.get_by_role("link", name="permalink").click()
    expect(page).to_have_url(re.compile(f"/playground/runs/{run_id}/$"))
    page.go_back()
    expect(page).to_have_url(re.compile("/playground/$"))
    expect(panel).to_have_attribute("data-run-id", run_id)
    expect(panel).to_have_attribute("data-run-status", "succeeded")
    expect(panel.locator("[data-choice-output='0']")).to_have_text(text)


def test_streamed_run_shows_the_upstream_server_timing(page):
    panel = submit_completion(page, prompt="Hello", max_tokens=3, stream=True)
    expect_finished(panel)
    upstream = panel.locator("table.timings th", has_text="Upstream").locator(
        "xpath=following-sibling::td[1]"
    )
    milliseconds = re.fullmatch(r"([\d,.]+) ms", upstream.text_content().strip())
    assert milliseconds, upstream.text_content()
    assert float(milliseconds.group(1).replace(",", "")) > 0


QUOTED_PROMPT = 'He said "a<b" & left'
ESCAPED = ("&quot;", "&lt;", "&gt;", "&amp;", "&#")


def shown_text(page, selector) -> str:
    """The text a plot shows (its SVG's text, entities already decoded by the browser)."""
    return page.locator(f"{selector} .main-svg").first.text_content()


def test_tokens_with_quotes_and_markup_are_shown_as_typed(page):
    panel = submit_completion(
        page, prompt=QUOTED_PROMPT, max_tokens=1, temperature=0, logprobs=3, prompt_logprobs=3,
        stream=False, capture="all",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=60_000)
    for name in ("tokens", "heatmap", "cosine", "pca", "topk", "norm_by_layer"):
        expect(panel.locator(f"#plot-{name} .main-svg").first).to_be_visible()
        shown = shown_text(page, f"{RUN_PANEL} #plot-{name}")
        assert not any(entity in shown for entity in ESCAPED), (name, shown)
    cells = shown_text(page, f"{RUN_PANEL} #plot-tokens")
    assert '"' in cells and "<" in cells and "&" in cells
    positions = page.locator(f"{RUN_PANEL} #plot-heatmap .xtick text").all_text_contents()
    assert any('"' in label for label in positions), positions
    assert any("<" in label for label in positions), positions

    # Hover the first prompt cell holding a quote: its token is shown as typed there too.
    strip = page.locator(f"{RUN_PANEL} #plot-tokens")
    # As drawn: as many cells to a row as fit the panel (at most STRIP_WIDTH).
    row, column, rows, columns = strip.evaluate(
        """div => {
          const text = div.data[0].text;
          const row = text.findIndex(cells => cells.some(cell => cell.includes('"')));
          return [row, text[row].findIndex(cell => cell.includes('"')), text.length,
                  text[0].length];
        }"""
    )
    assert columns <= STRIP_WIDTH
    area = strip.locator(".nsewdrag").first
    area.scroll_into_view_if_needed()
    box = area.bounding_box()
    area.hover(
        position={
            "x": box["width"] * (column + 0.5) / columns,
            "y": box["height"] * (row + 0.5) / rows,
        }
    )
    hover = strip.locator(".hoverlayer .hovertext")
    expect(hover).to_contain_text('"')
    assert not any(entity in hover.text_content() for entity in ESCAPED)


# Records every text the run badges show, from the page's first script on.
BADGE_RECORDER = """
window.badgeTexts = [];
new MutationObserver(() => document.querySelectorAll("[data-run-badge]").forEach(
    (badge) => window.badgeTexts.push(badge.textContent.trim())
)).observe(document, {subtree: true, childList: true, characterData: true});
"""


def test_a_run_that_ends_at_once_says_why_and_the_live_badge_reads_as_everywhere(page):
    page.add_init_script(BADGE_RECORDER)
    # Greedy after "Once upon a time" the first token holds one of these stop strings.
    panel = submit_completion(
        page, prompt="Once upon a time", max_tokens=16, temperature=0, stop=" \n,\n.",
        stream=True,
    )  # fmt: skip
    expect_finished(panel)
    expect(panel.locator("[data-empty-choice]")).to_contain_text(
        "the model stopped at its first token"
    )
    expect(panel.locator(".timings")).to_contain_text(re.compile(r"\d{2}:\d{2}:\d{2} UTC"))
    shown = set(page.evaluate("window.badgeTexts"))
    assert "Running" in shown and shown <= {"Queued", "Running", "Succeeded"}, shown
