"""Error pages are the site's own (DEBUG is off in tests, as in production): no URL list, no
traceback; /v1 keeps answering JSON errors."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.test import Client, RequestFactory
from django.views.defaults import permission_denied, server_error
from psycopg_pool import PoolTimeout


def assert_site_page(html: str, heading: str):
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert 'class="site"' in html  # the site's header and navigation
    assert f"<h1>{heading}</h1>" in html
    assert "Traceback" not in html


def test_an_unknown_page_is_the_sites_404_without_the_url_list(client):
    response = client.get("/no-such-page/")
    assert response.status_code == 404
    html = response.content.decode()
    assert_site_page(html, "Page not found")
    assert "URLconf" not in html
    assert "playground/" not in html.split("<main", 1)[1]


def test_another_users_object_is_the_sites_404(approved_user, other_user):
    client = Client()
    client.force_login(approved_user)
    response = client.get("/keys/999999/revoke/")
    assert response.status_code == 404
    assert_site_page(response.content.decode(), "Page not found")


def test_the_500_page_renders_without_a_request_context():
    response = server_error(RequestFactory().get("/"))
    assert response.status_code == 500
    assert_site_page(response.content.decode(), "Something went wrong on our side")


def test_the_403_page_is_the_sites(db):
    request = RequestFactory().get("/")
    response = permission_denied(request, PermissionDenied())
    assert response.status_code == 403
    assert_site_page(response.content.decode(), "Not allowed")


def test_a_csrf_failure_is_the_sites_403(db):
    response = Client(enforce_csrf_checks=True).post("/login/", {"username": "x", "password": "y"})
    assert response.status_code == 403
    assert_site_page(response.content.decode(), "Not allowed")


def test_an_unknown_api_path_is_still_a_json_error(client):
    response = client.get("/v1/no-such-endpoint")
    assert response.status_code == 404
    assert response.json()["error"]["code"]


@pytest.fixture
def pool_held(transactional_db):
    """Every connection of this process's database pool taken, and a short wait for one."""
    pool = connection.pool
    pool.open()
    held = []
    while True:
        try:
            held.append(pool.getconn(timeout=0.2))
        except PoolTimeout:
            break
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pool, "timeout", 0.2)
        yield
    for conn in held:
        pool.putconn(conn)


def in_a_new_thread(call):
    """`call()` in a thread of its own, which (like every request under ASGI) has no database
    connection yet."""
    with ThreadPoolExecutor(1) as executor:
        return executor.submit(call).result()


def test_a_page_is_503_with_retry_after_while_every_database_connection_is_busy(
    approved_user, pool_held
):
    client = Client()
    client.force_login(approved_user)
    response = in_a_new_thread(lambda: client.get("/keys/"))
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert_site_page(response.content.decode(), "The site is busy")


def test_an_api_view_is_503_db_pool_exhausted_while_every_database_connection_is_busy(
    api_secret, pool_held
):
    response = in_a_new_thread(
        lambda: Client().get("/v1/usage", HTTP_AUTHORIZATION=f"Bearer {api_secret}")
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "db_pool_exhausted"
    assert response["Retry-After"] == "2"
