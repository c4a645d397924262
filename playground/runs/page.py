"""The run page's context: the request and response as shown (long data shortened; the
downloads stay exact), the code that sends the request again, and the figures of each
section for a drawing's picks."""

import json

from django.conf import settings

from acs_client.protocol import XARGS_STEERING
from infra.lifecycle import WorkStatus
from playground.models import Run
from playground.probes.strip import score_strip_section
from playground.runs import selectors
from playground.runs.registry import (
    ACTIVATIONS,
    LENS,
    TOKENS,
    Drawing,
    section_entries,
)
from playground.vectors.captures import steered_positions
from playground.vectors.forms import SaveVectorForm

# Responses above this size are shown shortened on the run page (downloads stay exact).
RESPONSE_SHOWN_CHARS = 200_000


def _pretty_response(response: dict | None) -> str:
    if response is None:
        return ""
    shown = json.loads(json.dumps(response))
    stream = (shown.get("activations") or {}).get("residual_stream")
    if stream and isinstance(stream.get("data"), str):
        stream["data"] = f"<{len(stream['data']):,} characters of base64; download below>"
    text = json.dumps(shown, indent=2, ensure_ascii=False)
    if len(text) > RESPONSE_SHOWN_CHARS:
        return text[:RESPONSE_SHOWN_CHARS] + f"\n… {len(text) - RESPONSE_SHOWN_CHARS:,} more"
    return text


def _pretty_request(request: dict) -> str:
    shown = json.loads(json.dumps(request))
    for vector in shown.get(XARGS_STEERING) or []:
        data = (vector.get("activations") or {}).get("data")
        if isinstance(data, str) and len(data) > 80:
            vector["activations"]["data"] = (
                data[:60]
                + f"…({len(data):,} characters: the whole request is in the download below)"
            )
    return json.dumps(shown, indent=2, ensure_ascii=False)


def run_context(run: Run, choice: int = 0, save_vector_form=None, lens_query=None) -> dict:
    """The run page; per-choice figures (tokens, top-k, surprisal, distribution) show
    choice number `choice`, and the lens section the picks of `lens_query`."""
    context = {
        "run": run,
        "request_json": _pretty_request(run.request),
        "snippets": selectors.run_code_snippets(run, base_url=settings.SITE_URL),
        "steered_positions": steered_positions(run),
        "figures": [],
        "choices": [],
        "shown_choice": choice,
    }
    if run.status != WorkStatus.SUCCEEDED or not run.response:
        return context
    response = run.response
    context["response_json"] = _pretty_response(response)
    context["choices"] = response.get("choices") or []
    if not context["choices"]:
        return context
    drawing = Drawing(run, choice=choice, query=lens_query)
    token_figures = section_entries(drawing, TOKENS)
    context["figures"] = list(token_figures.values())
    if "tokens" in token_figures:
        context["positions"] = drawing.positions
    if drawing.capture is not None:
        context["activations"] = activations_section_context(run, drawing)
        context["lens"] = lens_section_context(drawing)
        context["probe_strip"] = score_strip_section(run, drawing.capture)
        context["save_vector_form"] = save_vector_form or SaveVectorForm(
            run=run, capture=drawing.capture
        )
    return context


def activations_section_context(run: Run, drawing: Drawing) -> dict:
    """The activation section of a run's page: its figures for the drawing's picks, and the
    choices of its window's pickers."""
    capture, picks = drawing.capture, drawing.picks
    count = capture.tensor.shape[1]
    return {
        "positions": list(enumerate(capture.labels)),
        "prompt_length": capture.prompt_length,
        "count": count,
        "picks": picks,
        "window_rows": picks.window.rows(count),
        "figures": list(section_entries(drawing, ACTIVATIONS).values()),
        "window_error": picks.window_error,
        "tokens_known": any(row.token is not None for row in capture.rows),
    }


def lens_section_context(drawing: Drawing) -> dict:
    """The lens section: its picks and notes, its figures from the registry."""
    return {**drawing.lens, "figures": section_entries(drawing, LENS)}
