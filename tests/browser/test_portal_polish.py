"""What a person notices on the portal pages, in a real browser: the harvest form sends the
layers ticked and no others; the Jobs page's plot link shows the chart without a reload;
filtered usage views are URLs that reload and the back button restore; confirmations appear
in the card clicked (test_portal_pages.py has the staff decisions); revoking asks first; the
audit log reads as field: before → after; dates are typed as the pages print them; plotly's
mode bar leaves every title readable at phone width.

Every page a test visits is watched (see `conftest.PageWatch`): a console error fails it."""

import datetime as dt
import re
import uuid

import pytest
from playwright.sync_api import expect

from accounts.models import ApiKey, KeyStatus

from .conftest import BROWSER_USER
from .test_playground import RUN_PANEL, submit_completion

pytestmark = pytest.mark.django_db

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
IN_VIEW = """e => { const box = e.getBoundingClientRect();
                    return box.top >= 0 && box.bottom <= window.innerHeight; }"""
# Set on the page's window: still there later means the page was not loaded again.
MARK_THE_PAGE = "() => { window.notReloaded = true; }"
SAME_PAGE = "() => window.notReloaded === true"


def expect_in_view(locator):
    expect(locator).to_be_visible()
    assert locator.evaluate(IN_VIEW), "not in the view"


def finished_harvest(page, *, prompt: str) -> str:
    """Submit a one-prompt harvest of layers 1 and 2 on the Jobs page; its id once done."""
    page.goto("/jobs/")
    page.fill("#id_harvest-prompts", prompt)
    for layer in ("1", "2"):
        page.check(f"input[name='harvest-layers'][value='{layer}']")
    rows = page.locator("#harvest-jobs tbody tr")
    before = rows.count()
    page.click("#harvest-job-form button[type=submit]")
    expect(rows).to_have_count(before + 1, timeout=60_000)
    expect(rows.first).to_contain_text("Done", timeout=180_000)
    return rows.first.get_attribute("data-job-id")


def create_key(page, name: str):
    page.goto("/keys/")
    page.fill("#id_name", name)
    page.click("#key-list section.card button[type=submit]")
    card = page.locator("article.key", has_text=name)
    expect(card).to_be_visible()
    return card


# ---------------------------------------------------------------------------------------
# (a) The harvest form


def test_the_harvest_form_sends_exactly_the_layers_ticked(harvest_page):
    page = harvest_page
    page.goto("/jobs/")
    boxes = page.locator("input[name='harvest-layers']")
    expect(boxes).to_have_count(30)
    assert boxes.evaluate_all("boxes => boxes.filter(box => box.checked).length") == 0
    expect(page.locator("#id_harvest-layers_helptext")).to_contain_text(
        "None ticked: the API's default, layers 7, 15, 22"
    )
    page.fill("#id_harvest-prompts", "Layers exactly as ticked.")
    for layer in ("0", "12", "29"):
        page.check(f"input[name='harvest-layers'][value='{layer}']")
    rows = page.locator("#harvest-jobs tbody tr")
    before = rows.count()
    page.click("#harvest-job-form button[type=submit]")
    expect(rows).to_have_count(before + 1, timeout=60_000)
    expect(rows.first.locator("td").nth(2)).to_have_text("0, 12, 29")


# ---------------------------------------------------------------------------------------
# (b) The Jobs page's plot link


def test_the_plot_link_brings_the_chart_into_view_without_a_reload(harvest_page):
    page = harvest_page
    older = finished_harvest(page, prompt="The older harvest.")
    newer = finished_harvest(page, prompt="The newer harvest.")
    page.set_viewport_size(DESKTOP)
    page.goto("/jobs/")
    chart = page.locator("#harvest-norm-chart")
    expect(chart).to_have_attribute("aria-label", re.compile(newer))
    page.evaluate(MARK_THE_PAGE)
    link = page.locator(f"#harvest-jobs tr[data-job-id='{older}'] a", has_text="plot")
    link.click()
    expect(chart).to_have_attribute("aria-label", re.compile(older))
    expect(chart.locator(".main-svg").first).to_be_visible()
    page.wait_for_timeout(300)  # htmx scrolls once the swap has settled
    expect_in_view(chart.locator(".gtitle"))
    assert page.evaluate(SAME_PAGE), "the plot link loaded the page again"
    assert page.url.endswith(f"/jobs/?plot={older}#harvest-norm-chart")
    # The URL is the view: a reload plots the same job, at the chart.
    page.reload()
    expect(chart).to_have_attribute("aria-label", re.compile(older))
    expect(chart.locator(".main-svg").first).to_be_visible()
    expect_in_view(chart.locator(".gtitle"))


# ---------------------------------------------------------------------------------------
# (c) Filtered usage views are URLs


def usage_range_shown(page) -> tuple[str, str]:
    """The range the form shows, and the first day the summary names."""
    summary = page.locator("#results p", has_text="whole UTC days").text_content()
    return page.locator("#id_range").input_value(), summary.split()[1]


def expect_whole_usage_page(page):
    """The page with its site header and its charts drawn live (not a bare fragment, and not
    a copy of dead chart markup)."""
    expect(page.locator("header.site")).to_be_visible()
    chart = page.locator("[data-figure='usage-figure-tokens']")
    expect(chart.locator(".main-svg").first).to_be_visible()
    assert chart.evaluate("div => Array.isArray(div.data) && !!div._fullLayout")


def test_a_filtered_usage_view_is_a_url_that_reload_and_back_restore(page):
    page.set_viewport_size(DESKTOP)
    today = dt.datetime.now(dt.UTC).date()
    week_start = (today - dt.timedelta(days=6)).isoformat()
    month_start = (today - dt.timedelta(days=29)).isoformat()
    page.goto("/usage/")
    expect_whole_usage_page(page)
    assert usage_range_shown(page) == ("30", month_start)

    page.select_option("#id_range", "7")
    page.click("#results button[type=submit]")
    expect(page).to_have_url(re.compile(r"/usage/\?range=7"))
    expect(page.locator("#results p", has_text="whole UTC days")).to_contain_text(week_start)
    expect_whole_usage_page(page)
    bookmark = page.url

    page.reload()
    assert usage_range_shown(page) == ("7", week_start)
    expect_whole_usage_page(page)

    # Away and back: the filtered page again, whole.
    page.goto("/keys/")
    page.go_back()
    expect(page).to_have_url(bookmark)
    expect_whole_usage_page(page)
    assert usage_range_shown(page) == ("7", week_start)

    # Back within the page (htmx's pushed entry): the unfiltered view, charts live.
    page.select_option("#id_range", "90")
    page.click("#results button[type=submit]")
    expect(page).to_have_url(re.compile(r"/usage/\?range=90"))
    page.go_back()
    expect(page).to_have_url(bookmark)
    expect(page.locator("#id_range")).to_have_value("7")
    expect_whole_usage_page(page)
    assert usage_range_shown(page) == ("7", week_start)
    page.go_forward()
    expect(page.locator("#id_range")).to_have_value("90")
    expect_whole_usage_page(page)

    # The request log's filters too.
    page.goto("/usage/requests/")
    page.fill("#id_status", "4xx")
    page.click("#log button[type=submit]")
    expect(page).to_have_url(re.compile(r"/usage/requests/\?status=4xx"))
    page.goto("/keys/")
    page.go_back()
    expect(page.locator("header.site")).to_be_visible()
    expect(page.locator("#id_status")).to_have_value("4xx")


# ---------------------------------------------------------------------------------------
# (e) Budgets and revocation confirm; revoking asks first


def test_saving_budgets_and_revoking_confirm_in_the_keys_card(page):
    page.set_viewport_size(PHONE)
    name = f"notice {uuid.uuid4().hex[:6]}"
    card = create_key(page, name)
    card.locator("summary", has_text="Budgets").click()
    card.locator("input[name$='-daily_token_budget']").fill("1234")
    card.locator("button", has_text="Save budgets").click()
    notice = card.locator(".notice")
    expect(notice).to_have_text(f"Budgets of “{name}” saved.")
    expect_in_view(notice)
    key = ApiKey.objects.get(user__email=BROWSER_USER, name=name)
    assert key.daily_token_budget == 1234

    questions = []
    page.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.dismiss()))
    card.locator("a", has_text="Revoke").click()
    assert questions == [
        f"Revoke “{name}” for good? Programs using it stop working; this cannot be undone."
    ]
    key.refresh_from_db()
    assert key.status == KeyStatus.ACTIVE
    page.once("dialog", lambda dialog: dialog.accept())
    card.locator("a", has_text="Revoke").click()
    expect(notice).to_have_text(
        f"Revoked “{name}” (acs-{key.prefix}-…): programs using it now get key_revoked."
    )
    expect_in_view(notice)
    key.refresh_from_db()
    assert key.status == KeyStatus.REVOKED


def test_staff_revoking_a_key_asks_first_and_confirms(page, staff_page):
    name = f"staff revoke {uuid.uuid4().hex[:6]}"
    create_key(page, name)
    key = ApiKey.objects.get(user__email=BROWSER_USER, name=name)
    staff_page.goto(f"/staff/users/{key.user_id}/")
    staff_page.locator(f"#key-{key.pk} button", has_text="Revoke").click()
    expect(staff_page.locator("h1")).to_have_text(f"Revoke “{name}” of {BROWSER_USER}?")
    key.refresh_from_db()
    assert key.status == KeyStatus.ACTIVE
    staff_page.click("button:has-text('Revoke for good')")
    expect(staff_page.locator("#messages")).to_have_text(
        f"Revoked “{name}” (acs-{key.prefix}-…) of {BROWSER_USER}."
    )
    key.refresh_from_db()
    assert key.status == KeyStatus.REVOKED


# ---------------------------------------------------------------------------------------
# (f) The audit log


def test_the_audit_log_reads_as_field_before_arrow_after(page, staff_page):
    name = f"audit {uuid.uuid4().hex[:6]}"
    create_key(page, name)
    key = ApiKey.objects.get(user__email=BROWSER_USER, name=name)
    staff_page.goto(f"/staff/users/{key.user_id}/")
    card = staff_page.locator(f"#key-{key.pk}")
    card.locator("summary", has_text="Budgets").click()
    card.locator("input[name$='-daily_token_budget']").fill("4321")
    card.locator("button", has_text="Save key budgets").click()
    expect(staff_page.locator("#messages")).to_contain_text("saved")

    staff_page.goto(f"/staff/audit/?target={key.prefix}")
    rows = staff_page.locator("table.audit tbody tr")
    expect(rows).to_have_count(2)
    budget_set, created = rows.nth(0), rows.nth(1)
    expect(budget_set.locator("ul.changes li")).to_have_text(
        [f"daily_token_budget: {key.daily_token_budget:,} → 4,321"]
    )
    expect(created.locator("ul.changes li").first).to_have_text(f"name: — → {name}")
    expect(created.locator("ul.changes")).to_contain_text(
        f"budgets.monthly_token_budget: — → {key.monthly_token_budget:,}"
    )
    assert "{'" not in staff_page.locator("table.audit").text_content()


# ---------------------------------------------------------------------------------------
# (g) Dates


def test_date_filters_are_typed_and_shown_as_the_pages_print_days(page):
    page.goto("/usage/")
    page.select_option("#id_range", "custom")
    start = page.locator("#id_from")
    assert start.get_attribute("type") == "text"
    expect(start).to_have_attribute("placeholder", "YYYY-MM-DD")
    start.fill("2026-11-02")
    page.fill("#id_to", "2026-11-08")
    page.click("#results button[type=submit]")
    expect(page.locator("#results p", has_text="whole UTC days")).to_contain_text(
        "From 2026-11-02 to 2026-11-08"
    )
    expect(page.locator("#id_from")).to_have_value("2026-11-02")
    ticks = page.locator("[data-figure='usage-figure-tokens'] .xtick text")
    expect(ticks.first).to_have_text(re.compile(r"^2026-11-0\d$"))
    # A day typed the American way is named as the error it is.
    page.fill("#id_from", "11/02/2026")
    page.click("#results button[type=submit]")
    expect(page.locator("#results .errorlist")).to_contain_text(
        "Give the day as YYYY-MM-DD, e.g. 2026-12-01."
    )


# ---------------------------------------------------------------------------------------
# (h) The mode bar and the titles at phone width


def title_and_mode_bar(chart) -> dict:
    chart.scroll_into_view_if_needed()
    expect(chart.locator(".gtitle")).to_be_visible(timeout=60_000)
    chart.hover()
    expect(chart.locator(".modebar")).to_be_visible()
    return chart.evaluate(
        """div => {
          const box = e => e.getBoundingClientRect();
          const title = box(div.querySelector('.gtitle')), bar = box(div.querySelector('.modebar'));
          const area = box(div.querySelector('.nsewdrag')), plot = box(div);
          return {
            title: div.querySelector('.gtitle').textContent,
            overlaps: title.left < bar.right && bar.left < title.right
                      && title.top < bar.bottom && bar.top < title.bottom,
            titleAboveArea: title.bottom <= area.top,
            titleInside: title.left >= plot.left && title.right <= plot.right,
          };
        }"""
    )


def expect_titles_clear(charts):
    for index in range(charts.count()):
        geometry = title_and_mode_bar(charts.nth(index))
        assert not geometry["overlaps"], geometry
        assert geometry["titleAboveArea"] and geometry["titleInside"], geometry


def test_the_mode_bar_covers_no_chart_title_at_phone_width(page, harvest_page, staff_page):
    page.set_viewport_size(PHONE)
    page.goto("/usage/")
    expect_titles_clear(page.locator("[data-figure]"))
    staff_page.set_viewport_size(PHONE)
    staff_page.goto("/usage/staff/")
    expect_titles_clear(staff_page.locator("[data-figure]"))

    finished_harvest(harvest_page, prompt="A chart on a phone.")
    harvest_page.set_viewport_size(PHONE)
    harvest_page.goto("/jobs/")
    expect_titles_clear(harvest_page.locator("[data-figure]"))

    panel = submit_completion(
        page, prompt="The Eiffel Tower is in", max_tokens=3, temperature=0, stream=False,
        logprobs=5, prompt_logprobs=3, capture="all",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=90_000)
    # The finished panel is swapped in with its figures: measure them once they are drawn
    # (counted at once, the swap could leave none to measure).
    charts = page.locator(f"{RUN_PANEL} [data-plot]")
    expect(page.locator(f"{RUN_PANEL} [data-plot='tokens'] .gtitle")).to_be_visible(timeout=60_000)
    assert charts.count() >= 4
    expect_titles_clear(charts)
