"""The linear-probe pages (see `services`): the form with the user's latest probe, a probe's
permalink (its htmx partial while it runs), its downloads, cancelling it, saving a layer's
probe as a vector, and the score strip of a saved probe on a capture run."""

from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import reswap, retarget

from accounts.access import approved_required
from infra.lifecycle import WorkStatus
from infra.tasks import TaskQueueUnreachable
from playground import exports
from playground.runs import selectors as run_selectors
from playground.runs.views import models_and_capabilities, with_new_submit_token
from playground.vectors.captures import CaptureError, capture_of

from . import services
from .forms import ProbeForm
from .models import Probe
from .selectors import latest_probe_for_user, probe_context, probe_export, probe_for_user
from .strip import score_strip_section

PANEL_PARTIAL = "playground/probes/detail.html#probe_panel"
FORM_PARTIAL = "playground/probes/page.html#probe_form"
# Codes of a spent budget or quota, which the panel words as such.
SPENT_CODES = frozenset(
    {"budget_exceeded", "activation_quota_exceeded", "harvest_quota_exceeded", "spend_cap"}
)


def _panel(probe, **extra) -> dict:
    return {**probe_context(probe), "spent_codes": SPENT_CODES, **extra}


def _page(request, form, status=200):
    models, capabilities = models_and_capabilities(request)
    probe = latest_probe_for_user(user=request.user)
    context = {
        "form": form or ProbeForm(capabilities=capabilities),
        "models": models,
        "capabilities": capabilities,
        **(_panel(probe) if probe else {}),
    }
    return render(request, "playground/probes/page.html", context, status=status)


@approved_required
@require_GET
@never_cache
def probes_page(request):
    """The form, and below it the user's latest probe (followed while it runs)."""
    return _page(request, None)


def _form_response(request, form, *, status: int):
    """The form again (with its errors, or its cost to confirm): for htmx only the form,
    swapped over the old one; otherwise the whole page."""
    if request.htmx:
        # htmx swaps no 4xx answer: the form's errors come as a 200 (a 503 names its target).
        models, _ = models_and_capabilities(request)
        shown = status if status >= 500 else 200
        response = render(request, FORM_PARTIAL, {"form": form, "models": models}, status=shown)
        return reswap(retarget(response, "#probe-form"), "outerHTML")
    return _page(request, form, status=status)


@approved_required
@require_POST
def probe_submit(request):
    """Count the cost ("count"), or fit the probes ("fit") once the page stated their cost:
    a dataset whose cost was not shown (or changed since) is shown its cost first."""
    _, capabilities = models_and_capabilities(request)
    form = ProbeForm(request.POST, request.FILES, capabilities=capabilities)
    if not form.is_valid():
        return _form_response(request, form, status=400)
    if request.POST.get("action") != "fit" or not form.cost_confirmed:
        form.data = form.data.copy()
        form.data[form.add_prefix("confirmed_tokens")] = str(form.cost["tokens"])
        return _form_response(request, form, status=200)
    data = form.cleaned_data
    try:
        probe = services.probe_create(
            user=request.user,
            model=capabilities.id,
            dataset=data["dataset_parsed"],
            layers=data["layer_list"],
            pooling=data["pooling"],
            seed=data["seed"],
            test_fraction=data["test_fraction"],
            regularisation_c=data["regularisation_c"],
            token_cost=form.cost["tokens"],
            submit_token=data["submit_token"],
        )
    except TaskQueueUnreachable as error:
        form.add_error(None, str(error))
        return _form_response(request, form, status=503)
    if not request.htmx:
        return redirect("playground:probe_detail", probe_id=probe.id)
    response = render(request, PANEL_PARTIAL, _panel(probe))
    return with_new_submit_token(request, response, form)


@approved_required
@require_GET
def probe_detail(request, probe_id):
    probe = probe_for_user(user=request.user, probe_id=probe_id)
    if request.htmx:
        return render(request, PANEL_PARTIAL, _panel(probe))
    return render(request, "playground/probes/detail.html", _panel(probe))


@approved_required
@require_GET
def probe_download(request, probe_id, file_format):
    """Every number of the probe: JSON (with definitions and provenance) or CSV (a row per
    layer)."""
    probe = probe_for_user(user=request.user, probe_id=probe_id)
    document = probe_export(probe)
    return exports.download(
        document, records=document["layers"], file_format=file_format, name=f"probe-{probe.pk}"
    )


@approved_required
@require_POST
def probe_cancel(request, probe_id):
    probe = probe_for_user(user=request.user, probe_id=probe_id)
    notice = ""
    try:
        services.probe_cancel(probe=probe)
    except TaskQueueUnreachable:
        notice = (
            "Cancelled, but the task queue is unreachable, so its harvest may run on; "
            "cancel it on the Jobs page."
        )
    probe.refresh_from_db()
    if request.htmx:
        return render(request, PANEL_PARTIAL, _panel(probe, notice=notice))
    return redirect("playground:probe_detail", probe_id=probe.id)


@approved_required
@require_POST
def probe_vector_save(request, probe_id):
    """Save one fitted layer's probe in the vector library."""
    probe = probe_for_user(user=request.user, probe_id=probe_id)
    fitted = {entry["layer"] for entry in (probe.results or {}).get("layers", [])}
    try:
        layer = int(request.POST.get("layer", ""))
    except ValueError:
        layer = None
    name = request.POST.get("name", "").strip()[:100]
    if probe.status != WorkStatus.SUCCEEDED or layer not in fitted:
        raise Http404("No fitted probe at that layer.")
    probe = Probe.objects.get(pk=probe.pk)  # with its weights
    vector = services.probe_vector_save(
        probe=probe, layer=layer, name=name or f"probe L{layer} {' vs '.join(probe.classes)}"
    )
    if request.htmx:
        return render(request, PANEL_PARTIAL, _panel(probe, saved_vector=vector))
    return redirect("playground:probe_detail", probe_id=probe.id)


@approved_required
@require_GET
def probe_score_strip(request, run_id):
    """The score strip of the saved probe `?vector=` on a capture run (the run page's
    picker)."""
    run = run_selectors.run_for_user(user=request.user, run_id=run_id)
    try:
        capture = capture_of(run)
    except CaptureError as error:
        raise Http404(str(error)) from None
    section = score_strip_section(run, capture, request.GET.get("vector"))
    if section is None:
        raise Http404("No saved probe of this run's model at a layer it captured.")
    return render(
        request, "playground/probes/_score_strip.html#score_strip", {"probe_strip": section}
    )
