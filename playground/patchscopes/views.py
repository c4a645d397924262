"""The Patchscopes pages (see `services`): the form for one of the user's capture runs with
its cost, stated before submitting, and the user's latest Patchscope below it; a
Patchscope's permalink (its htmx partial while it runs), its downloads, and cancelling it."""

import json

from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import reswap, retarget

from accounts.access import approved_required
from api.request_forms import ModelCapabilities
from api.selectors import model_cards
from infra.tasks import TaskQueueUnreachable
from playground import exports
from playground.runs import selectors as run_selectors
from playground.vectors.captures import CaptureError, capture_of

from ..models import Run
from . import services
from .forms import PatchscopeForm
from .selectors import capture_runs, latest_patchscope_id, patchscope_for_user

PAGE = "playground/patchscopes/page.html"
FORM_PARTIAL = f"{PAGE}#patchscope_form"
COST_PARTIAL = f"{PAGE}#patchscope_cost"
DETAIL = "playground/patchscopes/detail.html"
PANEL_PARTIAL = f"{DETAIL}#patchscope_panel"


class Source:
    """The source run of a form, its capture and its model's capabilities."""

    def __init__(self, run: Run):
        self.run = run
        self.capture = capture_of(run)
        entry = next((m for m in model_cards() if m["id"] == run.body.model), None)
        self.capabilities = ModelCapabilities(entry)

    def form(self, data=None, **kwargs) -> PatchscopeForm:
        return PatchscopeForm(data, capture=self.capture, capabilities=self.capabilities, **kwargs)


def _source(request, run_id) -> Source:
    """The user's capture run `run_id`; 404 for another user's run or one without a
    capture."""
    run = run_selectors.run_for_user(user=request.user, run_id=run_id)
    try:
        return Source(run)
    except CaptureError as error:
        raise Http404(str(error)) from None


def _default_source(request) -> Source | None:
    """The run of the query's `run`, else the user's latest capture run (None without one)."""
    run_id = request.GET.get("run")
    if run_id:
        return _source(request, run_id)
    latest = capture_runs(user=request.user, limit=1).first()
    return _source(request, latest.pk) if latest else None


def _cost(form: PatchscopeForm) -> dict:
    """What the cost line says for `form` (bound or not): the cost, or what to fix first."""
    if not form.is_bound:
        initial = {
            name: form.get_initial_for_field(field, name) for name, field in form.fields.items()
        }
        data = {
            f"{form.prefix}-{name}": value for name, value in initial.items() if value is not None
        }
        form = PatchscopeForm(data, capture=form.capture, capabilities=form.capabilities)
    if not form.is_valid():
        errors = [str(error) for errors in form.errors.values() for error in errors]
        return {"errors": errors}
    data = form.cleaned_data
    return {
        "cost": services.patchscope_cost(
            prompt_tokens=len(data["inspection"].ids),
            source_layers=len(data["source_layers"]),
            max_tokens=data["max_tokens"],
        ),
        "prompt_tokens": len(data["inspection"].ids),
    }


def _page(request, source: Source | None, form=None, status=200):
    latest = latest_patchscope_id(user=request.user)
    form = form or (source.form() if source else None)
    context = {
        "source": source,
        "form": form,
        "sources": capture_runs(user=request.user),
        "scope": patchscope_for_user(user=request.user, patchscope_id=latest) if latest else None,
        "stated": _cost(form) if form else None,
    }
    return render(request, PAGE, context, status=status)


@approved_required
@require_GET
@never_cache
def patchscopes_page(request):
    """The form for the query's `run` (else the latest capture run), and below it the user's
    latest Patchscope (followed while it runs). For htmx's run picker, the form alone."""
    source = _default_source(request)
    if request.htmx and request.htmx.target == "patchscope-form" and source:
        form = source.form()
        return render(request, FORM_PARTIAL, {"source": source, "form": form,
                                              "stated": _cost(form)})  # fmt: skip
    return _page(request, source)


@approved_required
@require_GET
def patchscope_cost(request):
    """The cost of the form as typed (the query), or what to fix before it can be stated."""
    source = _source(request, request.GET.get("run"))
    form = source.form(request.GET)
    return render(request, COST_PARTIAL, {"stated": _cost(form)})


@approved_required
@require_POST
def patchscope_submit(request):
    source = _source(request, request.POST.get("run"))
    form = source.form(request.POST)
    if not form.is_valid():
        return _form_errors(request, source, form)
    data = form.cleaned_data
    try:
        patchscope_id = services.patchscope_create(
            user=request.user,
            source_run=source.run,
            source_position=data["source_position"],
            source_token=form.source_token(),
            source_layers=data["source_layers"],
            source_states=form.source_states(),
            inspection_prompt=data["inspection_prompt"],
            inspection=data["inspection"],
            inspection_position=data["inspection_position"],
            target_layer=data["target_layer"],
            max_tokens=data["max_tokens"],
            submit_token=data["submit_token"],
        )
    except TaskQueueUnreachable as error:
        form.add_error(None, str(error))
        response = _form_errors(request, source, form)
        response.status_code = 503
        return response
    if not request.htmx:
        return redirect("playground:patchscope_detail", patchscope_id=patchscope_id)
    response = render(request, PANEL_PARTIAL, {"scope": _scope(request, patchscope_id)})
    # The form as typed, without the errors of earlier posts and with a new one-time token.
    typed = {name: form[name].value() for name in form.fields if name != "submit_token"}
    fresh = source.form(initial=typed)
    context = {"source": source, "form": fresh, "stated": _cost(fresh), "out_of_band": True}
    response.content += render(request, FORM_PARTIAL, context).content
    return response


def _form_errors(request, source: Source, form):
    """The form with its errors: for htmx only the form, swapped over the old one; otherwise
    the whole page with status 400."""
    if request.htmx:
        context = {"source": source, "form": form, "stated": _cost(form)}
        response = render(request, FORM_PARTIAL, context)
        return reswap(retarget(response, "#patchscope-form"), "outerHTML")
    return _page(request, source, form, status=400)


def _scope(request, patchscope_id):
    scope = patchscope_for_user(user=request.user, patchscope_id=patchscope_id)
    if scope is None:
        raise Http404("No such Patchscope.")
    return scope


@approved_required
@require_GET
def patchscope_detail(request, patchscope_id):
    context = {"scope": _scope(request, patchscope_id)}
    return render(request, PANEL_PARTIAL if request.htmx else DETAIL, context)


@approved_required
@require_GET
def patchscope_download(request, patchscope_id, file_format):
    """Every generation: JSON (with what was injected where, the cost and the source states)
    or CSV (one row per source layer)."""
    scope = _scope(request, patchscope_id)
    document = scope.export()
    records = [_csv_record(record) for record in document["rows"]]
    return exports.download(
        document, records=records, file_format=file_format, name=f"patchscope-{scope.id}"
    )


def _csv_record(record: dict) -> dict:
    """A row as the CSV holds it: its lists as JSON (a token's text may hold any separator),
    the top alternatives left to the JSON download."""
    flat = {name: value for name, value in record.items() if name != "top_logprobs"}
    for name in ("tokens", "token_ids", "token_logprobs"):
        flat[name] = None if record[name] is None else json.dumps(record[name], ensure_ascii=False)
    return flat


@approved_required
@require_POST
def patchscope_cancel(request, patchscope_id):
    _scope(request, patchscope_id)
    services.patchscope_cancel(user=request.user, patchscope_id=patchscope_id)
    if request.htmx:
        return render(request, PANEL_PARTIAL, {"scope": _scope(request, patchscope_id)})
    return redirect("playground:patchscope_detail", patchscope_id=patchscope_id)
