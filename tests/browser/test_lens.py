"""The logit lens and direct logit attribution of a capture run in a real browser: drawn on the
run's page, re-picked through their form (a typed target and foil, the target's colours), a
typed text that is not one token named next to its field; screenshots of the section at 1280
and 390 px. Every page is watched for console errors (`conftest.PageWatch`)."""

import pytest
from playwright.sync_api import expect

from .screenshots import WIDTHS, save_screenshots
from .test_figures import expect_drawn
from .test_playground import RUN_PANEL, submit_completion

pytestmark = pytest.mark.django_db

SECTION = "section.lens"
FIGURES = ("lens", "lens_rank", "dla")


def assert_written(paths, name):
    assert [path.name for path in paths] == [f"{name}-{width}.png" for width in WIDTHS]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in paths)


def test_lens_and_attribution_are_drawn_and_re_picked(page):
    panel = submit_completion(
        page, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=5,
        stream=False, capture="all",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    page.goto(f"/playground/runs/{panel.get_attribute('data-run-id')}/")
    for name in FIGURES:
        expect_drawn(page, f"#plot-{name}")
    layers = page.locator("#plot-lens .ytick text").all_text_contents()
    assert layers[0] == "0" and layers[-1] == "29"
    ticks = page.locator("#plot-lens .xtick text").all_text_contents()
    assert ticks[:4] == ["1 ·capital", "2 ·of", "3 ·France", "4 ·is"]
    expect(page.locator("#plot-dla .gtitle")).to_contain_text("Direct logit attribution of")
    expect(page.locator("[data-dla-residue]")).to_contain_text("nats")
    assert_written(save_screenshots(page, "logit-lens", SECTION), "logit-lens")

    page.set_viewport_size({"width": WIDTHS[0], "height": 900})
    page.fill("#id_lens-target", "·Paris")
    page.fill("#id_lens-foil", "·London")
    page.locator("#id_lens-colour").select_option("target")
    page.locator(f"{SECTION} button[type=submit]").click()
    expect(page.locator("#plot-lens .gtitle")).to_contain_text("logprob of ·Paris")
    expect(page.locator("#plot-lens_rank .gtitle")).to_contain_text("Rank of ·Paris")
    expect(page.locator("#plot-dla .gtitle")).to_contain_text("logit(·Paris) − logit(·London)")
    for name in FIGURES:
        expect_drawn(page, f"#plot-{name}")
    assert_written(save_screenshots(page, "logit-lens-picked", SECTION), "logit-lens-picked")

    page.set_viewport_size({"width": WIDTHS[0], "height": 900})
    page.fill("#id_lens-target", "Paris is")
    page.locator(f"{SECTION} button[type=submit]").click()
    expect(page.locator(f"{SECTION} .errorlist")).to_contain_text("'Paris is' is 2 tokens")
    expect_drawn(page, "#plot-lens")


def test_run_panel_on_the_playground_page_draws_the_lens(page):
    panel = submit_completion(
        page, prompt="One, two, three,", max_tokens=3, temperature=0, logprobs=2,
        stream=False, capture="all",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    for name in FIGURES:
        expect_drawn(page, f"{RUN_PANEL} #plot-{name}")
