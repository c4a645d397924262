"""The engine has no accounts, so it refuses what a web page in a local browser could send it:
a foreign Host (DNS rebinding), a body that is not application/json (a preflight-free
cross-site POST), and, when ACS_ENGINE_TOKEN is set, a request without the shared token."""

import json
import os
import subprocess
import sys

import pytest
from conftest import MODEL, REPO_ROOT, engine_in_process

from engine.config import EngineConfig, bind_refusal
from testsupport.servers import engine_command, free_port, stop, wait_ready

BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
TOKEN = "engine-test-token-0123456789"


def assert_refused(response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == code


@pytest.mark.parametrize("host", ["rebound.attacker.example", "rebound.attacker.example:8001", ""])
def test_foreign_host_is_refused_before_any_work(client, host):
    assert_refused(
        client.post("/v1/completions", json=BODY, headers={"host": host}), 421, "host_not_allowed"
    )
    assert_refused(client.get("/health", headers={"host": host}), 421, "host_not_allowed")
    assert_refused(client.get("/tokenizer.json", headers={"host": host}), 421, "host_not_allowed")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:1234", "LOCALHOST", "[::1]:8001"])
def test_loopback_names_on_any_port_are_served(client, host):
    response = client.post("/v1/completions", json=BODY, headers={"host": host})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_post_body_that_is_not_json_media_type_is_a_415(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/v1/completions", "/tokenize"):
        response = client.post(path, content=json.dumps(BODY).encode(), headers=headers)
        assert_refused(response, 415, "unsupported_media_type")


def test_json_media_type_with_charset_is_served(client):
    response = client.post(
        "/v1/completions",
        content=json.dumps(BODY).encode(),
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def guarded_engine(reference):
    # Started once /health answers 200: it needs no token, as liveness probes poll it.
    with engine_in_process(
        reference, token=TOKEN, allowed_hosts=frozenset({"127.0.0.1", "engine.internal"})
    ) as engine:
        yield engine


def test_engine_with_a_token_refuses_requests_without_it(guarded_engine):
    client = guarded_engine.client
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
        response = client.post("/v1/completions", json=BODY, headers=headers)
        assert_refused(response, 401, "invalid_token")
        assert_refused(client.get("/tokenizer.json", headers=headers), 401, "invalid_token")


def test_engine_with_a_token_serves_requests_carrying_it(guarded_engine):
    auth = {"authorization": f"Bearer {TOKEN}"}
    client = guarded_engine.client
    assert client.post("/v1/completions", json=BODY, headers=auth).status_code == 200
    assert client.get("/tokenizer.json", headers=auth).status_code == 200
    tokenized = client.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}, headers=auth)
    assert tokenized.status_code == 200, tokenized.text


def test_allowed_hosts_setting_replaces_the_default_names(guarded_engine):
    auth = {"authorization": f"Bearer {TOKEN}"}
    client = guarded_engine.client
    served = client.get("/v1/models", headers={**auth, "host": "engine.internal:8001"})
    assert served.status_code == 200, served.text
    refused = client.get("/v1/models", headers={**auth, "host": "localhost"})
    assert_refused(refused, 421, "host_not_allowed")


def serve(host: str, env: dict) -> tuple[subprocess.Popen, int]:
    """`python -m engine serve --host HOST` on a free port, with `env` as its environment."""
    port = free_port()
    return subprocess.Popen(
        engine_command(port, sys.executable, host=host),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ), port


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "engine.internal"])
def test_engine_refuses_to_listen_beyond_loopback_without_a_token(host, monkeypatch, capsys):
    """`python -m engine serve --host HOST`, run in this process (no interpreter to start)."""
    from engine import __main__ as command

    monkeypatch.delenv("ACS_ENGINE_TOKEN", raising=False)
    monkeypatch.setattr(sys, "argv", ["python -m engine", "serve", "--host", host])
    monkeypatch.setattr(command.uvicorn, "run", lambda *args, **kwargs: pytest.fail("it served"))
    with pytest.raises(SystemExit) as exit:
        command.main()
    assert exit.value.code == 2
    assert f"refusing to listen on {host!r} without ACS_ENGINE_TOKEN" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_addresses_need_no_token(host):
    assert bind_refusal(host, EngineConfig(token="")) is None


def test_engine_listens_beyond_loopback_with_a_token():
    process, port = serve("0.0.0.0", {**os.environ, "ACS_ENGINE_TOKEN": TOKEN})
    try:
        # /health answers (503 while the model loads): the server is up on every interface.
        wait_ready(
            f"http://127.0.0.1:{port}/health",
            process,
            "the engine",
            ready=lambda response: response.status_code in (200, 503),
        )
    finally:
        stop(process)
