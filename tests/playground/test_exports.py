"""Downloads of a page's numbers (issue 37, item 4): every figure offers its numbers as CSV
and JSON (drawn from the data the page embeds, by static/js/exports.js: see
tests/browser/test_exports.py); a steering comparison or sweep downloads its arms, only for
its owner. The numbers themselves are checked against numpy in test_figure_numbers.py
(sweeps) and test_patching.py (grids)."""

import csv
import io

import pytest
from django.urls import reverse

from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind

from .conftest import recorded

pytestmark = pytest.mark.django_db


pytestmark = pytest.mark.usefixtures("listed_model")


def test_every_figure_offers_its_numbers_as_csv_and_json(client, approved_user):
    client.force_login(approved_user)
    run = Run.objects.create(
        user=approved_user, status=WorkStatus.SUCCEEDED, response=recorded("capture.json"),
        request={"model": "smollm2-135m", "prompt": "Hello world, this is", "max_tokens": 1,
                 "output_residual_stream": [0, 4, 8]},
    )  # fmt: skip
    page = client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    for name in ("heatmap", "norm_by_layer", "cosine", "pca"):
        for file_format in ("csv", "json"):
            button = f'data-figure-export="{file_format}" data-figure="{name}"'
            assert button in page, (name, file_format)
    assert "js/exports.js" in page


def test_a_comparisons_numbers_download_for_its_owner_only(client, approved_user, other_user):
    group = Run.objects.create(
        user=approved_user, kind=RunKind.STEERING_BASELINE, scale=0.0, group=None,
        status=WorkStatus.SUCCEEDED, response=recorded("steer_baseline.json"),
        request={"model": "smollm2-135m", "prompt": "I think", "max_tokens": 4},
    )  # fmt: skip
    group.group = group.pk
    group.save(update_fields=["group"])
    client.force_login(approved_user)
    rows = list(csv.DictReader(io.StringIO(
        client.get(reverse("playground:group_csv", args=[group.pk])).content.decode()
    )))  # fmt: skip
    assert [(row["role"], row["run"]) for row in rows] == [("baseline", str(group.pk))]
    assert rows[0]["text"] == recorded("steer_baseline.json")["choices"][0]["text"]
    client.force_login(other_user)
    for name in ("group_csv", "group_json"):
        assert client.get(reverse(f"playground:{name}", args=[group.pk])).status_code == 404
