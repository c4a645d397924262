"""The steering evaluation pages: the form with the user's latest evaluation, the cost
stated before anything is sent, an evaluation's permalink (its htmx partial while it runs),
its downloads, and cancelling it."""

from django.conf import settings
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import reswap, retarget

from accounts.access import approved_required
from infra.tasks import TaskQueueUnreachable
from playground import exports
from playground.runs.views import models_and_capabilities

from . import services
from .figures import evaluation_figures
from .forms import SteeringEvalForm, cost_statement
from .notebook import evaluation_notebook
from .selectors import (
    EvaluationReport,
    evaluation_for_user,
    latest_evaluation_id,
    steering_sent,
)

PAGE = "playground/steering_eval/page.html"
DETAIL = "playground/steering_eval/detail.html"
REPORT_PARTIAL = f"{DETAIL}#report_panel"
FORM_PARTIAL = f"{PAGE}#steering_eval_form"


def _report(request, evaluation_id) -> EvaluationReport:
    report = evaluation_for_user(user=request.user, evaluation_id=evaluation_id)
    if report is None:
        raise Http404("No such steering evaluation.")
    return report


def report_context(report: EvaluationReport) -> dict:
    wire = steering_sent(report.evaluation)
    return {
        "report": report,
        "figures": evaluation_figures(report),
        "notebook": evaluation_notebook(report.evaluation, wire, base_url=settings.SITE_URL)
        if wire
        else "",
        "stated_cost": cost_statement(
            report.evaluation.cost,
            prompts=len(report.evaluation.rows),
            scales=len(report.scales),
        ),
    }


def _page(request, form, *, status=200, cost_text=""):
    models, capabilities = models_and_capabilities(request)
    latest = latest_evaluation_id(user=request.user)
    report = evaluation_for_user(user=request.user, evaluation_id=latest) if latest else None
    context = {
        "form": form or SteeringEvalForm(user=request.user, capabilities=capabilities),
        "models": models,
        "capabilities": capabilities,
        "cost_text": cost_text,
        "repeats": services.REPEATS,
        **(report_context(report) if report else {}),
    }
    return render(request, PAGE, context, status=status)


@approved_required
@require_GET
@never_cache
def steering_eval_page(request):
    """The form, and below it the user's latest evaluation (followed while it runs)."""
    return _page(request, None)


def _form_answer(request, form, *, status=200, cost_text=""):
    """The form again (with its errors, or with the cost to confirm): for htmx only the form,
    swapped over the old one; otherwise the whole page."""
    if request.htmx:
        models, _ = models_and_capabilities(request)
        context = {"form": form, "models": models, "cost_text": cost_text}
        response = render(request, FORM_PARTIAL, context, status=status)
        return reswap(retarget(response, "#steering-eval-form"), "outerHTML")
    return _page(request, form, status=status, cost_text=cost_text)


@approved_required
@require_POST
def steering_eval_submit(request):
    """Check the form; state the cost unless the one submitted is the cost just stated;
    then queue the evaluation."""
    _, capabilities = models_and_capabilities(request)
    form = SteeringEvalForm(
        request.POST, request.FILES, user=request.user, capabilities=capabilities
    )
    if not form.is_valid():
        return _form_answer(request, form, status=200 if request.htmx else 400)
    data = form.cleaned_data
    cost = data["cost"]
    if data.get("confirmed_cost") != cost["total_tokens"]:
        # Nothing is sent before its cost was shown: the form again, the dataset in the
        # text box (an uploaded file's too), the cost stated and confirmed by the next post.
        shown = _typed_form(request, data, capabilities, confirmed_cost=cost["total_tokens"])
        text = cost_statement(cost, prompts=len(data["rows"]), scales=len(data["scales"]))
        return _form_answer(request, shown, cost_text=text)
    try:
        evaluation_id = services.steering_evaluation_create(
            user=request.user,
            model=capabilities.id,
            vector=data["vector"],
            scales=data["scales"],
            steer_at=data["steer_at"],
            rows=data["rows"],
            cost=cost,
            submit_token=data["submit_token"],
        )
    except TaskQueueUnreachable as error:
        form.add_error(None, str(error))
        return _form_answer(request, form, status=503)
    if not request.htmx:
        return redirect("playground:steering_eval_detail", evaluation_id=evaluation_id)
    response = render(request, REPORT_PARTIAL, report_context(_report(request, evaluation_id)))
    # The form, out of band, keeps what was typed and asks for the next evaluation's cost.
    models, _ = models_and_capabilities(request)
    context = {"form": _typed_form(request, data, capabilities), "models": models, "oob": True}
    response.content += render(request, FORM_PARTIAL, context).content
    return response


def _typed_form(request, data: dict, capabilities, confirmed_cost=None) -> SteeringEvalForm:
    """A new form holding what `data` (a valid form's) was typed, the dataset as text."""
    return SteeringEvalForm(
        initial={
            "vector": data["vector"].pk,
            "scales": ", ".join(f"{scale:g}" for scale in data["scales"]),
            "steer_at": data["steer_at"],
            "dataset": data["text"],
            "confirmed_cost": confirmed_cost,
        },
        user=request.user,
        capabilities=capabilities,
    )


@approved_required
@require_GET
def steering_eval_detail(request, evaluation_id):
    context = report_context(_report(request, evaluation_id))
    if request.htmx:
        return render(request, REPORT_PARTIAL, context)
    return render(request, DETAIL, context)


@approved_required
@require_GET
def steering_eval_download(request, evaluation_id, file_format):
    """Every number: JSON (settings, definitions, the per-scale summary, the per-prompt
    records and the unsteered repeats) or CSV (one row per prompt and scale)."""
    report = _report(request, evaluation_id)
    document = report.export
    return exports.download(
        document,
        records=document["per_prompt"],
        file_format=file_format,
        name=f"steering-eval-{report.id}",
    )


@approved_required
@require_POST
def steering_eval_cancel(request, evaluation_id):
    _report(request, evaluation_id)
    services.steering_evaluation_cancel(user=request.user, evaluation_id=evaluation_id)
    if request.htmx:
        return render(request, REPORT_PARTIAL, report_context(_report(request, evaluation_id)))
    return redirect("playground:steering_eval_detail", evaluation_id=evaluation_id)
