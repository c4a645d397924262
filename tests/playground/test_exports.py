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
from playground import exports
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


FORMULAS = ["=1+1", "+SUM(A1)", "-", "@user", "\t=cmd", "\r=cmd", "-2+3", '=HYPERLINK("x")']


def test_csv_text_a_spreadsheet_would_run_as_a_formula_starts_with_a_quote():
    """OWASP's rule against CSV injection: a text cell starting with = + - @, a tab or a
    carriage return gets a leading '. Numbers stay numbers, and so does text that is a
    number ("-1.25"), which a spreadsheet reads as that number, not as a formula."""
    records = [{"token": text, "value": -1.25} for text in FORMULAS]
    records += [{"token": text, "value": 0} for text in ("-1.25", "+3", "-2e-05", "a=b", " -")]
    rows = list(csv.DictReader(io.StringIO(exports.records_csv(records), newline="")))
    assert [row["token"] for row in rows] == [
        *("'" + text for text in FORMULAS), "-1.25", "+3", "-2e-05", "a=b", " -"
    ]  # fmt: skip
    assert {row["value"] for row in rows} == {"-1.25", "0"}


def test_a_comparisons_csv_quotes_a_generated_text_that_is_a_formula(client, approved_user):
    answer = recorded("steer_baseline.json")
    answer["choices"][0]["text"] = '=HYPERLINK("http://example.com", "x")'
    group = Run.objects.create(
        user=approved_user, kind=RunKind.STEERING_BASELINE, scale=0.0, group=None,
        status=WorkStatus.SUCCEEDED, response=answer,
        request={"model": "smollm2-135m", "prompt": "I think", "max_tokens": 4},
    )  # fmt: skip
    group.group = group.pk
    group.save(update_fields=["group"])
    client.force_login(approved_user)
    as_csv = client.get(reverse("playground:group_csv", args=[group.pk])).content.decode()
    [row] = csv.DictReader(io.StringIO(as_csv))
    assert row["text"] == "'" + answer["choices"][0]["text"]
    assert row["scale_sent"] == "0.0"
    document = client.get(reverse("playground:group_json", args=[group.pk])).json()
    assert document["arms"][0]["text"] == answer["choices"][0]["text"]
