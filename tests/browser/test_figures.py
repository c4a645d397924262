"""Playground figures in a real browser: a figure swapped in for a new position, layer or
choice looks exactly like the first-rendered one, and the sweep figures show what was asked.

Every page a test visits is watched by the `page` fixture (see `conftest.PageWatch`)."""

import html
import re

import numpy as np
import pytest
from playwright.sync_api import expect

from .test_playground import RUN_PANEL, submit_completion

pytestmark = pytest.mark.django_db


def plot_geometry(page, selector):
    """Where a drawn plot's parts are, and whether plotly's CSS applies to it."""
    return page.locator(selector).evaluate(
        """div => {
          const box = e => e && e.getBoundingClientRect();
          const plot = box(div), title = box(div.querySelector('.gtitle'));
          const area = box(div.querySelector('.nsewdrag'));
          return {
            scoped: div.classList.contains('js-plotly-plot'),
            height: Math.round(plot.height),
            titleAboveArea: !!title && title.bottom <= area.top,
            titleInside: !!title && title.top >= plot.top && title.bottom <= plot.bottom,
            modebarButtonHeight: Math.max(0, ...[...div.querySelectorAll('.modebar-btn')]
              .map(b => b.getBoundingClientRect().height)),
          };
        }"""
    )


def expect_drawn(page, selector):
    expect(page.locator(f"{selector} .main-svg").first).to_be_visible(timeout=60_000)


def test_figures_swapped_in_look_like_the_first_rendered_ones(page):
    panel = submit_completion(
        page, prompt="The Eiffel Tower is in", max_tokens=4, temperature=0, stream=False,
        logprobs=5, prompt_logprobs=3, capture="all",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    for name in ("topk", "norm_by_layer", "cosine"):
        expect_drawn(page, f"{RUN_PANEL} #plot-{name}")
    first = {
        name: plot_geometry(page, f"{RUN_PANEL} #plot-{name}")
        for name in ("topk", "norm_by_layer", "cosine")
    }
    assert all(g["scoped"] and g["titleAboveArea"] for g in first.values())

    # Re-pick each figure: a top-k position, a norm position, a cosine layer.
    page.locator(f"{RUN_PANEL} [data-picker='topk']").select_option("2")
    page.locator(f"{RUN_PANEL} select[name=norm_position]").select_option("0")
    page.locator(f"{RUN_PANEL} select[name=cosine_row]").select_option("3")
    expect(page.locator(f"{RUN_PANEL} #plot-topk .gtitle")).to_contain_text("position 2")
    expect(page.locator(f"{RUN_PANEL} #plot-norm_by_layer .gtitle")).to_contain_text("position 0")
    expect(page.locator(f"{RUN_PANEL} #plot-cosine .gtitle")).to_contain_text("layer 3")
    # Let htmx finish settling the last swap before measuring.
    page.wait_for_timeout(500)
    for name, before in first.items():
        after = plot_geometry(page, f"{RUN_PANEL} #plot-{name}")
        assert after["scoped"], name
        assert after["titleAboveArea"] and after["titleInside"], (name, after)
        assert after["modebarButtonHeight"] < 40, (name, after)
        if name != "topk":
            assert after["height"] == before["height"], (name, before, after)

    # Clicking a token (the second cell: position 1) selects its top-k, drawn the same way.
    plot = page.locator(f"{RUN_PANEL} #plot-tokens")
    columns = plot.evaluate("div => div.data[0].text[0].length")
    strip = plot.locator(".nsewdrag").first
    strip.scroll_into_view_if_needed()
    box = strip.bounding_box()
    strip.click(position={"x": box["width"] * 1.5 / columns, "y": box["height"] * 0.2})
    expect(page.locator(f"{RUN_PANEL} #plot-topk .gtitle")).to_contain_text("position 1")
    page.wait_for_timeout(500)
    after = plot_geometry(page, f"{RUN_PANEL} #plot-topk")
    assert after["scoped"] and after["titleAboveArea"], after


def sweep(page, *, vector_label, scale_unit, scales, target):
    """Submit a sweep of `vector_label` and wait for its figures."""
    page.locator("#id_steer-vector").select_option(label=vector_label)
    page.fill("#id_steer-prompt", "I feel")
    page.locator("#id_steer-scale_unit").select_option(scale_unit)
    page.fill("#id_steer-scales", scales)
    page.fill("#id_steer-target_token", target)
    page.fill("#id_steer-max_tokens", "3")
    page.click("#steering-form button[type=submit]")
    group = page.locator("#steering-area .group-panel")
    expect(group).to_have_attribute("data-finished", "true", timeout=120_000)
    expect_drawn(page, "#steering-area [data-plot='sweep']")
    return group


def sweep_traces(page) -> dict:
    return page.locator("#steering-area [data-plot='sweep']").evaluate(
        "div => Object.fromEntries(div.data.map(t => [t.name, {x: t.x, y: t.y}]))"
    )


def test_sweep_plots_the_target_logprob_even_outside_the_top_k(page, tmp_path):
    page.goto("/playground/")
    vector = tmp_path / "noise.npy"
    np.save(vector, np.random.default_rng(0).standard_normal(576).astype(np.float32))
    page.fill("#id_upload-name", "noise")
    page.fill("#id_upload-layer", "6")
    page.set_input_files("#id_upload-file", vector)
    page.click("#upload-form button[type=submit]")
    expect(page.locator("#vectors table")).to_contain_text("noise")
    page.goto("/playground/")  # the steering form lists the new vector
    sweep(page, vector_label="noise (layer 6)", scale_unit="absolute", scales="-8, 8, 16",
          target=" happy")  # fmt: skip
    traces = sweep_traces(page)
    target = traces["logprob of ·happy (left)"]
    assert target["x"] == [-8, 0, 8, 16]
    assert len(target["y"]) == 4 and all(isinstance(y, float) and y < 0 for y in target["y"])


def test_sweep_in_typical_norms_shows_the_scales_as_entered(page):
    page.goto("/playground/")
    page.fill("#id_contrast-name", "mood")
    page.fill("#id_contrast-layer", "8")
    page.fill("#id_contrast-positive", "Joy, delight, happiness")
    page.fill("#id_contrast-negative", "Grief, sorrow, sadness")
    page.click("#contrast-form button[type=submit]")
    expect(page.locator("#steering-area .vector-ready")).to_be_visible(timeout=120_000)
    group = sweep(page, vector_label="mood (layer 8)", scale_unit="typical",
                  scales="-1.5, 0.75, 3", target=" happy")  # fmt: skip
    titles = group.locator(".card h3").all_text_contents()
    assert sorted(titles) == [
        "Baseline (scale 0)",
        "Steered, scale -1.5 × typical norm",
        "Steered, scale 0.75 × typical norm",
        "Steered, scale 3 × typical norm",
    ]
    traces = sweep_traces(page)
    assert traces["mean Δ logprob, baseline's tokens (right)"]["x"] == [-1.5, 0, 0.75, 3]
    axis = page.locator("#steering-area [data-plot='sweep'] .xtitle")
    expect(axis).to_contain_text("scale (× layer 8's typical norm, ‖h‖ = ")
    ticks = page.locator("#steering-area [data-plot='sweep'] .xtick text").all_text_contents()
    assert all(len(tick.replace("−", "").replace("-", "").replace(".", "")) <= 3 for tick in ticks)
    diff_titles = page.locator("#steering-area [data-plot^='diff-'] .gtitle").all_text_contents()
    assert sorted(diff_titles) == sorted(
        f"Same tokens under both models, scale {s} × typical norm" for s in ("-1.5", "0.75", "3")
    )


def test_every_choice_has_its_token_view_with_rows_labelled_by_offset(page):
    panel = submit_completion(
        page, prompt="My favourite animal is", max_tokens=20, n=3, temperature=1, seed=7,
        logprobs=3, prompt_logprobs=2, stream=False,
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    expect_drawn(page, f"{RUN_PANEL} #plot-tokens")
    rows = page.locator(f"{RUN_PANEL} #plot-tokens .ytick text").all_text_contents()
    # Rows are named by the positions they start and end at, not numbered per choice.
    assert rows[0].startswith("prompt #0") and len(rows) >= 2
    assert all(re.fullmatch(r"(prompt|completion) #\d+(–\d+)?", row) for row in rows), rows
    first_cells = strip_cells(page)

    page.locator(f"{RUN_PANEL} [data-choice-select]").select_option("2")
    expect(page.locator(f"{RUN_PANEL} [data-choice-select]")).to_have_value("2")
    expect_drawn(page, f"{RUN_PANEL} #plot-tokens")
    page.wait_for_timeout(500)
    chosen = page.locator(f"{RUN_PANEL} [data-choice-output='2']").text_content()
    cells = strip_cells(page)
    assert cells != first_cells
    shown = html.escape(chosen.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "·"))
    assert shown.startswith(cells[0])
    # Top-k of that choice: picking a position shows the token chosen there.
    picker = page.locator(f"{RUN_PANEL} [data-picker='topk']")
    option = picker.locator("option").nth(3)
    picker.select_option(option.get_attribute("value"))
    title = page.locator(f"{RUN_PANEL} #plot-topk .gtitle")
    expect(title).to_contain_text(f"position {option.get_attribute('value')}")
    assert plot_geometry(page, f"{RUN_PANEL} #plot-tokens")["scoped"]


# The token strip as the page embeds it (each cell's whole token: a drawn cell shows only as
# much as fits it, see test_figure_exports).
STRIP = f"JSON.parse(document.querySelector('{RUN_PANEL} #tokens').textContent)"


def strip_cells(page) -> list[str]:
    """The token strip's completion cells, in order (whitespace made visible)."""
    return page.evaluate(
        f"""() => {{
          const figure = {STRIP};
          const trace = figure.data[0], names = figure.layout.yaxis.ticktext;
          return trace.text.filter((row, i) => names[i].startsWith('completion'))
            .flat().filter(cell => cell !== '');
        }}"""
    )


def test_capture_positions_are_labelled_with_their_tokens_without_echo(page):
    # Neither echo nor prompt_logprobs: the page still knows the prompt's tokens.
    panel = submit_completion(
        page, prompt="The quick brown fox jumps over the lazy dog", max_tokens=5,
        temperature=0, logprobs=2, stream=False, capture="all",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    expect_drawn(page, f"{RUN_PANEL} #plot-heatmap")
    generated = strip_cells(page)
    # Rows 0–8 are the prompt (position 0 left out by default), 9–12 the generated tokens
    # fed back; the last generated token has no row.
    ticks = page.locator(f"{RUN_PANEL} #plot-heatmap .xtick text").all_text_contents()
    assert ticks[:8] == ["1 ·quick", "2 ·brown", "3 ·fox", "4 ·jumps", "5 ·over", "6 ·the",
                         "7 ·lazy", "8 ·dog"]  # fmt: skip
    assert ticks[8:] == [f"{9 + index} {token}" for index, token in enumerate(generated[:4])]
    assert len(ticks) == 12
    # With the first token included, position 0 is the prompt's first token.
    page.locator(f"{RUN_PANEL} [data-first-token]").select_option("include")
    expect(page.locator(f"{RUN_PANEL} #plot-heatmap .xtick text").first).to_have_text("0 The")
    pca = page.locator(f"{RUN_PANEL} #plot-pca .textpoint text").all_text_contents()
    assert "0 The" in pca and "9 " + generated[0] in pca
