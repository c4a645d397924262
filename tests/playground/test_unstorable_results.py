"""A playground run whose answer is an error, or whose result the database cannot hold, fails
with a message a person can read instead of staying `running`: the worker, the live gateway
and the real engine."""

import pytest

from api.models import LanguageModel
from api.selectors import registry_clear
from infra.lifecycle import WorkStatus
from metering.models import UsageRecord
from playground.runs.execution import run_execute
from playground.runs.services import run_create
from tests.conftest import ENGINE_MODEL_FIELDS
from tests.gateway.conftest import wait_settled
from tests.overflow import overflowing_steering

from .conftest import replay

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "smollm2-135m"
NUL_TOKEN = 190  # decodes to "\x00", which PostgreSQL's JSON cannot hold


@pytest.fixture
def live_engine(engine_url, gateway_url, settings, redis_client, no_enqueue):
    """The worker sends its runs to the live gateway, in front of the real engine."""
    LanguageModel.objects.all().delete()
    LanguageModel.objects.create(
        name=MODEL, upstream_urls=[engine_url], **ENGINE_MODEL_FIELDS, is_default=True
    )
    registry_clear()
    settings.GATEWAY_URL = gateway_url
    yield
    wait_settled()
    registry_clear()


def execute(user, request: dict):
    run = run_create(user=user, request=request)
    return run_execute(run_id=run.id)


@pytest.mark.parametrize("stream", [False, True])
def test_a_steered_run_that_would_overflow_fails_with_the_apis_message(
    approved_user, live_engine, stream
):
    request = {
        "model": MODEL,
        "prompt": "Hello there",
        "max_tokens": 6,
        "stream": stream,
        "apply_steering_vectors": overflowing_steering(576),
    }
    run = execute(approved_user, request)
    assert run.status == WorkStatus.FAILED
    assert run.error_code == "invalid_request"
    assert "overflows the residual stream" in run.error_message
    assert replay(run.id)[-1]["error"]["code"] == "invalid_request"


def test_a_run_whose_result_the_database_refuses_fails_once_billed_once(approved_user, live_engine):
    request = {"model": MODEL, "prompt": [81, NUL_TOKEN, 82], "max_tokens": 2, "echo": True}
    run = execute(approved_user, request)
    assert run.status == WorkStatus.FAILED
    assert run.error_code == "result_unstorable"
    assert "could not be stored" in run.error_message
    assert run.request_id in run.error_message
    wait_settled()
    record = UsageRecord.objects.get()
    assert record.request_id == run.request_id
    assert (record.prompt_tokens, record.completion_tokens) == (3, 2)
    assert replay(run.id)[-1]["error"]["code"] == "result_unstorable"
