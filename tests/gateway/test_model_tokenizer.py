"""A tokenizer.json attached to a model row: plain vLLM serves none, so without it the
gateway asks the upstream to count every prompt (POST /tokenize)."""

import io

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from django.urls import reverse

from api.models import LanguageModel
from api.services import InvalidTokenizer, language_model_tokenizer_set
from tests.accounts.support import logged_in

from .conftest import make_model

pytestmark = pytest.mark.django_db(transaction=True)

PROMPTS = ["the capital of france is", "hello", "the capital of paris"]


@pytest.fixture
def plain_vllm(stub, model):
    """A second model in front of the stub, which (like plain vLLM) serves no tokenizer.json."""
    stub.mode["serve_tokenizer_json"] = False
    make_model(stub.url, name="plain-vllm", is_default=False)
    return LanguageModel.objects.get(name="plain-vllm")


def complete_each(client, model_name):
    for prompt in PROMPTS:
        body = {"model": model_name, "prompt": prompt, "max_tokens": 1}
        assert client.post("/v1/completions", json=body).status_code == 200


def test_without_a_tokenizer_the_gateway_asks_plain_vllm_to_count_each_prompt(
    client, stub, plain_vllm
):
    complete_each(client, "plain-vllm")
    assert stub.paths.count("/tokenize") == len(PROMPTS)


def test_an_attached_tokenizer_counts_prompts_without_asking_the_upstream(
    client, stub, plain_vllm, api_key, exact_budgets
):
    from metering.models import BudgetReservation

    language_model_tokenizer_set(model=plain_vllm, content=stub.tokenizer_json)
    complete_each(client, "plain-vllm")
    assert "/tokenize" not in stub.paths
    assert "/tokenizer.json" not in stub.paths
    # The budget was held with the upstream's own count.
    held = sorted(BudgetReservation.objects.filter(key=api_key).values_list("prompt_tokens"))
    assert held == sorted((stub.count(prompt),) for prompt in PROMPTS)


def test_the_tokenizer_in_the_rows_weights_directory_counts_prompts_without_the_upstream(
    client, stub, plain_vllm, api_key, exact_budgets, tmp_path
):
    """A row registered as docs/deploy.md §5 says (its weights directory, no attached file)
    counts and names tokens with the model's directory's tokenizer.json."""
    from metering.models import BudgetReservation

    (tmp_path / "tokenizer.json").write_bytes(stub.tokenizer_json)
    make_model(stub.url, name="plain-vllm", is_default=False, weights_dir=str(tmp_path))
    complete_each(client, "plain-vllm")
    assert "/tokenize" not in stub.paths
    assert "/tokenizer.json" not in stub.paths
    held = sorted(BudgetReservation.objects.filter(key=api_key).values_list("prompt_tokens"))
    assert held == sorted((stub.count(prompt),) for prompt in PROMPTS)


def test_a_replaced_tokenizer_is_used_once_the_registry_is_read_again(client, stub, plain_vllm):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    language_model_tokenizer_set(model=plain_vllm, content=stub.tokenizer_json)
    complete_each(client, "plain-vllm")
    # A tokenizer that splits "france" into more tokens than the stub's: the context check
    # (max_model_len 64) must see the new count.
    characters = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    characters.pre_tokenizer = Whitespace()
    language_model_tokenizer_set(model=plain_vllm, content=characters.to_str().encode())
    make_model(stub.url, name="plain-vllm", is_default=False)  # clears the registry cache
    long_prompt = " ".join(["x"] * 70)
    body = {"model": "plain-vllm", "prompt": long_prompt, "max_tokens": 1}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "/tokenize" not in stub.paths


def test_a_file_that_is_not_a_tokenizer_is_refused(plain_vllm):
    with pytest.raises(InvalidTokenizer, match=r"not a tokenizer\.json"):
        language_model_tokenizer_set(model=plain_vllm, content=b'{"model": "nope"}')
    with pytest.raises(InvalidTokenizer, match="not UTF-8"):
        language_model_tokenizer_set(model=plain_vllm, content=b"\xff\xfe")
    plain_vllm.refresh_from_db()
    assert plain_vllm.tokenizer_sha256 == ""


def test_staff_attach_a_tokenizer_in_the_admin(staff_user, stub, plain_vllm):
    staff_user.is_superuser = True
    staff_user.save()
    browser = logged_in(staff_user)
    url = reverse("admin:api_languagemodel_change", args=[plain_vllm.pk])
    fields = {
        "name": "plain-vllm",
        "served_model_name": "",
        "upstream_urls": f'["{stub.url}"]',
        "activation_upstream_urls": "[]",
        "max_model_len": 64,
        "n_layers": 4,
        "hidden_size": 8,
        "vocab_size": 1000,
        "max_logprobs": 100,
        "status": "live",
    }
    refused = browser.post(
        url, {**fields, "tokenizer_file": SimpleUploadedFile("t.json", b"[1, 2]")}
    )
    assert refused.status_code == 200
    assert "not a tokenizer.json" in refused.content.decode()
    upload = SimpleUploadedFile("tokenizer.json", stub.tokenizer_json)
    assert browser.post(url, {**fields, "tokenizer_file": upload}).status_code == 302
    plain_vllm.refresh_from_db()
    assert plain_vllm.tokenizer_json == stub.tokenizer_json.decode()
    assert len(plain_vllm.tokenizer_sha256) == 64
    assert browser.post(url, {**fields, "remove_tokenizer": "on"}).status_code == 302
    plain_vllm.refresh_from_db()
    assert (plain_vllm.tokenizer_json, plain_vllm.tokenizer_sha256) == ("", "")


def test_the_command_attaches_and_removes_a_tokenizer(stub, plain_vllm, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(stub.tokenizer_json)
    out = io.StringIO()
    call_command("acs_model_tokenizer", "plain-vllm", str(path), stdout=out)
    assert "attached to plain-vllm" in out.getvalue()
    plain_vllm.refresh_from_db()
    assert plain_vllm.tokenizer_sha256
    call_command("acs_model_tokenizer", "plain-vllm", "--remove", stdout=out)
    plain_vllm.refresh_from_db()
    assert plain_vllm.tokenizer_sha256 == ""
    with pytest.raises(CommandError, match="No model is called 'nope'"):
        call_command("acs_model_tokenizer", "nope", str(path))
    with pytest.raises(CommandError, match="Cannot read"):
        call_command("acs_model_tokenizer", "plain-vllm", str(tmp_path / "missing.json"))


def test_counting_on_an_unreachable_upstream_goes_through_its_circuit_breaker(
    client, stub, model, redis_client
):
    """Without a tokenizer the gateway counts with the upstream's POST /tokenize, on the
    same path as completions: its failures feed the upstream's circuit breaker."""
    from api.selectors import upstream_states
    from api.upstream import FAILURE_THRESHOLD

    make_model("http://127.0.0.1:9", name="unreachable", is_default=False)
    body = {"model": "unreachable", "prompt": "hello", "max_tokens": 1}
    for _ in range(FAILURE_THRESHOLD):
        response = client.post("/v1/completions", json=body)
        assert response.json()["error"]["code"] == "upstream_unreachable"
    state = next(s for s in upstream_states() if s["model"] == "unreachable")
    assert state["state"] == "open"
    assert client.post("/v1/completions", json=body).json()["error"]["code"] == "circuit_open"
