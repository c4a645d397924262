"""Playground pages. Thin function views: check access (another user's run or vector is a
404), validate, call one service, render a page or its htmx partial."""

import json
import uuid

from django.contrib import messages
from django.http import Http404, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import reswap, retarget, trigger_client_event

from accounts.access import approved_required
from api.errors import ApiError
from api.request_forms import ModelCapabilities
from api.selectors import model_cards
from infra.htmx import varies_on_htmx, wants_fragment
from infra.lifecycle import WorkStatus
from infra.tasks import TaskQueueUnreachable
from playground import captures
from playground.models import Run, RunKind
from playground.runs import activation_figures, selectors, streams
from playground.runs.downloads import run_activations_bytes
from playground.runs.forms import CompletionForm
from playground.runs.history import HistoryFilterForm, runs_page
from playground.runs.page import activations_section_context, lens_section_context, run_context
from playground.runs.registry import (
    ACTIVATIONS,
    BY_NAME,
    LENS,
    TOKENS,
    ActivationPicks,
    Drawing,
)
from playground.runs.services import run_create
from playground.steering import selectors as steering_selectors
from playground.steering.forms import SteeringForm
from playground.steering.group import group_context
from playground.tokens import numbered_tokens, tokenize
from playground.vectors import selectors as vector_selectors
from playground.vectors.forms import ContrastVectorForm, UploadVectorForm
from playground.vectors.services import (
    REFERENCE_PROMPTS,
)


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
        "vectors": vector_selectors.vectors_for_user(user=request.user),
        "typical_norm_definition": captures.TYPICAL_NORM_DEFINITION,
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
        runs = steering_selectors.group_runs_for_user(user=request.user, group=group)
        context["comparison"] = group_context(runs)
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
    initial = CompletionForm.initial_from_request(run.body)
    if run.vector_id and run.body.steering:
        initial["steer_vector"] = run.vector_id
    context = page_context(request, initial=initial)
    return render(request, "playground/page.html", {**context, **_latest_runs_context(request)})


def form_error(request, *, form, context_name: str, fragment: str, target: str):
    """The page showing `form`'s errors (the form under `context_name`): for htmx, only the
    page's `fragment`, swapped over `target`; otherwise the whole page with status 400."""
    context = page_context(request)
    context[context_name] = form
    if request.htmx:
        response = render(request, f"playground/page.html#{fragment}", context)
        return reswap(retarget(response, target), "outerHTML")
    return render(request, "playground/page.html", context, status=400)


def queue_unreachable(request, error: TaskQueueUnreachable, **shown):
    """`form_error` with the queue's `error` above the form's fields, status 503: what was
    typed stays, to be sent again (base.html has htmx swap a 503 that names its target)."""
    shown["form"].add_error(None, str(error))
    response = form_error(request, **shown)
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
        return form_error(request, **shown)
    data = form.cleaned_data
    vector = data.get("steer_vector")
    steering = {}
    if vector is not None:
        steering = {
            "vector": vector,
            "meta": {"vector_name": vector.name},
        }
    try:
        run = run_create(
            user=request.user,
            request=form.to_request(),
            submit_token=data["submit_token"],
            **steering,
        )
    except TaskQueueUnreachable as error:
        return queue_unreachable(request, error, **shown)
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


def activation_picks(request, capture: captures.Capture) -> ActivationPicks:
    """The picks of a query string, each checked (404 naming a bad one that no picker
    offers; an end before the start, which the pickers allow, is a `window_error`)."""
    count, layers = capture.tensor.shape[1], len(capture.layers)
    colour = request.GET.get("colour", "linear")
    if colour not in activation_figures.NORM_COLOUR_SCALES:
        raise Http404(f"colour must be one of {', '.join(activation_figures.NORM_COLOUR_SCALES)}.")
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
        window=captures.PositionWindow(start, end, exclude_first=first == "exclude"),
        colour=colour,
        norm_position=picked("norm_position", count, None),
        cosine_row=picked("cosine_row", layers, 0),
        pca_row=picked("pca_row", layers, 0),
    )


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


@approved_required
@require_GET
def run_for_request(request, request_id: str):
    """The run that sent the /v1 request `request_id` (the request log links here for requests
    made with the playground key), or 404: scores and comparisons send requests of their own
    that no run page shows."""
    run = selectors.run_for_request(user=request.user, request_id=request_id)
    if run is None:
        raise Http404("No playground run sent this request; only runs keep their parameters.")
    return redirect("playground:run_detail", run_id=run.pk)


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
    """One figure of a run (`registry.FIGURES`) for the picks of the query (htmx partial);
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
            "activations": activations_section_context(run, drawing),
            "lens": lens_section_context(drawing),
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
        context = {"run": drawing.run, "lens": lens_section_context(drawing)}
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
