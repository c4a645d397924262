"""Pages of the vector library: save a capture run's mean as a vector, rename and delete a
vector. Another user's run or vector is a 404."""

import io

import numpy as np
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.http import trigger_client_event

from accounts.access import approved_required
from acs_client.codec import decode
from infra.htmx import wants_fragment
from infra.tasks import TaskQueueUnreachable
from playground.models import Run, VectorMethod
from playground.runs import selectors
from playground.runs.page import run_context
from playground.runs.views import (
    form_error,
    models_and_capabilities,
    page_context,
    queue_unreachable,
    with_new_submit_token,
)
from playground.steering.views import group_response
from playground.vectors import captures as vectors
from playground.vectors import selectors as vector_selectors
from playground.vectors import services as vector_services
from playground.vectors.forms import (
    ContrastVectorForm,
    RenameVectorForm,
    SaveVectorForm,
    UploadVectorForm,
)
from playground.vectors.services import (
    contrast_runs_create,
    steering_vector_create,
)


def _library_url() -> str:
    return reverse("playground:page") + "#vectors"


@approved_required
@require_POST
def vector_save_from_run(request, run_id):
    """Save the mean of the run's capture (at a layer, over positions, optionally minus
    another capture's mean) as a library vector."""
    run = selectors.run_for_user(user=request.user, run_id=run_id)
    try:
        capture = vectors.capture_of(run)
    except vectors.CaptureError as error:
        raise Http404(str(error)) from None
    form = SaveVectorForm(request.POST, run=run, capture=capture)
    saved = None
    if form.is_valid():
        data = form.cleaned_data
        try:
            saved = vector_services.steering_vector_from_capture(
                user=request.user,
                run=run,
                name=data["name"],
                layer=data["layer"],
                positions=data["positions"],
                subtract_run=data["subtract_run"],
            )
        except vectors.CaptureError as error:
            form.add_error("subtract_run", str(error))
    if saved is not None and not request.htmx:
        return redirect(_library_url())
    if not wants_fragment(request):
        context = run_context(run, save_vector_form=form)
        return render(request, "playground/run_detail.html", context, status=400)
    if saved is not None:
        form = SaveVectorForm(run=run, capture=capture)
    context = {"run": run, "save_vector_form": form, "saved_vector": saved}
    response = render(request, "playground/run_detail.html#save_vector", context)
    return trigger_client_event(response, "vectorsChanged") if saved else response


def _library_answer(request, *, status: int = 200, **context):
    """After a change to the library: for htmx, no content and the `vectorsChanged` event
    (the library and the steering forms reload), or the library's partial showing the
    errors; otherwise the playground page."""
    if status == 200:
        if wants_fragment(request):
            # No content: the library and both steering forms reload on the event.
            return trigger_client_event(HttpResponse(status=204), "vectorsChanged")
        return redirect(_library_url())
    full_context = page_context(request, **context)
    if wants_fragment(request):
        return render(request, "playground/page.html#vectors", full_context)
    return render(request, "playground/page.html", full_context, status=status)


@approved_required
@require_POST
def vector_rename(request, vector_id):
    vector = vector_selectors.vector_for_user(user=request.user, vector_id=vector_id)
    form = RenameVectorForm(request.POST, instance=vector, prefix=f"rename-{vector.pk}")
    if not form.is_valid():
        vector.refresh_from_db()
        return _library_answer(request, status=400, rename_form=form, rename_vector=vector)
    vector_services.steering_vector_rename(vector=vector, name=form.cleaned_data["name"])
    return _library_answer(request)


@approved_required
@require_http_methods(["GET", "POST"])
def vector_delete(request, vector_id):
    """GET: the confirmation page (saying which runs used the vector); POST: delete it."""
    vector = vector_selectors.vector_for_user(user=request.user, vector_id=vector_id)
    if request.method == "GET":
        context = {"vector": vector, "runs_using": Run.objects.filter(vector=vector).count()}
        return render(request, "playground/vector_delete.html", context)
    vector_services.steering_vector_delete(vector=vector)
    return _library_answer(request)


@approved_required
@require_POST
def vector_contrast_create(request):
    _, capabilities = models_and_capabilities(request)
    if capabilities.activations_reason:
        raise PermissionDenied(capabilities.activations_reason)
    form = ContrastVectorForm(request.POST, capabilities=capabilities)
    shown = {
        "form": form,
        "context_name": "contrast_form",
        "fragment": "vectors",
        "target": "#vectors",
    }
    if not form.is_valid():
        return form_error(request, **shown)
    data = form.cleaned_data
    try:
        group = contrast_runs_create(
            user=request.user,
            model=capabilities.id,
            name=data["name"],
            layer=data["layer"],
            method=data["method"],
            positive=data["positive"],
            negative=data["negative"],
            submit_token=data["submit_token"],
        )
    except TaskQueueUnreachable as error:
        return queue_unreachable(request, error, **shown)
    return with_new_submit_token(request, group_response(request, group), form)


@approved_required
@require_POST
def vector_upload(request):
    _, capabilities = models_and_capabilities(request)
    form = UploadVectorForm(request.POST, request.FILES, capabilities=capabilities)
    if not form.is_valid():
        return form_error(
            request, form=form, context_name="upload_form", fragment="vectors", target="#vectors"
        )
    steering_vector_create(
        user=request.user,
        name=form.cleaned_data["name"],
        model=capabilities.id,
        layer=form.cleaned_data["layer"],
        method=VectorMethod.UPLOAD,
        vector=form.cleaned_data["file"],
        details={"filename": request.FILES["upload-file"].name},
    )
    if request.htmx:
        context = page_context(request)
        return render(request, "playground/page.html#vectors", context)
    return redirect("playground:page")


@approved_required
@require_GET
def vector_download(request, vector_id):
    """A library vector as a float32 `[hidden]` .npy file."""
    vector = vector_selectors.vector_for_user(user=request.user, vector_id=vector_id)
    buffer = io.BytesIO()
    np.save(buffer, decode(vector.data))
    response = HttpResponse(buffer.getvalue(), content_type="application/octet-stream")
    response["Content-Disposition"] = f'attachment; filename="vector-{vector.pk}.npy"'
    return response
