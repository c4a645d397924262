"""A run page's figures in a real browser (issue 37, items 4 and 5): each downloads its numbers
as CSV and JSON, checked here against numpy on the run's raw /v1 answer; the token strip's
labels never run into each other, at 1280 or 390 px; and at 390 px the heatmaps fit the
screen with their colour bar on it (they scrolled sideways with the colour bar off-screen).
Every page a test visits is watched by the `page` fixture (console errors fail it)."""

import csv
import io
import json
import math
import re

import numpy as np
import pytest
from playwright.sync_api import expect

from playground.models import Run
from tests.playground.test_figure_numbers import residual_stream

from .conftest import BROWSER_USER
from .screenshots import HEIGHT, WIDTHS
from .test_playground import RUN_PANEL, submit_completion

pytestmark = pytest.mark.django_db

# Long tokens beside short ones: a label that does not fit its cell must not run into the next.
PROMPT = "Internationalization, interoperability and incomprehensibilities of a"


def latest_run() -> Run:
    return Run.objects.filter(user__email=BROWSER_USER).order_by("-created_at").first()


def download(page, figure: str, file_format: str) -> str:
    with page.expect_download() as started:
        page.locator(f"[data-figure-export={file_format}][data-figure={figure}]").first.click()
    return open(started.value.path(), encoding="utf-8").read()


@pytest.fixture
def capture_run(page):
    """A finished capture run with generated tokens' logprobs, on the playground page."""
    panel = submit_completion(
        page, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, stream=False,
        capture="layers", capture_layers="0, 6, 12",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    return latest_run()


def test_figures_download_the_numbers_they_draw(page, capture_run):
    raw = capture_run.response
    expect(page.locator(f"{RUN_PANEL} #plot-heatmap .main-svg").first).to_be_visible()
    rows = list(csv.DictReader(io.StringIO(download(page, "heatmap", "csv"))))
    # ‖h‖ per layer × position, position 0 left out as the figure does, from the raw answer.
    norms = np.linalg.norm(residual_stream(raw), axis=-1)
    layers = [0, 6, 12]
    assert len(rows) == len(layers) * (norms.shape[1] - 1)
    for row in rows:
        layer, position = int(row["layer"]), int(row["position (token)"])
        assert position >= 1
        assert math.isclose(float(row["‖h‖"]), norms[layers.index(layer), position], rel_tol=1e-4)
        assert row["position (token) label"].startswith(f"{position} ")
    # The token strip: each generated token's probability, by its token, from the logprobs.
    document = json.loads(download(page, "tokens", "json"))
    assert document["figure"] == "tokens" and document["title"] == "Tokens by probability"
    generated = [r for r in document["records"] if r["y label"].startswith("completion")]
    logprobs = raw["choices"][0]["logprobs"]
    # Each token's own text (the strip draws its whitespace as · and ⏎).
    assert [r["text"] for r in generated] == logprobs["tokens"]
    assert np.allclose([r["p"] for r in generated], np.exp(logprobs["token_logprobs"]))
    assert [r["position"] for r in generated] == list(
        range(len(capture_run.tokens["prompts"][0]["ids"]), len(document["records"]))
    )


def strip_overlaps(page) -> list:
    """Pairs of labels in one row of the token strip whose text boxes overlap."""
    return page.locator("#plot-tokens").evaluate(
        """div => {
          const boxes = [...div.querySelectorAll('.heatmap-label text')]
            .map(text => ({text: text.textContent, box: text.getBoundingClientRect()}))
            .filter(item => item.text && item.box.width);
          const overlaps = [];
          for (const a of boxes) for (const b of boxes) {
            const sameRow = Math.abs(a.box.top - b.box.top) < 2;
            if (sameRow && a.box.left < b.box.left && a.box.right > b.box.left + 0.5) {
              overlaps.push([a.text, b.text]);
            }
          }
          return overlaps;
        }"""
    )


def shortened_labels(page) -> list[str]:
    return page.locator("#plot-tokens").evaluate(
        """div => [...div.querySelectorAll('.heatmap-label text')]
             .map(text => text.textContent).filter(text => text.endsWith('…'))"""
    )


def expect_strip_fitted(page) -> None:
    """Wait until the strip's labels were fitted to its cells (static/js/playground.js)."""
    expect(page.locator("#plot-tokens")).to_have_attribute("data-cell-chars", re.compile(r"\d"))


def test_token_strip_labels_never_overlap_and_heatmaps_fit_a_phone(page, capture_run):
    expect_strip_fitted(page)
    assert page.locator("#plot-tokens .heatmap-label text").count() == 14
    assert strip_overlaps(page) == []
    # On a phone, from the first draw: half as many cells to a row, each token as far as fits.
    page.set_viewport_size({"width": WIDTHS[-1], "height": HEIGHT})
    page.goto(f"/playground/runs/{capture_run.id}/")
    for name in ("tokens", "heatmap", "cosine", "pca"):
        expect(page.locator(f"#plot-{name} .main-svg").first).to_be_visible()
    expect_strip_fitted(page)
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]
    assert strip_overlaps(page) == []
    shortened = shortened_labels(page)
    assert shortened and all(len(label) > 2 for label in shortened), shortened
    for name in ("heatmap", "cosine", "pca"):
        bar = page.locator(f"#plot-{name} .colorbar").first.bounding_box()
        plot = page.locator(f"#plot-{name}").bounding_box()
        assert bar["x"] >= 0 and bar["x"] + bar["width"] <= WIDTHS[-1], (name, bar)
        assert plot["x"] + plot["width"] <= WIDTHS[-1], (name, plot)
