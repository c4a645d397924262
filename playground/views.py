"""Playground pages. Thin function views: check access (another user's run or vector is a
404), validate, call one service, render a page or its htmx partial."""

import io
import json
import uuid

import numpy as np
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import reswap, retarget, trigger_client_event

from accounts.access import approved_required
from acs_client.codec import decode
from api.errors import ApiError
from api.selectors import model_cards
from infra.htmx import varies_on_htmx, wants_fragment
from infra.lifecycle import WorkStatus
from infra.tasks import TaskQueueUnreachable

from . import compare, exports, figures, scoring, scrub, selectors, streams
from .downloads import run_activations_bytes
from .forms import (
    CompletionForm,
    ContrastVectorForm,
    ModelCapabilities,
    SteeringForm,
    UploadVectorForm,
)
from .history import HistoryFilterForm, runs_page
from .models import Run, RunKind, VectorMethod
from .probes.strip import score_strip_section
from .run_figures import (
    ACTIVATIONS,
    BY_NAME,
    LENS,
    TOKENS,
    ActivationPicks,
    Drawing,
    section_entries,
)
from .run_tokens import numbered_tokens, tokenize
from .services.runs import run_create
from .services.vectors import (
    REFERENCE_PROMPTS,
    contrast_runs_create,
    steering_runs_create,
    steering_vector_create,
)
from .vector_forms import SaveVectorForm
from .vectors import steered_positions

# Responses above this size are shown shortened on the run page (downloads stay exact).
RESPONSE_SHOWN_CHARS = 200_000


def models_and_capabilities(request) -> tuple[list[dict], ModelCapabilities]:
    """The models listed, and the one the request names (else the registry's default)."""
    models = model_cards()
    wanted = request.GET.get("model") or request.POST.get("model")
    default = next((m for m in models if m.get("default")), models[0] if models else None)
    entry = next((m for m in models if m["id"] == wanted), default)
    return models, ModelCapabilities(entry)


def _forms(request, capabilities, models, *, completion=None, initial=None):
    return {
        "form": completion
        or CompletionForm(
            models=models,
            capabilities=capabilities,
            user=request.user,
            initial=initial or {"model": capabilities.id, "stream": True, "include_usage": True},
        ),
        "contrast_form": ContrastVectorForm(capabilities=capabilities),
        "upload_form": UploadVectorForm(capabilities=capabilities),
        "steering_form": SteeringForm(user=request.user, capabilities=capabilities),
    }


def page_context(request, **overrides):
    models, capabilities = models_and_capabilities(request)
    context = {
        "models": models,
        "capabilities": capabilities,
        "runs": selectors.runs_for_user(user=request.user),
        "vectors": selectors.vectors_for_user(user=request.user),
        "typical_norm_definition": figures.TYPICAL_NORM_DEFINITION,
        "reference_prompt_count": len(REFERENCE_PROMPTS),
    }
    context.update(_forms(request, capabilities, models, initial=overrides.pop("initial", None)))
    context.update(overrides)
    return context


# Parts of the page that htmx reloads on their own (element id → partial name).
PAGE_PARTIALS = {
    "completion-form": "completion_form",
    "completion-steering": "completion_steering",
    "vectors": "vectors",
    "steering-box": "steering_form",
}


def _latest_runs_context(request) -> dict:
    """The Run panel and the steering area as the page loads: the user's latest completion
    run and latest comparison (or sweep or contrast pair), followed live while they run, so
    that a reload or Back keeps showing them."""
    run = selectors.latest_run_for_user(user=request.user, kind=RunKind.COMPLETION)
    context = run_context(run) if run else {}
    group = selectors.latest_group_for_user(user=request.user)
    if group:
        runs = selectors.group_runs_for_user(user=request.user, group=group)
        context["comparison"] = _group_context(runs)
    return context


@approved_required
@require_GET
@never_cache
def playground_page(request):
    """The playground. Never cached, so that Back asks again and shows the latest run."""
    context = page_context(request)
    if request.htmx and request.htmx.target in PAGE_PARTIALS:
        partial = PAGE_PARTIALS[request.htmx.target]
        return render(request, f"playground/page.html#{partial}", context)
    return render(request, "playground/page.html", {**context, **_latest_runs_context(request)})


@approved_required
@require_GET
@never_cache
def run_edit(request, run_id):
    """The playground with the form filled from a stored run (edit and re-run)."""
    run = selectors.run_for_user(user=request.user, run_id=run_id)
    initial = CompletionForm.initial_from_request(run.request)
    if run.vector_id and run.request.get("apply_steering_vectors"):
        initial["steer_vector"] = run.vector_id
    context = page_context(request, initial=initial)
    return render(request, "playground/page.html", {**context, **_latest_runs_context(request)})


def _form_error(request, *, form, context_name: str, fragment: str, target: str):
    """The page showing `form`'s errors (the form under `context_name`): for htmx, only the
    page's `fragment`, swapped over `target`; otherwise the whole page with status 400."""
    context = page_context(request)
    context[context_name] = form
    if request.htmx:
        response = render(request, f"playground/page.html#{fragment}", context)
        return reswap(retarget(response, target), "outerHTML")
    return render(request, "playground/page.html", context, status=400)


def _queue_unreachable(request, error: TaskQueueUnreachable, **form_error):
    """`_form_error` with the queue's `error` above the form's fields, status 503: what was
    typed stays, to be sent again (base.html has htmx swap a 503 that names its target)."""
    form_error["form"].add_error(None, str(error))
    response = _form_error(request, **form_error)
    response.status_code = 503
    return response


@approved_required
@require_POST
def run_submit(request):
    models, capabilities = models_and_capabilities(request)
    form = CompletionForm(request.POST, models=models, capabilities=capabilities, user=request.user)
    shown = {
        "form": form,
        "context_name": "form",
        "fragment": "completion_form",
        "target": "#completion-form",
    }
    if not form.is_valid():
        return _form_error(request, **shown)
    data = form.cleaned_data
    vector = data.get("steer_vector")
    steering = {}
    if vector is not None:
        steering = {
            "vector": vector,
            "scale": data["steer_scale"],
            "meta": {"vector_name": vector.name, "layers": data["steer_layer_list"]},
        }
    try:
        run = run_create(
            user=request.user,
            request=form.to_request(),
            submit_token=data["submit_token"],
            **steering,
        )
    except TaskQueueUnreachable as error:
        return _queue_unreachable(request, error, **shown)
    return with_new_submit_token(request, _run_created(request, run), form)


def with_new_submit_token(request, response, form):
    """An htmx answer to `form` leaves the form on the page: give it a new one-time token
    (out of band), so that its next deliberate submission is a new one."""
    if request.htmx:
        field = form["submit_token"]
        context = {"name": field.html_name, "id": field.auto_id, "token": uuid.uuid4()}
        response.content += render_to_string("playground/_submit_token.html", context).encode()
    return response


def _run_created(request, run: Run):
    if not request.htmx:
        return redirect("playground:run_detail", run_id=run.id)
    response = render(request, "playground/run_detail.html#run_panel", run_context(run))
    return trigger_client_event(response, "runCreated")


@approved_required
@require_GET
def prompt_tokens(request):
    """The tokens of the `prompt` of the query under its `model`, by position (what the
    completion form's steering positions count), or why they are unknown."""
    _, capabilities = models_and_capabilities(request)
    prompt = request.GET.get("prompt", "")
    context = {"prompt": prompt, "model": capabilities.id}
    if prompt:
        try:
            [tokens] = tokenize(capabilities.id, [(prompt, True)])
            context["tokens"] = numbered_tokens(tokens)
        except ApiError as error:
            context["error"] = f"The prompt could not be tokenized ({error.code}: {error.message})."
    if request.htmx:
        return render(request, "playground/prompt_tokens.html#token_list", context)
    return render(request, "playground/prompt_tokens.html", context)


@approved_required
@require_POST
def run_rerun(request, run_id):
    run = selectors.run_for_user(user=request.user, run_id=run_id)
    try:
        rerun = run_create(user=request.user, request=run.request)
    except TaskQueueUnreachable as error:
        # Back on the run's page (its Re-run button is a plain form), saying why.
        messages.error(request, str(error))
        return render(request, "playground/run_detail.html", run_context(run), status=503)
    return _run_created(request, rerun)


@approved_required
@require_GET
def run_history(request):
    """The user's runs, filtered and a page at a time (the filters are the query string).
    The playground page's recent-runs box (htmx target `recent-runs`) gets the first page of
    all runs without the filters, linking here."""
    form = HistoryFilterForm(request.GET, user=request.user)
    embedded = bool(request.htmx) and request.htmx.target == "recent-runs"
    context = {"filter_form": form, "embedded": embedded}
    status = 200
    if embedded:
        context["runs"] = selectors.runs_for_user(user=request.user)
    elif form.is_valid():
        page = runs_page(user=request.user, **form.cleaned_data, page=request.GET.get("page"))
        context.update(page=page, runs=page.object_list)
    else:
        status = 400
    if wants_fragment(request):
        return varies_on_htmx(
            render(request, "playground/history.html#history", context, status=status)
        )
    return varies_on_htmx(render(request, "playground/history.html", context, status=status))


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
    for vector in shown.get("apply_steering_vectors") or []:
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
        "snippets": selectors.run_code_snippets(run.request, base_url=settings.SITE_URL),
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
        context["activations"] = _activations_context(run, drawing)
        context["lens"] = _lens_context(drawing)
        context["probe_strip"] = score_strip_section(run, drawing.capture)
        context["save_vector_form"] = save_vector_form or SaveVectorForm(
            run=run, capture=drawing.capture
        )
    return context


def activation_picks(request, capture: figures.Capture) -> ActivationPicks:
    """The picks of a query string, each checked (404 naming a bad one that no picker
    offers; an end before the start, which the pickers allow, is a `window_error`)."""
    count, layers = capture.tensor.shape[1], len(capture.layers)
    colour = request.GET.get("colour", "linear")
    if colour not in figures.NORM_COLOUR_SCALES:
        raise Http404(f"colour must be one of {', '.join(figures.NORM_COLOUR_SCALES)}.")
    first = request.GET.get("first", "exclude")
    if first not in ("exclude", "include"):
        raise Http404("first must be exclude or include.")

    def picked(name, upper, default):
        return _int_param(request, name, upper=upper) if name in request.GET else default

    start = picked("start", count, 0)
    end = picked("end", count, count - 1)
    window_error = ""
    if end < start:
        labels = capture.labels
        window_error = (
            f"From {labels[start]} to {labels[end]}: the end comes before the start. "
            f"Pick an end at or after {labels[start]}."
        )
    return ActivationPicks(
        window_error=window_error,
        window=figures.PositionWindow(start, end, exclude_first=first == "exclude"),
        colour=colour,
        norm_position=picked("norm_position", count, None),
        cosine_row=picked("cosine_row", layers, 0),
        pca_row=picked("pca_row", layers, 0),
    )


def _activations_context(run: Run, drawing: Drawing) -> dict:
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


def _lens_context(drawing: Drawing) -> dict:
    """The lens section: its picks and notes, its figures from the registry."""
    return {**drawing.lens, "figures": section_entries(drawing, LENS)}


def _choice_param(request, run: Run) -> int:
    """The `choice` asked for (0 when absent), checked against the run's choices."""
    if "choice" not in request.GET:
        return 0
    choices = (
        len((run.response or {}).get("choices") or []) if run.status == WorkStatus.SUCCEEDED else 0
    )
    return _int_param(request, "choice", upper=max(choices, 1))


@approved_required
@require_GET
def run_detail(request, run_id):
    run = selectors.run_for_user(user=request.user, run_id=run_id)
    context = run_context(run, _choice_param(request, run))
    if request.htmx:
        return render(request, "playground/run_detail.html#run_panel", context)
    return render(request, "playground/run_detail.html", context)


def _int_param(request, name: str, *, upper: int) -> int:
    try:
        value = int(request.GET.get(name, ""))
    except ValueError:
        raise Http404(f"Give {name} as a whole number.") from None
    if not 0 <= value < upper:
        raise Http404(f"{name} must be between 0 and {upper - 1}.")
    return value


@approved_required
@require_GET
def run_figure(request, run_id, name):
    """One figure of a run (`run_figures.FIGURES`) for the picks of the query (htmx partial);
    `activations` and `lens`, a section of them. A pick no picker offers is a 404."""
    run = selectors.run_for_user(user=request.user, run_id=run_id)
    if run.status != WorkStatus.SUCCEEDED:
        raise Http404("The run has no result.")
    kind = BY_NAME.get(name)
    if kind is None and name not in (ACTIVATIONS, LENS):
        raise Http404("No such figure.")
    drawing = Drawing(run, choice=_choice_param(request, run), query=request.GET)
    if kind is None or kind.section != TOKENS:
        if drawing.capture is None:
            raise Http404("This run captured no activations.")
        drawing.picks = activation_picks(request, drawing.capture)
    if name == LENS or (kind is not None and kind.section == LENS):
        return _lens_section(request, drawing)
    # A window that cannot be drawn is a field error beside its pickers (400 unless htmx
    # swaps it in: it swaps no 4xx).
    status = 400 if drawing.picks.window_error and not request.htmx else 200
    if name == ACTIVATIONS:
        context = {
            "run": run,
            "activations": _activations_context(run, drawing),
            "lens": _lens_context(drawing),
        }
        return render(request, "playground/run_detail.html#activations", context, status=status)
    if kind.over_window and drawing.picks.window_error:
        context = {"figure": None, "figure_error": drawing.picks.window_error}
        return render(request, "playground/_figure.html", context, status=status)
    if not kind.shown(drawing):
        raise Http404(f"This run has no {name} figure.")
    if kind.picker is not None and kind.picker.parameter in request.GET:
        offered = {str(value) for value, _ in kind.picker.options(drawing)}
        if request.GET[kind.picker.parameter] not in offered:
            raise Http404(f"{kind.picker.parameter} is not one of this figure's choices.")
    return render(request, "playground/_figure.html", {"figure": kind.entry(drawing)})


def _lens_section(request, drawing: Drawing):
    """The lens section with the query's picks for htmx; otherwise the run's page with it,
    400 when a pick is wrong (its form says which)."""
    if request.htmx:
        context = {"run": drawing.run, "lens": _lens_context(drawing)}
        return render(request, "playground/run_detail.html#lens", context)
    context = run_context(drawing.run, lens_query=request.GET)
    form = context["lens"].get("form")
    status = 400 if form is not None and form.errors else 200
    return render(request, "playground/run_detail.html", context, status=status)


@approved_required
@require_GET
def run_request_download(request, run_id):
    """The run's request body exactly as it was sent, whole (the page shortens vectors)."""
    run = selectors.run_for_user(user=request.user, run_id=run_id)
    response = HttpResponse(
        json.dumps(run.request, ensure_ascii=False, indent=2), content_type="application/json"
    )
    response["Content-Disposition"] = f'attachment; filename="run-{run.id}-request.json"'
    return response


@approved_required
@require_GET
def run_activations_download(request, run_id):
    """The captured residual stream with its metadata, in the harvest shards' safetensors
    format (read with `acs_client.downloads.load_activations`)."""
    run = selectors.run_for_user(user=request.user, run_id=run_id)
    if run.status != WorkStatus.SUCCEEDED or not (run.response.get("activations") or {}):
        raise Http404("This run captured no activations.")
    response = HttpResponse(run_activations_bytes(run), content_type="application/octet-stream")
    response["Content-Disposition"] = f'attachment; filename="run-{run.id}-activations.safetensors"'
    return response


def _sse(entry_id, event) -> str:
    prefix = f"id: {entry_id}\n" if entry_id else ""
    return f"{prefix}data: {json.dumps(event)}\n\n"


async def run_events(request, run_id):
    """Server-sent events of a run: everything published so far, then the rest as it comes,
    ending with the `end` event, with a `: keepalive` comment after every
    PLAYGROUND_SSE_KEEPALIVE_SECONDS of silence. `Last-Event-ID` resumes after a reconnect
    (one that is not an id of ours replays from the start)."""
    user = await request.auser()
    if not user.is_authenticated or not user.is_approved:
        raise Http404("No such run.")
    run = await Run.objects.filter(pk=run_id, user=user).only("id", "status").afirst()
    if run is None:
        raise Http404("No such run.")
    after = streams.resume_after(request.headers.get("Last-Event-ID"))

    async def events():
        yield ": connected\n\n"
        async for entry_id, event in streams.follow(run.id, after=after):
            if event is not None:
                yield _sse(entry_id, event)
                continue
            # Nothing new for a while: end if the run finished and its stream has expired.
            current = await Run.objects.filter(pk=run.id).only("status", "error_code").afirst()
            if current.is_finished and not await streams.exists(run.id):
                yield _sse(None, {"type": "end", "status": current.status})
                return
            yield ": keepalive\n\n"

    if run.is_finished and not await streams.exists(run.id):
        # Finished long ago: its stream has expired; the page has the stored result.
        async def finished():
            yield _sse(None, {"type": "end", "status": run.status})

        body = finished()
    else:
        body = events()
    response = StreamingHttpResponse(body, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


# ---------------------------------------------------------------------------------------
# Steering


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
        return _form_error(request, **shown)
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
        return _queue_unreachable(request, error, **shown)
    return with_new_submit_token(request, _group_response(request, group), form)


@approved_required
@require_POST
def vector_upload(request):
    _, capabilities = models_and_capabilities(request)
    form = UploadVectorForm(request.POST, request.FILES, capabilities=capabilities)
    if not form.is_valid():
        return _form_error(
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
    vector = selectors.vector_for_user(user=request.user, vector_id=vector_id)
    buffer = io.BytesIO()
    np.save(buffer, decode(vector.data))
    response = HttpResponse(buffer.getvalue(), content_type="application/octet-stream")
    response["Content-Disposition"] = f'attachment; filename="vector-{vector.pk}.npy"'
    return response


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
        return _form_error(request, **shown)
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
        return _queue_unreachable(request, error, **shown)
    return with_new_submit_token(request, _group_response(request, group), form)


def _group_response(request, group):
    if request.htmx:
        context = _group_context(selectors.group_runs_for_user(user=request.user, group=group))
        return render(request, "playground/group.html#group_panel", context)
    return redirect("playground:group_detail", group=group)


def _group_context(runs: list[Run]) -> dict:
    context = {
        "runs": runs,
        "group": runs[0].group,
        "kind": runs[0].kind,
        "figures": [],
        "mean_delta_definition": scoring.MEAN_DELTA_DEFINITION,
    }
    context["finished"] = all(run.is_finished for run in runs)
    if runs[0].kind == RunKind.CONTRAST:
        context["kind"] = RunKind.CONTRAST
        context["vector"] = next((run.vector for run in runs if run.vector_id), None)
        # The vector is saved just after the second capture succeeds: keep the panel polling
        # until it is there (or a capture failed), or it would never say the vector is ready.
        failed = any(run.status == WorkStatus.FAILED for run in runs)
        context["finished"] = context["finished"] and (context["vector"] is not None or failed)
        return context
    succeeded = [run for run in runs if run.status == WorkStatus.SUCCEEDED]
    baseline = next((run for run in succeeded if run.scale == 0), None)
    context["baseline"] = baseline
    context["notebook"] = exports.steering_notebook(runs, base_url=settings.SITE_URL)
    context["steered"] = [run for run in runs if run.scale != 0]
    context["steering_vector"] = runs[0].vector
    score = selectors.steering_score_for_group(group=runs[0].group)
    context["score"] = score
    compared = {}
    if score is not None and score.status == WorkStatus.SUCCEEDED:
        compared = {entry["run"]: entry for entry in score.results["runs"]}
    context["arms"] = [
        {
            **selectors.steering_arm(run),
            "positions": steered_positions(run),
            "summary": (
                figures.same_token_summary(compared[str(run.pk)])
                if str(run.pk) in compared
                else None
            ),
        }
        for run in runs
    ]
    # The comparison on the same tokens comes once the runs are done: keep polling until it
    # is there whenever there is something to compare.
    expects_score = baseline is not None and len(succeeded) > 1
    context["finished"] = context["finished"] and (
        not expects_score or (score is not None and score.is_finished)
    )
    for run in context["steered"]:
        if str(run.pk) in compared:
            figure = figures.same_token_figure(
                score.results["baseline"]["strings"], compared[str(run.pk)]
            )
            context["figures"].append(figures.figure_entry(f"diff-{run.scale:g}", figure))
    if len(runs) > 2 and context["finished"] and baseline is not None:
        target = runs[0].meta.get("target_token", "")
        by_scale = {entry["scale_entered"]: entry for entry in compared.values()}
        points = figures.sweep_points(
            [(run.scale_entered, run.response) for run in succeeded], target, by_scale
        )
        unit = "scale"
        if runs[0].meta.get("scale_unit") == "typical":
            vector = runs[0].vector
            unit = "scale (× layer's typical norm)"
            if vector is not None and vector.layer_typical_norm:
                unit = (
                    f"scale (× layer {vector.layer}'s typical norm, "
                    f"‖h‖ = {vector.layer_typical_norm:.2f})"
                )
        figure = figures.scale_sweep_figure(points, target, unit)
        context["figures"].insert(0, figures.figure_entry("sweep", figure))
        steps = scrub.sweep_steps(runs, compared)
        # The slider starts at the largest scale: the step whose effect is likeliest seen.
        context["scrub"] = {
            "steps": steps,
            "current": steps[-1],
            "index": len(steps) - 1,
            "script_id": f"scrub-steps-{runs[0].group}",
        }
    return context


@approved_required
@require_GET
def group_detail(request, group):
    context = _group_context(selectors.group_runs_for_user(user=request.user, group=group))
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
    """Every number of a steering comparison or sweep (`exports.steering_export`): JSON, or
    CSV (one row per arm)."""
    runs = selectors.group_runs_for_user(user=request.user, group=group)
    document = exports.steering_export(runs, selectors.steering_score_for_group(group=group))
    return exports.download(
        document, records=document["arms"], file_format=file_format, name=f"steering-{group}"
    )


# ---------------------------------------------------------------------------------------
# Two runs compared


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
    context = compare.comparison_context(run_a, run_b)
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
    reason = compare.scoring_unavailable_reason(run_a, run_b)
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
