"""The activation patching pages (see `services`): the form with the user's latest grid, a
grid's permalink (its htmx partial while it runs; `?metric=` picks the metric shown), its
downloads, and cancelling a grid."""

from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import reswap, retarget

from accounts.access import approved_required
from infra.tasks import TaskQueueUnreachable
from playground import exports
from playground.patching import services as patching
from playground.patching.forms import PatchingForm
from playground.patching.grid import PatchingGrid, latest_patching_group, patching_grid_for_user
from playground.runs.views import models_and_capabilities, with_new_submit_token

GRID_PARTIAL = "playground/patching_grid.html#grid_panel"
FORM_PARTIAL = "playground/patching.html#patching_form"


class BadMetric(Exception):
    """A `metric` the grid's requests did not score."""


def _grid(request, group) -> PatchingGrid:
    """The user's grid showing the `metric` of the query (its own when absent); 404 for
    another user's grid, BadMetric for a metric it has not."""
    metric = request.GET.get("metric", "")
    grid = patching_grid_for_user(user=request.user, group=group, metric=metric)
    if grid is None:
        raise Http404("No such patching grid.")
    if metric and metric not in grid.metrics:
        raise BadMetric(
            f"metric must be one of {', '.join(grid.metrics)} for this grid"
            + ("" if len(grid.metrics) > 1 else " (it has no corrupted target)")
            + "."
        )
    return grid


def _bad_metric(error: BadMetric) -> HttpResponse:
    return HttpResponse(str(error), status=400, content_type="text/plain; charset=utf-8")


def _page(request, form, status=200):
    models, capabilities = models_and_capabilities(request)
    group = latest_patching_group(user=request.user)
    context = {
        "form": form or PatchingForm(capabilities=capabilities),
        "models": models,
        "capabilities": capabilities,
        "grid": patching_grid_for_user(user=request.user, group=group) if group else None,
        "repeats": patching.PATCHING_REPEATS,
        # The captures, the clean baseline and the repeats.
        "extra_requests": 3 + patching.PATCHING_REPEATS,
    }
    return render(request, "playground/patching.html", context, status=status)


@approved_required
@require_GET
@never_cache
def patching_page(request):
    """The form, and below it the user's latest grid (followed while it runs), so that a
    reload or Back keeps showing it. For htmx's model picker (`?model=` with the form's
    fields), the form alone for that model, keeping what was typed."""
    if request.htmx and request.htmx.target == "patching-form":
        models, capabilities = models_and_capabilities(request)
        typed = {name: request.GET.get(f"{PatchingForm.prefix}-{name}") for name in TYPED_FIELDS}
        form = PatchingForm(initial=typed, capabilities=capabilities)
        return render(request, FORM_PARTIAL, {"form": form, "models": models})
    return _page(request, None)


# What a change of model keeps of the form (the submit token is new each time it is drawn).
TYPED_FIELDS = (
    "clean_prompt", "corrupted_prompt", "target", "corrupted_target", "metric", "layers",
    "positions",
)  # fmt: skip


def _form_errors(request, form):
    """The form with its errors: for htmx only the form, swapped over the old one; otherwise
    the whole page with status 400."""
    if request.htmx:
        models, _ = models_and_capabilities(request)
        response = render(request, FORM_PARTIAL, {"form": form, "models": models})
        return reswap(retarget(response, "#patching-form"), "outerHTML")
    return _page(request, form, status=400)


@approved_required
@require_POST
def patching_submit(request):
    _, capabilities = models_and_capabilities(request)
    form = PatchingForm(request.POST, capabilities=capabilities)
    if not form.is_valid():
        return _form_errors(request, form)
    data = form.cleaned_data
    targets = data["targets"]
    try:
        group = patching.patching_grid_create(
            user=request.user,
            model=capabilities.id,
            clean_prompt=data["clean_prompt"],
            corrupted_prompt=data["corrupted_prompt"],
            clean=data["clean_tokens"],
            corrupted=data["corrupted_tokens"],
            target=targets[0],
            corrupted_target=targets[1] if len(targets) > 1 else None,
            metric=data["metric"],
            layers=data["layer_list"],
            positions=data["position_list"],
            submit_token=data["submit_token"],
        )
    except TaskQueueUnreachable as error:
        # The form as typed, to be sent again (base.html has htmx swap a 503 that names its
        # target).
        form.add_error(None, str(error))
        response = _form_errors(request, form)
        response.status_code = 503
        return response
    if not request.htmx:
        return redirect("playground:patching_detail", group=group)
    response = render(request, GRID_PARTIAL, {"grid": _grid(request, group)})
    return with_new_submit_token(request, response, form)


@approved_required
@require_GET
def patching_detail(request, group):
    try:
        context = {"grid": _grid(request, group)}
    except BadMetric as error:
        return _bad_metric(error)
    if request.htmx:
        return render(request, GRID_PARTIAL, context)
    return render(request, "playground/patching_grid.html", context)


@approved_required
@require_GET
def patching_download(request, group, file_format):
    """Every number of the grid: JSON (the baselines, noise floor, definitions and every
    run's scores) or CSV (one row per scoring run)."""
    try:
        grid = _grid(request, group)
    except BadMetric as error:
        return _bad_metric(error)
    document = grid.export()
    return exports.download(
        document, records=document["runs"], file_format=file_format, name=f"patching-{grid.group}"
    )


@approved_required
@require_POST
def patching_cancel(request, group):
    if patching_grid_for_user(user=request.user, group=group) is None:
        raise Http404("No such patching grid.")
    patching.patching_grid_cancel(user=request.user, group=group)
    if request.htmx:
        grid = patching_grid_for_user(user=request.user, group=group)
        return render(request, GRID_PARTIAL, {"grid": grid})
    return redirect("playground:patching_detail", group=group)
