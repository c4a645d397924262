"""Patchscopes as a researcher uses them, on the real engine: from a capture run's page to the
Patchscopes form, whose cost is stated before submitting; a bad inspection position gets an
error beside its field; three source layers fill the table, each row the tokens its run
generated; at 390 px the page does not scroll sideways (screenshots at 1280 and 390 px). A
Patchscope cancelled while its capture is held at the engine never sends its generations,
and one submitted with the account's activation quota spent says so. (The generations'
agreement with transformers float32 hooks is tests/playground/test_patchscopes_engine.py's.)"""

import psycopg
import pytest
from django.db import connections
from playwright.sync_api import expect

from api.auth import access_generation_bump
from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind

from .conftest import BROWSER_USER
from .screenshots import WIDTHS, save_screenshots
from .test_playground import submit_completion

pytestmark = pytest.mark.django_db

SCOPE = ".patchscope"
SUBMIT = "#patchscope-form button[type=submit]"


def open_patchscopes_from_a_capture_run(page) -> None:
    """A capture of "The capital of France is" at layers 2, 10, 20, then its page's link."""
    panel = submit_completion(
        page, prompt="The capital of France is", max_tokens=1, temperature=0, stream=False,
        capture="layers", capture_layers="2, 10, 20",
    )  # fmt: skip
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=60_000)
    panel.locator("[data-patchscopes-link]").click()
    expect(page.locator("#patchscope-form")).to_be_visible()
    page.select_option("#id_scope-source_position", "3")


def test_a_patchscope_from_a_capture_run_fills_its_table(page):
    page.set_viewport_size({"width": WIDTHS[0], "height": 900})
    open_patchscopes_from_a_capture_run(page)
    expect(page.locator("#id_scope-source_position option:checked")).to_have_text("3 ·France")
    cost = page.locator("#patchscope-cost [data-cost-tokens]")
    # The default 3 source layers × 10 tokens; 6 tokens each once the field changes.
    stated = int(cost.text_content())
    page.fill("#id_scope-max_tokens", "6")
    expect(cost).to_have_text(str(stated - 3 * 4))
    page.fill("#id_scope-inspection_position", "99")
    page.click(SUBMIT)
    expect(page.locator("#id_scope-inspection_position ~ .errorlist")).to_contain_text(
        "No position 99: the inspection prompt has"
    )
    page.fill("#id_scope-inspection_position", "")
    page.click(SUBMIT)
    scope = page.locator(SCOPE)
    expect(scope).to_have_attribute("data-finished", "true", timeout=120_000)
    expect(scope.get_by_role("status")).to_contain_text("Done: 4 requests.")
    patchscope_id = scope.get_attribute("id").removeprefix("patchscope-")
    runs = {
        run.meta["source_layer"]: run
        for run in Run.objects.filter(group=patchscope_id, kind=RunKind.PATCHSCOPE)
    }
    assert sorted(runs) == [2, 10, 20]
    for layer, run in runs.items():
        row = scope.locator(f"tr[data-source-layer='{layer}']")
        expect(row.locator("td.layer")).to_have_text(f"{layer} → {layer}")
        strings = run.tokens["completions"][0]["strings"]
        shown = [s.replace(" ", "·").replace("\n", "⏎") for s in strings]
        expect(row.locator(".patchscope-tokens code")).to_have_text(shown)
    expect(scope.locator("[data-billed-tokens]")).to_have_text(str(stated - 3 * 4))
    save_screenshots(page, "patchscopes")
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]


def set_account_activation_quota(quota: int | None) -> int:
    """Set the browser user's account activation quota where the servers see it (committed,
    outside the test's transaction) and make the gateway re-read it; returns the old one."""
    db = connections["default"].settings_dict
    url = f"postgres://{db['USER']}@{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}"
    with psycopg.connect(f"{url}/{db['NAME']}", autocommit=True) as connection:
        (old,) = connection.execute(
            "UPDATE accounts_user SET monthly_activation_quota = %s WHERE email = %s "
            "RETURNING (SELECT monthly_activation_quota FROM accounts_user WHERE email = %s)",
            [quota, BROWSER_USER, BROWSER_USER],
        ).fetchone()
    access_generation_bump()
    return old


def test_a_cancelled_patchscope_and_a_spent_quota_say_so(page, engine_gate):
    page.set_viewport_size({"width": WIDTHS[-1], "height": 900})
    open_patchscopes_from_a_capture_run(page)
    with engine_gate.hold(lambda request: request.path == "/v1/completions"):
        page.click(SUBMIT)
        assert engine_gate.holding.wait(timeout=60)
        scope = page.locator(SCOPE)
        scope.get_by_role("button", name="Cancel the Patchscope").click()
        expect(scope.get_by_role("status")).to_contain_text("Cancelled.")
    expect(scope).to_have_attribute("data-finished", "true", timeout=60_000)
    expect(scope.get_by_role("status")).to_contain_text(
        "Ran: 1 of 4 requests. Never sent (never billed): 3."
    )
    patchscope_id = scope.get_attribute("id").removeprefix("patchscope-")
    assert not Run.objects.filter(group=patchscope_id, kind=RunKind.PATCHSCOPE).exists()

    old = set_account_activation_quota(0)
    try:
        page.click(SUBMIT)
        spent = page.locator(SCOPE).filter(has_not=page.locator(f"#patchscope-{patchscope_id}"))
        expect(spent.get_by_role("status")).to_contain_text(
            "activation_quota_exceeded", timeout=60_000
        )
    finally:
        set_account_activation_quota(old)
    expect(spent.get_by_role("status")).to_contain_text("activation-request quota is spent")
    expect(spent).to_have_attribute("data-finished", "true")
    failed = Run.objects.get(group=spent.get_attribute("id").removeprefix("patchscope-"))
    assert failed.status == WorkStatus.FAILED and failed.error_code == "activation_quota_exceeded"
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]
