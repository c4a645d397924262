"""Portal pages in a real browser: a key's budgets checked against each other, staff
decisions confirmed in the card clicked (a rejection asked first), and every table at phone
width."""

import uuid

import pytest
from playwright.sync_api import expect

from accounts.models import ApiKey, User, UserStatus

from .conftest import APPLICANTS, BROWSER_USER
from .test_jobs_page import submit_completion_job

pytestmark = pytest.mark.django_db

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
FITS_THE_SCREEN = "() => document.documentElement.scrollWidth <= window.innerWidth"
IN_VIEW = """e => { const box = e.getBoundingClientRect();
                    return box.top >= 0 && box.bottom <= window.innerHeight; }"""


def test_a_daily_budget_above_the_monthly_budget_is_refused_with_a_field_error(page):
    name = f"budget check {uuid.uuid4().hex[:6]}"
    page.goto("/keys/")
    page.fill("#id_name", name)
    page.click("#key-list section.card button[type=submit]")
    card = page.locator("article.key", has_text=name)
    card.locator("summary", has_text="Budgets").click()
    card.locator("input[name$='-monthly_token_budget']").fill("50000")
    card.locator("input[name$='-daily_token_budget']").fill("60000")
    card.locator("button", has_text="Save budgets").click()
    daily = page.locator("article.key", has_text=name).locator(
        ".field", has=page.locator("input[name$='-daily_token_budget']")
    )
    expect(daily.locator(".errorlist")).to_have_text(
        "At most the key's monthly budget (50,000 tokens)."
    )
    key = ApiKey.objects.get(user__email=BROWSER_USER, name=name)
    assert (key.monthly_token_budget, key.daily_token_budget) != (50_000, 60_000)


def test_approve_and_reject_confirm_in_the_clicked_card_and_reject_asks_first(staff_page):
    page = staff_page
    # On a phone the cards are tall: the message at the top of the page was out of view.
    page.set_viewport_size(PHONE)
    approved, rejected = APPLICANTS
    page.goto("/staff/applications/")
    card = page.locator("article.application", has_text=approved)
    card.locator("button", has_text="Approve").click()
    notice = card.locator(".notice")
    expect(notice).to_have_text(
        f"Approved {approved}: they are e-mailed, and their first key waits on their API keys page."
    )
    assert notice.evaluate(IN_VIEW)
    expect(card.locator(".badge")).to_have_text("Approved")
    assert User.objects.get(email=approved).status == UserStatus.APPROVED

    questions = []
    card = page.locator("article.application", has_text=rejected)
    reject = card.locator("button", has_text="Reject")
    page.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.dismiss()))
    reject.click()
    expect(reject).to_be_visible()  # still pending: the card was not replaced
    assert User.objects.get(email=rejected).status == UserStatus.PENDING
    page.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.accept()))
    reject.click()
    notice = card.locator(".notice")
    expect(notice).to_have_text(f"Rejected the application of {rejected}; they are e-mailed.")
    assert notice.evaluate(IN_VIEW)
    assert User.objects.get(email=rejected).status == UserStatus.REJECTED
    assert (
        questions == [f"Reject the application of {rejected}? They are e-mailed the decision."] * 2
    )


def _fits(page, path: str) -> None:
    page.goto(path)
    expect(page.locator("main table tbody tr").first).to_be_visible()
    assert page.evaluate(FITS_THE_SCREEN), path


def test_every_table_scrolls_in_its_own_box_at_phone_width(page, staff_page):
    # A finished job gives the jobs page, the request log and the usage page their rows.
    submit_completion_job(page, prompt="Tables on a phone", max_tokens=2)
    page.set_viewport_size(PHONE)
    for path in ["/jobs/", "/usage/requests/", "/usage/", "/keys/"]:
        _fits(page, path)
    staff_page.set_viewport_size(PHONE)
    for path in ["/staff/audit/", "/staff/users/", "/usage/staff/"]:
        _fits(staff_page, path)


def test_the_audit_table_is_whole_at_desktop_width(staff_page):
    staff_page.set_viewport_size(DESKTOP)
    _fits(staff_page, "/staff/audit/")
    box = staff_page.locator(".table-scroll:has(table.audit)")
    assert box.evaluate("box => box.scrollWidth <= box.clientWidth")


def test_usage_charts_below_the_view_are_drawn_as_they_come_into_it(page):
    page.set_viewport_size({"width": 1280, "height": 300})
    page.goto("/usage/")
    tokens, requests = (
        page.locator(f"[data-figure='usage-figure-{name}']") for name in ("tokens", "requests")
    )
    expect(tokens.locator(".main-svg").first).to_be_visible()
    expect(requests.locator(".main-svg")).to_have_count(0)
    requests.scroll_into_view_if_needed()
    expect(requests.locator(".main-svg").first).to_be_visible()
