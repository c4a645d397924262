"""The official openai SDK against the live gateway, and the read endpoints."""

import time

import httpx
import openai
import pytest
from asgiref.sync import async_to_sync

from api import openapi
from api.completions import completion_run
from api.models import LanguageModel
from api.selectors import registry_clear, upstream_states
from metering.models import UsageRecord

from .conftest import SETTLED_HOOKS

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sdk(gateway_url, api_secret, model):
    return openai.OpenAI(
        base_url=f"{gateway_url}/v1",
        api_key=api_secret,
        max_retries=0,
        http_client=httpx.Client(event_hooks=SETTLED_HOOKS),
    )


def test_sdk_completion(sdk, stub):
    completion = sdk.completions.create(model="stub-model", prompt="hello", max_tokens=3)
    assert completion.choices[0].text == " tok tok tok"
    assert completion.usage.total_tokens == 4


def test_sdk_choices_are_ordered_by_prompt_then_sample(sdk, stub):
    completion = sdk.completions.create(
        model="stub-model", prompt=["hello", "the capital"], max_tokens=1, n=2
    )
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]


def test_sdk_streaming_with_include_usage(sdk, stub):
    stream = sdk.completions.create(
        model="stub-model",
        prompt="hello",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok tok tok"
    assert chunks[-1].usage.completion_tokens == 3


def test_sdk_prompt_logprobs_via_extra_body(sdk, stub):
    completion = sdk.completions.create(
        model="stub-model",
        prompt="the capital",
        max_tokens=1,
        extra_body={"prompt_logprobs": 5},
    )
    assert stub.requests[-1]["prompt_logprobs"] == 5
    assert completion.choices[0].model_extra["prompt_logprobs"][0] is None


def test_sdk_sees_error_codes(sdk, stub):
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.completions.create(model="nope", prompt="hello", max_tokens=1)
    assert raised.value.code == "model_not_found"
    assert raised.value.response.headers["X-Should-Retry"] == "false"


def test_models_list_has_capabilities(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    card = body["data"][0]
    assert card["id"] == "stub-model" and card["object"] == "model" and card["status"] == "live"
    assert card["default"] is True
    assert card["capabilities"] == {
        "max_model_len": 64,
        "max_logprobs": 100,
        "full_vocab_max_prompt_tokens": 256,
        "activations": True,
        "n_layers": 4,
        "hidden_size": 8,
        "vocab_size": 1000,
        "max_steering_vectors": 8,
    }


def test_model_detail_and_unknown_model(client):
    assert client.get("/v1/models/stub-model").json()["id"] == "stub-model"
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == "model_not_found"


def test_an_unknown_model_id_gets_the_status_the_table_and_openapi_give_model_not_found(client):
    from api.errors import ERROR_CODES

    paths = openapi.openapi_document()["paths"]
    for path, documented in [
        ("/v1/models/nope", paths["/v1/models/{model_id}"]["get"]),
        ("/v1/models/nope/status", paths["/v1/models/{model_id}/status"]["get"]),
    ]:
        response = client.get(path)
        assert response.json()["error"]["code"] == "model_not_found"
        assert response.status_code == ERROR_CODES["model_not_found"].status == 400
        assert "model_not_found" in documented["responses"]["400"]["description"]


def test_model_status_reports_warm_from_upstream_health(client, stub):
    assert client.get("/v1/models/stub-model/status").json()["warm"] is True
    stub.mode["healthy"] = False
    body = client.get("/v1/models/stub-model/status").json()
    assert body == {
        "id": "stub-model",
        "object": "model.status",
        "status": "live",
        "warm": False,
        "upstreams": [{"ok": False, "model_loaded": False}],
    }


def test_disabled_model_is_not_found(client):
    LanguageModel.objects.update(status="disabled")
    registry_clear()
    response = client.post("/v1/completions", json={"model": "stub-model", "prompt": "hello"})
    assert response.json()["error"]["code"] == "model_not_found"


def test_usage_lists_key_and_account_windows(client, stub):
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    windows = {w["name"]: w for w in client.get("/v1/usage").json()["windows"]}
    assert windows["key_daily"]["used"] == 3
    assert windows["key_daily"]["remaining"] == windows["key_daily"]["limit"] - 3
    assert windows["account_monthly"]["used"] == 3
    assert windows["key_monthly"]["resets_at"].endswith("+00:00")


def test_models_and_usage_need_a_key(gateway_url, model):
    for path in ("/v1/models", "/v1/usage", "/v1/models/stub-model/status"):
        response = httpx.get(gateway_url + path)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "missing_authorization"


def test_openapi_document_and_docs_page(gateway_url, model):
    document = httpx.get(f"{gateway_url}/v1/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert "/v1/completions" in document["paths"]
    assert "prompt_logprobs" in document["components"]["schemas"]["CompletionRequest"]["properties"]
    codes = {row["code"] for row in document["x-error-codes"]}
    assert {"queue_full", "circuit_open", "deadline_infeasible"} <= codes
    page = httpx.get(f"{gateway_url}/docs/")
    assert page.status_code == 200 and "circuit_open" in page.text
    assert httpx.get(f"{gateway_url}/v1/docs").status_code == 200


def test_completion_run_is_the_non_streaming_path(api_key, model, stub, gateway_url):
    result = async_to_sync(completion_run)(
        key=api_key,
        payload={"model": "stub-model", "prompt": "hello", "max_tokens": 2},
        request_id="job-1",
        endpoint="completion-jobs",
        workload="batch",
    )
    assert result.status == 200 and result.body["usage"]["completion_tokens"] == 2
    assert "Server-Timing" in result.headers
    record = UsageRecord.objects.get(request_id="job-1")
    assert record.endpoint == "completion-jobs" and record.workload == "batch"
    refused = async_to_sync(completion_run)(
        key=api_key, payload={"prompt": "hello", "n": 2}, request_id="job-2"
    )
    assert refused.status == 400 and refused.body["error"]["code"] == "invalid_request"
    assert refused.headers == {"X-Should-Retry": "false"}


def test_tokens_are_counted_through_tokenize_without_tokenizer_json(client, stub):
    from api import tokenizer

    stub.mode["serve_tokenizer_json"] = False
    LanguageModel.objects.update(name="other-model")
    registry_clear()
    tokenizer._tokenizers.clear()
    response = client.post(
        "/v1/completions",
        json={"model": "other-model", "prompt": "the capital of", "max_tokens": 1},
    )
    assert response.json()["usage"]["prompt_tokens"] == 3
    assert "/tokenize" in stub.paths and "/tokenizer.json" in stub.paths
    too_long = client.post(
        "/v1/completions", json={"model": "other-model", "prompt": "hello " * 60, "max_tokens": 5}
    )
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_upstream_states_for_the_staff_overview(stub, model, redis_client):
    from api import upstream

    redis_client.set(upstream.circuit_keys(stub.url)[0], int((time.time() + 60) * 1000))
    states = upstream_states()
    assert states == [
        {
            "model": "stub-model",
            "url": stub.url,
            "kind": "completions",
            "state": "open",
            "recent_failures": 0,
            "open_until": states[0]["open_until"],
        }
    ]
    redis_client.delete(upstream.circuit_keys(stub.url)[0])
    assert upstream_states()[0]["state"] == "closed"


def test_tokenizer_json_is_fetched_once_and_cached_on_disk(client, stub):
    from api import tokenizer

    tokenizer._tokenizers.clear()
    tokenizer._missing_until.clear()
    cached = tokenizer._cache_path("stub-model", stub.url)
    cached.unlink(missing_ok=True)
    body = {"prompt": "the capital of", "max_tokens": 1}
    for _ in range(3):
        assert client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"] == 3
    assert stub.paths.count("/tokenizer.json") == 1 and "/tokenize" not in stub.paths
    assert cached.read_bytes() == stub.tokenizer_json
    tokenizer._tokenizers.clear()  # a new process: loads from the file, not the upstream
    assert client.post("/v1/completions", json=body).status_code == 200
    assert stub.paths.count("/tokenizer.json") == 1


def test_every_error_code_the_gateway_raises_is_in_the_one_table():
    """Each `ApiError("code", ...)` in the source names a code of
    `api.errors.ERROR_CODES` (which the OpenAPI document and the upstream mapping read)."""
    import re
    from pathlib import Path

    from api.errors import ERROR_CODES

    raised = {
        code
        for path in Path(__file__).resolve().parents[2].glob("api/**/*.py")
        for code in re.findall(r'ApiError\(\s*"([a-z_]+)"', path.read_text())
    }
    assert "worker_lost" in raised
    assert raised - set(ERROR_CODES) == set()


def _routed_v1_paths() -> dict[str, tuple]:
    """OpenAPI path → the methods its view allows (empty: any), for every /v1 endpoint the
    URL configuration routes, plus the plain ASGI /v1/completions."""
    import re

    from django.urls import URLResolver, get_resolver

    routed = {"/v1/completions": ("POST",)}
    for entry in get_resolver().url_patterns:
        if isinstance(entry, URLResolver) and str(entry.pattern) == "v1/":
            for route in entry.url_patterns:
                path = "/v1/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", str(route.pattern))
                routed[path] = getattr(route.callback, "allowed_methods", ())
    return routed


def test_the_openapi_document_describes_every_routed_v1_operation():
    document = openapi.openapi_document()
    routed = _routed_v1_paths()
    assert routed["/v1/harvest/{job_id}"] == ("GET", "DELETE")
    assert "/v1/completion-jobs/{job_id}/result" in routed
    for path, methods in routed.items():
        assert path in document["paths"], f"{path} is routed but not documented"
        documented = {method.upper() for method in document["paths"][path]}
        assert set(methods) <= documented, f"{path}: {set(methods) - documented} undocumented"
    submit = document["paths"]["/v1/completion-jobs"]["post"]
    assert {"name": "Idempotency-Key", "in": "header", "required": True}.items() <= (
        submit["parameters"][0].items()
    )
    assert "HarvestRequest" in document["components"]["schemas"]


def test_the_docs_page_lists_every_documented_operation(gateway_url, model):
    page = httpx.get(f"{gateway_url}/docs/").text
    for path, operations in openapi.openapi_document()["paths"].items():
        for method in operations:
            assert f"{method.upper()} {path}" in page
