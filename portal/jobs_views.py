"""The portal's Jobs page: the user's completion and harvest jobs, refreshed in place (htmx
polling of the `jobs` partial) while any of them is still active, and forms that submit new
jobs through /v1 with the user's playground key, as the playground sends its runs."""

from django.contrib import messages
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.http import reswap, retarget

from accounts.access import approved_required
from api.jobs import selectors
from api.jobs.services.harvests import HarvestNotCancellable, harvest_job_cancel
from api.request_forms import ModelCapabilities
from api.selectors import model_cards
from infra.htmx import varies_on_htmx, wants_fragment, with_messages
from infra.tasks import TaskQueueUnreachable
from portal.jobs_forms import CompletionJobForm, HarvestJobForm
from portal.models import JobKind
from portal.selectors import job_submissions_shown
from portal.services import job_submission_create

from .figures import harvest_norm_figure

# How often the page re-reads the jobs while one is queued or running.
POLL_SECONDS = 2


def _plotted_job(harvest_jobs, wanted: str | None):
    # Jobs that ended with files: done, or failed or cancelled after writing some batches.
    plottable = [
        job for job in harvest_jobs if selectors.harvest_download_links(job=job) is not None
    ]
    if wanted:
        return next((job for job in plottable if str(job.pk) == wanted), None)
    return plottable[0] if plottable else None


def _capabilities(models: list[dict], wanted: str | None, *, activations=False):
    """The chosen model's capabilities; by default the first model (with activation capture,
    for a harvest)."""
    fitting = [m for m in models if (m.get("capabilities") or {}).get("activations")]
    default = (fitting if activations else models) or models
    entry = next((m for m in models if m["id"] == wanted), default[0] if default else None)
    return ModelCapabilities(entry)


def _job_forms(request, **bound) -> dict:
    """The two submit forms, fresh unless a bound one (with its errors) is given."""
    models = model_cards()
    return {
        "completion_form": bound.get("completion_form")
        or CompletionJobForm(models=models, capabilities=_capabilities(models, None)),
        "harvest_form": bound.get("harvest_form")
        or HarvestJobForm(
            models=models, capabilities=_capabilities(models, None, activations=True)
        ),
    }


def _jobs_context(request) -> dict:
    jobs = selectors.jobs_for_user(user=request.user)
    submissions = job_submissions_shown(user=request.user)
    plotted = _plotted_job(jobs["harvest_jobs"], request.GET.get("plot"))
    harvest_rows = [
        {"job": job, "links": selectors.harvest_download_links(job=job)}
        for job in jobs["harvest_jobs"]
    ]
    return {
        **jobs,
        "active": jobs["active"] or any(s.is_active for s in submissions),
        "submissions": submissions,
        "harvest_rows": harvest_rows,
        "plotted": plotted,
        "figure": harvest_norm_figure(plotted) if plotted else None,
        "poll_seconds": POLL_SECONDS,
        "harvest_retention_days": selectors.harvest_retention_days(),
    }


def _render_jobs(request):
    if wants_fragment(request):
        return varies_on_htmx(render(request, "jobs/page.html#jobs", _jobs_context(request)))
    context = {**_jobs_context(request), **_job_forms(request)}
    return varies_on_htmx(render(request, "jobs/page.html", context))


@approved_required
@require_GET
def jobs_page(request):
    return _render_jobs(request)


def _submitted(request):
    """After a submission: for htmx, the job list (the new submission on top) and fresh
    forms out of band (a new one-time token each); otherwise back to the page."""
    if not request.htmx:
        return redirect("jobs_portal:index")
    response = render(request, "jobs/page.html#jobs", _jobs_context(request))
    forms = {**_job_forms(request), "out_of_band": True}
    response.content += render_to_string("jobs/page.html#job_forms", forms, request).encode()
    return response


def _form_errors(request, **bound):
    """The forms with the bound one's field errors: for htmx only the forms, swapped over
    the old ones; otherwise the whole page with status 400."""
    if request.htmx:
        response = render(request, "jobs/page.html#job_forms", _job_forms(request, **bound))
        return reswap(retarget(response, "#job-forms"), "outerHTML")
    context = {**_jobs_context(request), **_job_forms(request, **bound)}
    return render(request, "jobs/page.html", context, status=400)


def _job_submit(request, *, kind: str, form_class, activations: bool = False):
    """Validate the Jobs page form of `kind` and queue its submission to /v1, or show the
    page with the form's errors."""
    prefix = form_class.prefix
    models = model_cards()
    capabilities = _capabilities(
        models, request.POST.get(f"{prefix}-model"), activations=activations
    )
    form = form_class(request.POST, request.FILES, models=models, capabilities=capabilities)
    if not form.is_valid():
        return _form_errors(request, **{f"{prefix}_form": form})
    try:
        job_submission_create(
            user=request.user,
            kind=kind,
            request=form.to_request(),
            submit_token=form.cleaned_data["submit_token"],
        )
    except TaskQueueUnreachable as error:
        # The form as typed, to be sent again (base.html has htmx swap a 503 that names its
        # target).
        form.add_error(None, str(error))
        response = _form_errors(request, **{f"{prefix}_form": form})
        response.status_code = 503
        return response
    return _submitted(request)


@approved_required
@require_POST
def completion_job_create(request):
    return _job_submit(request, kind=JobKind.COMPLETION, form_class=CompletionJobForm)


@approved_required
@require_POST
def harvest_job_create(request):
    return _job_submit(request, kind=JobKind.HARVEST, form_class=HarvestJobForm, activations=True)


@approved_required
@require_GET
def completion_result(request, job_id):
    """The stored result (completion or error envelope) of the user's finished job."""
    job = selectors.completion_job_get(user_id=request.user.pk, job_id=job_id)
    if job is None or not job.is_finished:
        raise Http404("No finished completion job with this id.")
    response = JsonResponse(job.answer[1], status=200)
    response["Content-Disposition"] = f'attachment; filename="completion-{job.pk}.json"'
    return response


@approved_required
@require_http_methods(["GET", "POST"])
def harvest_cancel(request, job_id):
    """GET: a confirmation page (the no-JS path; with JS the link asks with hx-confirm and
    posts); POST: cancel, keeping the batches already written."""
    job = selectors.harvest_job_get(user_id=request.user.pk, job_id=job_id)
    if job is None:
        raise Http404("No harvest job with this id.")
    if request.method == "GET":
        return render(request, "jobs/harvest_cancel.html", {"job": job})
    try:
        harvest_job_cancel(job=job)
        messages.success(
            request,
            f"Harvest job {str(job.pk)[:8]} cancelled; the batches it wrote stay listed.",
        )
    except HarvestNotCancellable:
        # A job that ended meanwhile is not an error here: the page shows how it ended.
        messages.info(request, f"Harvest job {str(job.pk)[:8]} had already ended.")
    if request.htmx:
        return with_messages(request, _render_jobs(request))
    return redirect("jobs_portal:index")
