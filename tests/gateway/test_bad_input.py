"""Hostile input that used to crash the gateway with a 500: every case must get the
contract's 4xx naming the problem (issue #12, item 6)."""

import contextlib
import json
import socket
import time

import pytest

from api.bodies import MAX_JSON_DEPTH
from api.jobs.models import CompletionJob, HarvestJob
from infra.lifecycle import WorkStatus

from .test_errors import BASE, assert_error

pytestmark = pytest.mark.django_db(transaction=True)

# Far past the ~1000 levels where Python's json parser raises RecursionError.
TOO_DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BODY_ENDPOINTS = [
    ("/v1/completions", {}),
    ("/v1/completion-jobs", {"Idempotency-Key": "deep-1"}),
    ("/v1/harvest", {}),
]


@pytest.mark.parametrize(("path", "headers"), BODY_ENDPOINTS)
def test_deeply_nested_json_is_400_naming_the_depth(client, stub, path, headers):
    response = client.post(path, content=TOO_DEEP, headers=headers)
    error = assert_error(response, 400, "invalid_request", should_retry=False)
    assert f"{MAX_JSON_DEPTH} levels" in error["message"]


@pytest.mark.parametrize(("path", "headers"), BODY_ENDPOINTS)
def test_unclosed_brackets_are_refused_before_parsing(client, stub, path, headers):
    response = client.post(path, content=b"[" * 50_000, headers=headers)
    assert_error(response, 400, "invalid_request", should_retry=False)


def test_nesting_at_the_limit_still_parses(client, stub):
    # 64 levels: the body object, then 63 lists; brackets inside strings do not count.
    prompt = "[" * 63 + "hello" + "]" * 63
    body = json.dumps({**BASE, "prompt": prompt, "stop": ["{" * 200]})
    assert client.post("/v1/completions", content=body).status_code == 200
    deeper = b'{"prompt": ' + b"[" * 64 + b"]" * 64 + b"}"
    response = client.post("/v1/completions", content=deeper)
    assert f"{MAX_JSON_DEPTH} levels" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("raw_body", "field"),
    [
        (b'{"model": "stub-model", "prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        (b'{"model": "stub-model", "prompt": ["ok", "a\\udfff"], "max_tokens": 2}', "prompt.1"),
        (b'{"model": "stub-model", "prompt": "hi", "stop": ["\\ud83d"]}', "stop.0"),
        (b'{"model": "\\udc00", "prompt": "hello"}', "model"),
        # The raw UTF-8 bytes of a surrogate, which json.loads decodes too.
        (b'{"model": "stub-model", "prompt": "\xed\xa0\x80", "max_tokens": 2}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(client, stub, raw_body, field):
    response = client.post("/v1/completions", content=raw_body)
    error = assert_error(response, 400, "invalid_request", should_retry=False)
    assert f"'{field}'" in error["message"] and "surrogate" in error["message"]
    assert stub.requests == []


def test_a_surrogate_pair_is_an_ordinary_character(client, stub):
    raw = b'{"model": "stub-model", "prompt": "hello \\ud83d\\ude00", "max_tokens": 2}'
    assert client.post("/v1/completions", content=raw).status_code == 200


def test_a_lone_surrogate_in_a_job_or_harvest_body_is_400(client, stub):
    job = client.post(
        "/v1/completion-jobs",
        content=b'{"model": "stub-model", "prompt": "\\ud800", "max_tokens": 2}',
        headers={"Idempotency-Key": "surrogate-1"},
    )
    assert "'prompt'" in assert_error(job, 400, "invalid_request", should_retry=False)["message"]
    harvest = client.post("/v1/harvest", content=b'{"model": "stub-model", "prompts": ["\\udbff"]}')
    error = assert_error(harvest, 400, "invalid_request", should_retry=False)
    assert "'prompts.0'" in error["message"]


@pytest.mark.parametrize("value", [b"Infinity", b"-Infinity", b"NaN", b"1e999"])
@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "min_p"])
def test_non_finite_sampler_values_are_400_naming_the_field(client, stub, field, value):
    raw = b'{"model": "stub-model", "prompt": "hello", "max_tokens": 2, "%s": %s}' % (
        field.encode(),
        value,
    )
    response = client.post("/v1/completions", content=raw)
    error = assert_error(response, 400, "invalid_request", should_retry=False)
    assert f"'{field}'" in error["message"]
    assert stub.requests == []


def test_a_non_finite_steering_scale_is_400(client, stub):
    from .test_errors import steering

    body = json.dumps({**BASE, "apply_steering_vectors": steering()})
    raw = body.replace('"layer_indices"', '"scale": Infinity, "layer_indices"').encode()
    response = client.post("/v1/completions", content=raw)
    error = assert_error(response, 400, "invalid_request", should_retry=False)
    assert "apply_steering_vectors.0.scale" in error["message"]


def test_harvest_download_urls_name_the_site_not_the_request_host(client, stub, api_key, settings):
    settings.SITE_URL = "https://acs.example.org"
    job = HarvestJob.objects.create(
        user=api_key.user,
        key=api_key,
        model="stub-model",
        prompts=["hello"],
        layers=[1],
        n_prompts=1,
        prompts_done=1,
        status=WorkStatus.SUCCEEDED,
        files=["manifest.json", "shard_00000.safetensors", "stats.safetensors"],
    )
    # An allowed host other than the site's.
    response = client.get(f"/v1/harvest/{job.pk}", headers={"Host": "localhost"})
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    urls = [result["manifest_url"], result["stats_url"], *result["shard_urls"]]
    assert all(url.startswith("https://acs.example.org/v1/harvest/") for url in urls), urls


@pytest.mark.parametrize("path", ["/v1/docs", "/v1/openapi.json"])
def test_the_api_reference_names_the_site_not_the_request_host(client, settings, path):
    settings.SITE_URL = "https://acs.example.org"
    response = client.get(path, headers={"Host": "localhost"})
    assert response.status_code == 200
    assert "localhost" not in response.text


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", BASE),
        ("POST", "/v1/completions", {**BASE, "stream": True}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/harvest", {"model": "stub-model", "prompts": ["hello"]}),
        ("GET", "/v1/openapi.json", None),
    ],
)
def test_a_host_outside_allowed_hosts_is_400_on_every_v1_path(client, stub, method, path, body):
    response = client.request(method, path, json=body, headers={"Host": "attacker.example"})
    error = assert_error(response, 400, "host_not_allowed", should_retry=False)
    assert "attacker.example" in error["message"]
    assert response.headers["X-Request-Id"]
    assert stub.requests == []
    assert not HarvestJob.objects.exists()


def test_an_allowed_host_with_a_port_is_served(client, stub):
    response = client.post("/v1/completions", json=BASE, headers={"Host": "localhost:8443"})
    assert response.status_code == 200, response.text


def _send_raw(url: str, request: bytes) -> bytes:
    """Send `request` (which asks the server to close the connection) as is; the answer."""
    host, port = url.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(
    "hosts",
    [("attacker.example", "localhost"), ("localhost", "attacker.example"), ("localhost",) * 2],
)
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", json.dumps(BASE)),
        ("GET", "/v1/models", ""),
        ("GET", "/login/", ""),
    ],
)
def test_a_request_with_two_host_headers_is_400(
    gateway_url, api_secret, stub, model, hosts, method, path, body
):
    """A proxy may route by one Host header while the server reads another: with more than
    one, the request is refused whatever they name (the portal's pages by Django)."""
    host_lines = "".join(f"Host: {host}\r\n" for host in hosts)
    answer = _send_raw(
        gateway_url,
        (
            f"{method} {path} HTTP/1.1\r\n{host_lines}Authorization: Bearer {api_secret}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n{body}"
        ).encode(),
    )
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    if path.startswith("/v1/"):
        assert b'"code":"host_not_allowed"' in answer and b"2 Host headers" in answer
    assert stub.requests == []


@pytest.mark.parametrize(
    ("path", "headers", "body"),
    [
        ("/v1/completions", {}, BASE),
        ("/v1/completion-jobs", {"Idempotency-Key": "media-1"}, BASE),
        ("/v1/harvest", {}, {"model": "stub-model", "prompts": ["hello"]}),
    ],
)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_declared_as_json_is_415(client, stub, path, headers, body, content_type):
    raw = json.dumps(body).encode()
    sent = {**headers, "Content-Type": content_type} if content_type else headers
    request = client.build_request("POST", path, content=raw, headers=sent)
    if content_type is None:
        del request.headers["Content-Type"]
    response = client.send(request)
    error = assert_error(response, 415, "unsupported_media_type", should_retry=False)
    assert "application/json" in error["message"]
    assert stub.requests == []
    assert not HarvestJob.objects.exists() and not CompletionJob.objects.exists()


def test_json_with_a_charset_parameter_is_json(client, stub):
    response = client.post(
        "/v1/completions",
        content=json.dumps(BASE).encode(),
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert response.status_code == 200, response.text


def _trickle(url: str, path: str, secret: str, *, seconds: float) -> tuple[bytes, float]:
    """Send a POST whose body comes one byte every 0.2 s for `seconds`; returns what the
    server answered (b"" if nothing) and when, in seconds after the headers were sent."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(BASE).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {secret}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        sock.settimeout(0.2)
        started = time.monotonic()
        for byte in body:
            if time.monotonic() - started > seconds:
                break
            with contextlib.suppress(TimeoutError):
                answer = sock.recv(65536)
                return answer, time.monotonic() - started
            with contextlib.suppress(OSError):
                sock.sendall(bytes([byte]))
        return b"", time.monotonic() - started


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/harvest"])
def test_a_body_trickling_in_is_cut_off_with_408(
    gateway_url, api_secret, stub, model, settings, path
):
    settings.ACS_REQUEST_BODY_TIMEOUT_SECONDS = 1
    answer, after = _trickle(gateway_url, path, api_secret, seconds=6)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"code":"request_timeout"' in answer and b"retry-after: 1" in answer.lower()
    assert 0.9 <= after <= 3, after
    assert stub.requests == []


def test_a_portal_body_trickling_in_is_cut_off_with_408(gateway_url, settings):
    """Django's handler reads a portal request's body before anything else, without a limit
    of its own: the body has as long to arrive as a /v1 one."""
    settings.ACS_REQUEST_BODY_TIMEOUT_SECONDS = 1
    answer, after = _trickle(gateway_url, "/login/", "none", seconds=6)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"The request body did not arrive within 1 s." in answer
    assert 0.9 <= after <= 3, after


NUL = "a\u0000b"


@pytest.mark.parametrize(
    ("path", "headers", "body", "field"),
    [
        ("/v1/completions", {}, {**BASE, "prompt": NUL}, "prompt"),
        ("/v1/completions", {}, {**BASE, "user": NUL}, "user"),
        ("/v1/completions", {}, {**BASE, "stop": ["ok", NUL]}, "stop.1"),
        ("/v1/completion-jobs", {"Idempotency-Key": "nul-1"}, {**BASE, "prompt": NUL}, "prompt"),
        ("/v1/completion-jobs", {"Idempotency-Key": "nul-2"}, {**BASE, "user": NUL}, "user"),
        ("/v1/harvest", {}, {"model": "stub-model", "prompts": ["ok", NUL]}, "prompts.1"),
        ("/v1/harvest", {}, {"model": "stub-model", "prompts": ["ok"], "user": NUL}, "user"),
    ],
)
def test_nul_in_any_text_of_any_endpoint_is_400_naming_the_field(
    client, stub, path, headers, body, field
):
    response = client.post(path, json=body, headers=headers)
    error = assert_error(response, 400, "invalid_request", should_retry=False)
    assert f"'{field}'" in error["message"] and "NUL" in error["message"]
    assert stub.requests == []
    assert not HarvestJob.objects.exists() and not CompletionJob.objects.exists()


def test_an_escaped_backslash_before_u0000_is_ordinary_text(client, stub):
    body = {**BASE, "prompt": "C strings end in \\u0000"}
    assert "\\\\u0000" in json.dumps(body)
    assert client.post("/v1/completions", json=body).status_code == 200
