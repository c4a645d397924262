"""The activation patching pages (see `patching`): the form with the user's latest grid, a
grid's permalink (its htmx partial while it runs) and cancelling a grid."""

from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import reswap, retarget

from accounts.access import approved_required
from acs_portal.celery import TaskQueueUnreachable

from . import patching
from .patching_forms import PatchingForm
from .views import models_and_capabilities, with_new_submit_token

GRID_PARTIAL = "playground/patching_grid.html#grid_panel"


def _grid(request, group) -> patching.PatchingGrid:
    grid = patching.patching_grid_for_user(user=request.user, group=group)
    if grid is None:
        raise Http404("No such patching grid.")
    return grid


def _page(request, form, status=200):
    _, capabilities = models_and_capabilities(request)
    group = patching.latest_patching_group(user=request.user)
    context = {
        "form": form or PatchingForm(capabilities=capabilities),
        "capabilities": capabilities,
        "grid": patching.patching_grid_for_user(user=request.user, group=group) if group else None,
    }
    return render(request, "playground/patching.html", context, status=status)


@approved_required
@require_GET
@never_cache
def patching_page(request):
    """The form, and below it the user's latest grid (followed while it runs), so that a
    reload or Back keeps showing it."""
    return _page(request, None)


def _form_errors(request, form):
    """The form with its errors: for htmx only the form, swapped over the old one; otherwise
    the whole page with status 400."""
    if request.htmx:
        response = render(request, "playground/patching.html#patching_form", {"form": form})
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
    try:
        group = patching.patching_grid_create(
            user=request.user,
            model=capabilities.id,
            clean=data["clean_tokens"],
            corrupted=data["corrupted_tokens"],
            target=data["target"],
            target_id=data["target_id"],
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
    context = {"grid": _grid(request, group)}
    if request.htmx:
        return render(request, GRID_PARTIAL, context)
    return render(request, "playground/patching_grid.html", context)


@approved_required
@require_POST
def patching_cancel(request, group):
    _grid(request, group)
    patching.patching_grid_cancel(user=request.user, group=group)
    if request.htmx:
        return render(request, GRID_PARTIAL, {"grid": _grid(request, group)})
    return redirect("playground:patching_detail", group=group)
