"""A run's stored request is read through the wire model (`Run.body`), never as a dict: a
request stored before fields and limits were added still loads with the wire defaults and
shows; no playground or portal module reads a run's `request` by key, and none spells the
activation fields' keys but through `acs_client.protocol`."""

import ast
import re
from pathlib import Path

import pytest
from django.urls import reverse

from acs_client.protocol import XARGS_CAPTURE, XARGS_STEERING
from infra.lifecycle import WorkStatus
from playground.models import Run

ROOT = Path(__file__).resolve().parents[2]

# As the first runs stored it: no return_token_ids, a temperature above today's cap of 2 (the
# gateway refused it, and the run failed), and a steering entry with its scale left out.
OLD_REQUEST = {
    "model": "smollm2-135m",
    "prompt": "I feel",
    "max_tokens": 4,
    "temperature": 3.0,
    XARGS_STEERING: [{"activations": {"data": "AAAA", "shape": [1, 576]}, "layer_indices": [6]}],
}


@pytest.mark.django_db
@pytest.mark.usefixtures("listed_model")
def test_an_old_runs_request_loads_with_the_wire_defaults_and_its_page_shows_them(
    ada, approved_user
):
    run = Run.objects.create(
        user=approved_user,
        request=OLD_REQUEST,
        status=WorkStatus.FAILED,
        error_code="invalid_request",
        error_message="Invalid value for 'temperature'.",
    )
    assert run.body.temperature == 3.0 and run.body.return_token_ids is False
    assert run.body.steering.scale == 1.0 and run.body.steering.norm_match is False
    page = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    # The steering entry's scale, which the request left to its default of 1.
    assert re.search(r"Steered with a vector × 1 at layer 6, every position\.", page)
    edit = ada.get(reverse("playground:run_edit", args=[run.id])).content.decode()
    assert re.search(r'name="temperature"[^>]*value="3.0"', edit)


def playground_modules():
    for app in ("playground", "portal"):
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" not in path.parts:
                yield path


def docstrings(tree) -> set[int]:
    """The ids of the docstring constants of a module and its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            found.add(id(first.value))
    return found


def raw_request_reads(tree) -> list[str]:
    """`x.request[...]` and `x.request.get(...)`: a stored request read as a dict."""
    found = []
    for node in ast.walk(tree):
        is_read = isinstance(node, ast.Subscript) or (
            isinstance(node, ast.Attribute) and node.attr == "get"
        )
        read = node.value if is_read else None
        if isinstance(read, ast.Attribute) and read.attr == "request":
            found.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
    return found


def activation_key_literals(tree) -> list[str]:
    """The activation fields' keys written out as strings (docstrings aside)."""
    skip = docstrings(tree)
    return [
        f"line {node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in (XARGS_STEERING, XARGS_CAPTURE)
        and id(node) not in skip
    ]


def test_no_module_reads_a_stored_request_as_a_dict_or_spells_its_activation_keys():
    found = []
    for path in playground_modules():
        tree = ast.parse(path.read_text(), str(path))
        name = path.relative_to(ROOT)
        found += [f"{name} {line}" for line in raw_request_reads(tree)]
        found += [f"{name} {line}" for line in activation_key_literals(tree)]
    for path in (ROOT / "templates").rglob("*.html"):
        found += [
            f"{path.relative_to(ROOT)}: {m}"
            for m in re.findall(r"run\.request\.\w+", path.read_text())
        ]
    assert found == []
