"""The linear-probe page as a researcher uses it, on the real engine: a small dataset's cost
counted, then fitted, its accuracy and AUROC plotted with a table, at 1280 and at 390 px
(no sideways scroll); a malformed row's error beside the dataset; a probe cancelled while
its harvest is held at the engine (caught mid-way on any CPU); and a spent harvest quota
said as such."""

import pytest
from django.db import connections
from playwright.sync_api import expect

from accounts.models import User
from accounts.services.playground_key import playground_key_get_or_create
from api import upstream
from api.jobs.models import HarvestJob
from infra.lifecycle import WorkStatus
from playground.probes.models import Probe
from tests.conftest import make_user

from .conftest import BROWSER_USER, watched_page
from .screenshots import WIDTHS, save_screenshots

pytestmark = pytest.mark.django_db

# 6 sentences about each of two topics: 3 of each held out at a held-out fraction of 0.5.
ROWS = [
    *(f"The chef cooked {food} for dinner.,cooking" for food in
      ("soup", "rice", "pasta", "bread", "beans", "fish")),
    *(f"The telescope saw {thing} in space.,space" for thing in
      ("Mars", "Saturn", "a comet", "a galaxy", "the Moon", "a nebula")),
]  # fmt: skip
DATASET = "text,label\n" + "\n".join(ROWS) + "\n"
PANEL = ".probe-panel"
SPENT_USER = "probes-spent@example.org"
PROBE_TIMEOUT_MS = 60_000


def fill(page, dataset=DATASET, layers="3, 20"):
    page.goto("/playground/probes/")
    page.fill("#id_probe-dataset", dataset)
    page.fill("#id_probe-layers", layers)
    page.fill("#id_probe-test_fraction", "0.5")


def count_then_fit(page) -> None:
    page.get_by_role("button", name="Count the cost").click()
    expect(page.locator(".probe-cost")).to_contain_text("tokens")
    page.locator("#probe-form button[value=fit]").click()


def test_a_small_dataset_is_fitted_plotted_and_tabled_at_both_widths(page):
    fill(page)
    count_then_fit(page)
    panel = page.locator(PANEL)
    expect(panel).to_have_attribute("data-probe-status", "succeeded", timeout=PROBE_TIMEOUT_MS)
    expect(panel.get_by_role("status")).to_contain_text("Done: 2 layers fitted")
    expect(panel.locator(".js-plotly-plot")).to_have_count(2)
    expect(panel.locator(".probe-table tbody tr")).to_have_count(2)
    expect(panel.locator(".probe-table tbody th")).to_have_text(["3", "20"])
    probe = Probe.objects.filter(user__email=BROWSER_USER).first()
    stated = int(page.locator(".probe-cost").get_attribute("data-probe-cost"))
    assert probe.token_cost == stated and probe.status == WorkStatus.SUCCEEDED
    # Photographed at 1280 and then 390 px, where the page must not scroll sideways.
    save_screenshots(page, "probes")
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]
    expect(panel.locator("a", has_text="CSV")).to_be_visible()


def test_a_malformed_row_is_named_beside_the_dataset(page):
    fill(page, dataset=DATASET + "A cow grazed in the field.,farming\n")
    page.get_by_role("button", name="Count the cost").click()
    error = page.locator("#id_probe-dataset ~ .errorlist")
    expect(error).to_contain_text("Line 14: label “farming” is a third class")
    expect(page.locator(".probe-cost")).to_have_count(0)


def test_a_probe_is_cancelled_while_its_harvest_is_held(page, engine_gate):
    tenant = upstream.tenant_of(User.objects.get(email=BROWSER_USER).pk)

    def harvest_capture(request) -> bool:
        return request.path == "/v1/completions" and request.headers.get("x-acs-tenant") == tenant

    with engine_gate.hold(harvest_capture):
        fill(page)
        count_then_fit(page)
        panel = page.locator(PANEL)
        expect(panel.get_by_role("status")).to_contain_text("Harvesting", timeout=30_000)
        assert engine_gate.holding.wait(timeout=30)
        panel.get_by_role("button", name="Cancel the probe").click()
        expect(page.locator(PANEL).get_by_role("status")).to_contain_text("Cancelled.")
    probe = Probe.objects.filter(user__email=BROWSER_USER).first()
    assert probe.status == WorkStatus.CANCELLED
    expect(page.locator(PANEL).get_by_role("button", name="Cancel the probe")).to_have_count(0)
    # The harvest itself was cancelled through /v1, and its quota slot given back.
    job = HarvestJob.objects.get(pk=probe.harvest_job_id)
    for _ in range(50):
        job.refresh_from_db()
        if job.status == WorkStatus.CANCELLED:
            break
        page.wait_for_timeout(100)
    assert job.status == WorkStatus.CANCELLED


@pytest.fixture(scope="module")
def spent_page(system, browser, sign_in, django_db_blocker):
    """A researcher of its own whose Playground key has no harvest left this month (created,
    committed, before any test's transaction)."""
    with django_db_blocker.unblock():
        user = User.objects.filter(email=SPENT_USER).first() or make_user(SPENT_USER)
        key, _ = playground_key_get_or_create(user=user)
        key.monthly_harvest_quota = 0
        key.save(update_fields=["monthly_harvest_quota"])
        connections.close_all()
    with watched_page(browser, system, [], sign_in(SPENT_USER)) as page:
        yield page


def test_a_spent_harvest_quota_is_said_as_such(spent_page):
    fill(spent_page)
    count_then_fit(spent_page)
    error = spent_page.locator(f"{PANEL} [data-probe-error]")
    expect(error).to_contain_text("budget or quota is spent", timeout=PROBE_TIMEOUT_MS)
    expect(error).to_contain_text("harvest_quota_exceeded")
