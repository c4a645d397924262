"""Steering pages: a comparison or sweep submitted, and its group page (also a contrast
pair's, until its vector is saved) with the same-token scores, figures and scrubber, and its
numbers downloaded."""

from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import trigger_client_event

from accounts.access import approved_required
from infra.tasks import TaskQueueUnreachable
from playground import exports
from playground.models import RunKind
from playground.runs.views import (
    form_error,
    models_and_capabilities,
    queue_unreachable,
    with_new_submit_token,
)
from playground.steering import exports as steering_exports
from playground.steering import selectors as steering_selectors
from playground.steering.forms import SteeringForm
from playground.steering.group import group_context
from playground.steering.services import steering_runs_create


@approved_required
@require_POST
def steering_submit(request):
    _, capabilities = models_and_capabilities(request)
    form = SteeringForm(request.POST, user=request.user, capabilities=capabilities)
    shown = {
        "form": form,
        "context_name": "steering_form",
        "fragment": "steering_form",
        "target": "#steering-box",
    }
    if not form.is_valid():
        return form_error(request, **shown)
    data = form.cleaned_data
    scales = data["scale_list"]
    try:
        group = steering_runs_create(
            user=request.user,
            base_request=form.base_request(),
            vector=data["vector"],
            layers=data["layer_list"],
            scales=scales,
            entered_scales=data["entered_scales"],
            scale_unit=data["scale_unit"],
            kind=RunKind.SWEEP if len(scales) > 1 else RunKind.STEERING_STEERED,
            target_token=data.get("target_token") or "",
            submit_token=data["submit_token"],
            positions=data.get("position_list"),
        )
    except TaskQueueUnreachable as error:
        return queue_unreachable(request, error, **shown)
    return with_new_submit_token(request, group_response(request, group), form)


def group_response(request, group):
    if request.htmx:
        context = group_context(
            steering_selectors.group_runs_for_user(user=request.user, group=group)
        )
        return render(request, "playground/group.html#group_panel", context)
    return redirect("playground:group_detail", group=group)


@approved_required
@require_GET
def group_detail(request, group):
    context = group_context(steering_selectors.group_runs_for_user(user=request.user, group=group))
    if not request.htmx:
        return render(request, "playground/group.html", context)
    response = render(request, "playground/group.html#group_panel", context)
    if context.get("vector"):
        # The contrast pair has just produced its vector: refresh the library and form.
        response = trigger_client_event(response, "vectorsChanged")
    return response


@approved_required
@require_GET
def group_download(request, group, file_format):
    """Every number of a steering comparison or sweep (`steering_exports.steering_export`): JSON, or
    CSV (one row per arm)."""
    runs = steering_selectors.group_runs_for_user(user=request.user, group=group)
    document = steering_exports.steering_export(
        runs, steering_selectors.steering_score_for_group(group=group)
    )
    return exports.download(
        document, records=document["arms"], file_format=file_format, name=f"steering-{group}"
    )
