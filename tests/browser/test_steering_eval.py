"""The steering evaluation page as a researcher uses it, on the real engine: a small dataset
is priced, run, plotted and tabled (at 1280 and 390 px, without sideways scrolling), a
malformed row gets its error beside the dataset, an evaluation is cancelled while the engine
holds its requests (the unsent ones never go), and a playground key whose activation quota
is spent is told so before anything is sent. Each persona has its own user, so that each
page shows its own latest evaluation."""

import json

import numpy as np
import pytest
from django.conf import settings
from playwright.sync_api import expect

from accounts.models import ApiKey, User
from accounts.services.playground_key import playground_key_get_or_create
from api import upstream
from infra.lifecycle import WorkStatus
from playground.models import Run
from playground.steering_eval.models import SteeringEvaluation
from playground.vectors.services import steering_vector_create
from tests.conftest import make_user

from .conftest import watched_page
from .screenshots import WIDTHS, save_screenshots

pytestmark = pytest.mark.django_db

RESEARCHER = "browser-steer-eval@example.org"
CANCELLER = "browser-steer-eval-cancel@example.org"
NO_QUOTA = "browser-steer-eval-quota@example.org"
DATASET = "\n".join(
    [
        "prompt,target,foil",
        "The capital of France is, Paris, Rome",
        "The Eiffel Tower stands in, Paris, London",
        "Big Ben stands in, London, Paris",
        "The Colosseum stands in, Rome, Paris",
    ]
)
SUBMIT = "#steering-eval-form button[type=submit]"
PANEL = ".steering-evaluation"
# 4 prompts × (2 scales + 3 repeats) × 2 completions, short requests through one worker.
FINISH_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def personas(system, django_db_blocker):
    """The three users, each with a vector in their library (committed: the servers read
    it); the quota persona's playground key has no activation request left."""
    with django_db_blocker.unblock():
        users = {email: make_user(email) for email in (RESEARCHER, CANCELLER, NO_QUOTA)}
        values = np.random.default_rng(1).normal(size=576).astype(np.float32)
        for user in users.values():
            steering_vector_create(
                user=user, name="random direction", model="smollm2-135m", layer=10,
                method="upload", vector=values / np.linalg.norm(values),
            )  # fmt: skip
        key, _ = playground_key_get_or_create(user=users[NO_QUOTA])
        ApiKey.objects.filter(pk=key.pk).update(monthly_activation_quota=0)


def persona_page(browser, system, sign_in, email):
    return watched_page(browser, system, [], sign_in(email))


def price_and_run(page, *, dataset=DATASET, scales="0, 8"):
    """Fill the form, have the cost stated, then run it."""
    page.goto("/playground/steering-eval/")
    page.select_option("#id_steereval-vector", label="random direction (layer 10)")
    page.fill("#id_steereval-scales", scales)
    page.fill("#id_steereval-dataset", dataset)
    page.click(SUBMIT)
    expect(page.locator(".evaluation-cost")).to_contain_text(" tokens, and ")
    page.click(SUBMIT)


def test_a_small_evaluation_is_plotted_and_tabled_and_a_bad_row_named(
    personas, browser, system, sign_in
):
    with persona_page(browser, system, sign_in, RESEARCHER) as page:
        price_and_run(page)
        panel = page.locator(PANEL)
        expect(panel).to_have_attribute("data-finished", "true", timeout=FINISH_TIMEOUT_MS)
        expect(panel.get_by_role("status")).to_contain_text("Done: 40 requests")
        expect(panel.locator(".evaluation-summary tbody tr")).to_have_count(2)
        expect(panel.locator(".js-plotly-plot")).to_have_count(2)
        numbers = json.loads(page.locator("#steering-eval-numbers").text_content())
        evaluation = SteeringEvaluation.objects.get(user__email=RESEARCHER)
        assert numbers["evaluation"] == str(evaluation.id)
        assert [row["prompts"] for row in numbers["summary"]] == [4, 4]
        zero = numbers["summary"][0]
        # A mean that rounds to zero shows no sign (scale 0's is 0, or within rounding of it).
        shown = f"{zero['logit_diff_mean']:.3f}".replace("-0.000", "0.000")
        expect(panel.locator("tr[data-scale='0.0'] td.logit-diff")).to_contain_text(shown)
        expect(panel.locator("a", has_text="CSV")).to_have_attribute(
            "href", f"/playground/steering-eval/{evaluation.id}/numbers.csv"
        )
        save_screenshots(page, "steering-eval")
        assert page.evaluate("document.documentElement.scrollWidth") <= WIDTHS[-1]
        expect(panel.locator(".evaluation-summary")).to_be_visible()

        # A malformed row: its error beside the dataset, nothing sent.
        page.fill("#id_steereval-dataset", DATASET + "\nThe Louvre is in, Paris, Paris")
        page.click(SUBMIT)
        expect(page.locator("#id_steereval-dataset ~ .errorlist")).to_contain_text(
            "Row 5 (line 6): the target equals the foil"
        )
        assert SteeringEvaluation.objects.filter(user__email=RESEARCHER).count() == 1


def test_a_cancelled_evaluation_never_sends_its_queued_runs(
    personas, browser, system, sign_in, engine_gate
):
    """The engine answers two of the canceller's requests and holds the rest until the
    evaluation is cancelled: caught mid-way on any CPU."""
    tenant = upstream.tenant_of(User.objects.get(email=CANCELLER).pk)

    def the_cancellers(request) -> bool:
        return request.path == "/v1/completions" and request.headers.get("x-acs-tenant") == tenant

    with persona_page(browser, system, sign_in, CANCELLER) as page:
        with engine_gate.hold(the_cancellers, after=2):
            price_and_run(page)
            assert engine_gate.holding.wait(timeout=60)
            panel = page.locator(PANEL)
            expect(panel.get_by_role("status")).to_contain_text("Running: 2 of 40")
            panel.get_by_role("button", name="Cancel the evaluation").click()
            expect(page.locator(PANEL).get_by_role("status")).to_contain_text("Cancelled.")
        panel = page.locator(PANEL)
        expect(panel).to_have_attribute("data-finished", "true", timeout=FINISH_TIMEOUT_MS)
        expect(panel.get_by_role("status")).to_contain_text("Cancelled before they were sent")
        expect(panel.get_by_role("button", name="Cancel the evaluation")).to_have_count(0)
    runs = Run.objects.filter(group=SteeringEvaluation.objects.get(user__email=CANCELLER).id)
    assert not runs.filter(status__in=(WorkStatus.QUEUED, WorkStatus.RUNNING)).exists()
    sent = runs.exclude(status=WorkStatus.CANCELLED).count()
    # Two answered, and at most the few in flight when it was cancelled.
    assert 2 <= sent <= 2 + settings.PLAYGROUND_GROUP_RUNS_IN_FLIGHT
    assert runs.filter(status=WorkStatus.CANCELLED).count() == 40 - sent


def test_a_spent_activation_quota_is_said_before_anything_is_sent(
    personas, browser, system, sign_in
):
    with persona_page(browser, system, sign_in, NO_QUOTA) as page:
        page.goto("/playground/steering-eval/")
        page.select_option("#id_steereval-vector", label="random direction (layer 10)")
        page.fill("#id_steereval-dataset", DATASET)
        page.click(SUBMIT)
        error = page.locator("#steering-eval-form .errorlist").first
        expect(error).to_contain_text("Your Playground key's budget is too small")
        expect(error).to_contain_text("“Activation requests, this month” has 0 left")
    assert not SteeringEvaluation.objects.filter(user__email=NO_QUOTA).exists()
