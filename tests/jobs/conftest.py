"""Fixtures for the job APIs: the real embedded engine (one per session), the registry row
pointing at it, a temporary MEDIA_ROOT, and Celery sends recorded instead of delivered, so a
test runs each worker step itself."""

import pytest
from django.db import connections

from acs_portal.celery import app as celery_app
from api.models import LanguageModel
from api.selectors import registry_clear
from tests.conftest import ENGINE_MODEL_FIELDS

ENGINE_MODEL = "smollm2-135m"


@pytest.fixture(scope="session", autouse=True)
def short_lived_connections(tmp_path_factory):
    """The gateway's database calls run in worker threads; they must not keep connections
    open past a test (pytest-django empties, and finally drops, the test database)."""
    from django.conf import settings

    connections.settings["default"]["CONN_MAX_AGE"] = 0
    settings.ACS_TOKENIZER_CACHE_DIR = str(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture
def engine_model(db, engine_url):
    """The registry's smollm2-135m model, with both upstream lists pointing at the engine."""
    model, _ = LanguageModel.objects.update_or_create(
        name=ENGINE_MODEL,
        defaults={
            "upstream_urls": [engine_url],
            "activation_upstream_urls": [engine_url],
            **ENGINE_MODEL_FIELDS,
            "is_default": True,
        },
    )
    registry_clear()
    yield model
    registry_clear()


@pytest.fixture
def api_client(client, api_secret):
    """Django's test client sending the approved user's key."""
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {api_secret}"
    return client


@pytest.fixture(autouse=True)
def media_root(settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path / "media"
    return settings.MEDIA_ROOT


class SentTasks(list):
    """`(task name, job id, countdown)` of every task a test enqueued."""

    def ids(self, name):
        return [job_id for task, job_id, _ in self if task == name]


@pytest.fixture(autouse=True)
def sent_tasks(monkeypatch):
    sent = SentTasks()
    monkeypatch.setattr(
        celery_app,
        "send_task",
        lambda name, args, countdown=None: sent.append((name, args[0], countdown)),
    )
    return sent
