"""The browser suite's watch on every page: what it reports, and what a test may declare."""

import pytest

from .conftest import PageWatch

pytestmark = pytest.mark.django_db


def test_an_undeclared_4xx_and_a_script_error_are_reported(system, browser):
    context = browser.new_context(base_url=system.web_url)
    try:
        page = context.new_page()
        watch = PageWatch(page, expected_http_errors=[])
        page.goto("/no-such-page/")
        page.evaluate("setTimeout(() => { throw new Error('boom') })")
        page.wait_for_timeout(500)
        problems = watch.problems()
    finally:
        context.close()
    assert any(problem.startswith("HTTP 404: ") for problem in problems), problems
    assert any("page error: " in problem and "boom" in problem for problem in problems)


def test_a_4xx_the_test_declares_is_accepted(page, expected_http_errors):
    expected_http_errors.append("/no-such-page/")
    response = page.goto("/no-such-page/")
    assert response.status == 404


def test_an_xhr_its_script_aborts_is_accepted_and_another_cancellation_is_reported(system, browser):
    context = browser.new_context(base_url=system.web_url)
    held = []
    try:
        page = context.new_page()
        watch = PageWatch(page, expected_http_errors=[])
        page.goto("/login/")
        # Held unanswered, so each is still loading when the page ends it.
        page.route("**/held/**", lambda route: held.append(route))
        page.evaluate(
            """() => {
              const xhr = new XMLHttpRequest();
              xhr.open("GET", "/held/by-xhr/");
              xhr.send();
              const controller = new AbortController();
              fetch("/held/by-fetch/", {signal: controller.signal}).catch(() => {});
              setTimeout(() => { xhr.abort(); controller.abort(); }, 300);
            }"""
        )
        page.wait_for_timeout(800)
        problems = watch.problems()
    finally:
        context.close()
    assert len(held) == 2
    assert problems == [f"request cancelled: {system.web_url}/held/by-fetch/"]
