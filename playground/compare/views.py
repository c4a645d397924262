"""The comparison page: two of the user's runs side by side, and their same-token scoring
queued."""

import uuid

from django.conf import settings
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import retarget

from accounts.access import approved_required
from infra.lifecycle import WorkStatus
from infra.tasks import TaskQueueUnreachable
from playground import plots, scoring
from playground.compare import exports as compare_exports
from playground.compare import selectors as compare_selectors
from playground.compare import services as compare
from playground.compare.differences import (
    SIDES,
    activation_difference,
    logprob_differences,
    run_sequence,
    token_diff,
)
from playground.compare.figures import activation_difference_figure, logprob_difference_figure
from playground.compare.selectors import comparison_for_runs, scoring_unavailable_reason
from playground.models import Run
from playground.runs import selectors


def _run_param(request, name: str) -> Run | None:
    """The user's run named by the query or form parameter `name` (None when absent); 404
    for an id that is not a run of theirs."""
    value = request.GET.get(name) or request.POST.get(name)
    if not value:
        return None
    try:
        run_id = uuid.UUID(value)
    except ValueError:
        raise Http404(f"{name} is not a run id.") from None
    return selectors.run_for_user(user=request.user, run_id=run_id)


def _compare_response(request, run_a: Run, run_b: Run):
    context = comparison_context(run_a, run_b)
    if request.htmx:
        return render(request, "playground/compare.html#comparison_panel", context)
    return render(request, "playground/compare.html", context)


@approved_required
@require_GET
def run_compare(request):
    """Two of the user's runs compared (`?a=<run>&b=<run>`, a permalink); with a run missing,
    a form to pick it among the user's latest runs."""
    run_a, run_b = _run_param(request, "a"), _run_param(request, "b")
    if run_a is None or run_b is None:
        runs = [run for run in selectors.runs_for_user(user=request.user) if run != run_a]
        return render(
            request, "playground/compare.html", {"run_a": run_a, "run_b": run_b, "runs": runs}
        )
    return _compare_response(request, run_a, run_b)


@approved_required
@require_POST
def run_compare_score(request):
    """Queue the same-token scoring of two runs (teacher-forced requests, billed)."""
    run_a, run_b = _run_param(request, "a"), _run_param(request, "b")
    if run_a is None or run_b is None:
        raise Http404("Name both runs, a and b.")
    reason = compare_selectors.scoring_unavailable_reason(run_a, run_b)
    if reason:
        return HttpResponse(reason, status=400, content_type="text/plain; charset=utf-8")
    try:
        compare.comparison_queue(user=request.user, run_a=run_a, run_b=run_b)
    except TaskQueueUnreachable:
        # The comparison failed with the queue's message, which its panel shows; named as
        # its own target for htmx, which swaps a 503 only then (base.html).
        response = _compare_response(request, run_a, run_b)
        response.status_code = 503
        return retarget(response, "#comparison") if request.htmx else response
    if request.htmx:
        return _compare_response(request, run_a, run_b)
    return redirect(f"{reverse('playground:compare')}?a={run_a.pk}&b={run_b.pk}")


def comparison_context(run_a: Run, run_b: Run) -> dict:
    """Everything the comparison page shows about two runs (which must be the same user's)."""
    sequences = {"a": run_sequence(run_a), "b": run_sequence(run_b)}
    context = {
        "run_a": run_a,
        "run_b": run_b,
        "mean_delta_definition": scoring.MEAN_DELTA_DEFINITION,
        "sides": [("A", run_a), ("B", run_b)],
        "figures": {},
        "comparison": comparison_for_runs(run_a=run_a, run_b=run_b),
        "scoring_unavailable": scoring_unavailable_reason(run_a, run_b),
        "same_settings": run_a.body.model == run_b.body.model
        and run_a.body.steering_body() == run_b.body.steering_body(),
    }
    if sequences["a"] and sequences["b"]:
        diff = token_diff(sequences["a"], sequences["b"])
        context["diff"] = [
            {"label": side.upper(), "run": run, "tokens": diff[side]}
            for side, run in (("a", run_a), ("b", run_b))
        ]
        # Each of the two requests scores both sequences, one token generated per prompt.
        context["scoring_tokens"] = 2 * (len(sequences["a"].ids) + len(sequences["b"].ids) + 2)
    comparison = context["comparison"]
    if comparison is not None and comparison.status == WorkStatus.SUCCEEDED:
        context["notebook"] = compare_exports.compare_notebook(
            run_a, run_b, comparison.results, base_url=settings.SITE_URL
        )
        differences = logprob_differences(comparison.results)
        context["means"] = {
            side: scoring.mean_generated_delta(
                d["delta"], d["positions"], sequences[side].prompt_length
            )
            for side, d in differences.items()
        }
        for side in SIDES:
            figure = logprob_difference_figure(side, sequences[side], differences[side])
            context["figures"][f"logprob_{side}"] = plots.figure_entry(f"logprob-{side}", figure)
    activations, context["activations_missing"] = activation_difference(run_a, run_b)
    if activations is not None:
        context["activation_lengths"] = activations["lengths"]
        context["activation_positions"] = activations["norms"].shape[1]
        context["figures"]["activations"] = plots.figure_entry(
            "activation-difference", activation_difference_figure(activations)
        )
    return context
