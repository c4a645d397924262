"""A new run-page figure is one `run_figures.FIGURES` entry and its builder: the page draws it
in its section with its picker, `run_figure` redraws it for a picked value, and refuses a value
its picker does not offer."""

import plotly.graph_objects as go
import pytest
from django.urls import reverse

from playground.runs import registry as run_figures

from .conftest import HTMX
from .test_views import finished_run


def _chosen_logprob(drawing: run_figures.Drawing) -> go.Figure:
    """A figure of one position's chosen-token logprob, the position picked by the picker."""
    scored = [p for p in drawing.positions if p["logprob"] is not None]
    position = drawing.picked("position", scored[-1]["position"])
    chosen = next(p for p in scored if p["position"] == position)
    return go.Figure(go.Bar(x=[chosen["label"]], y=[chosen["logprob"]]))


ENTRY = run_figures.RunFigure(
    name="chosen_logprob",
    section=run_figures.TOKENS,
    shown=lambda d: any(p["logprob"] is not None for p in d.positions),
    draw=_chosen_logprob,
    picker=run_figures.Picker(
        "position",
        "Chosen at",
        options=lambda d: [(p["position"], p["label"]) for p in d.positions if p["logprob"]],
        picked=lambda d: d.picked("position", d.positions[-1]["position"]),
    ),
)


@pytest.fixture
def registered(listed_model, monkeypatch):
    monkeypatch.setattr(run_figures, "FIGURES", [*run_figures.FIGURES, ENTRY])
    monkeypatch.setitem(run_figures.BY_NAME, ENTRY.name, ENTRY)


@pytest.mark.parametrize("headers", [{}, HTMX], ids=["page", "htmx"])
def test_a_registered_figure_is_drawn_on_the_run_page_with_its_picker(
    client, approved_user, registered, headers
):
    client.force_login(approved_user)
    run = finished_run(approved_user)
    page = client.get(reverse("playground:run_detail", args=[run.id]), **headers)
    body = page.content.decode()
    assert page.status_code == 200
    assert 'id="figure-slot-chosen_logprob"' in body
    assert '<script id="chosen_logprob" type="application/json">' in body
    picker = body.split('data-picker="chosen_logprob"')[1].split("</select>")[0]
    assert "Chosen at" in body and picker.count("<option") >= 2
    figure_url = reverse("playground:run_figure", args=[run.id, "chosen_logprob"])
    assert f'hx-get="{figure_url}"' in body


def test_a_registered_figure_redraws_for_an_offered_pick_and_refuses_another(
    client, approved_user, registered
):
    client.force_login(approved_user)
    run = finished_run(approved_user)
    figure_url = reverse("playground:run_figure", args=[run.id, "chosen_logprob"])
    first = client.get(figure_url + "?position=1", **HTMX)
    assert (
        first.status_code == 200 and 'data-figure-name="chosen_logprob"' in first.content.decode()
    )
    assert client.get(figure_url + "?position=1").status_code == 200
    assert client.get(figure_url + "?position=999", **HTMX).status_code == 404
    assert client.get(figure_url + "?position=x", **HTMX).status_code == 404


def test_an_unregistered_figure_name_is_a_404(client, approved_user, registered):
    client.force_login(approved_user)
    run = finished_run(approved_user)
    url = reverse("playground:run_figure", args=[run.id, "no_such_figure"])
    assert client.get(url, **HTMX).status_code == 404
