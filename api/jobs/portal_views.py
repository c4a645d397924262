"""The portal's Jobs page: the user's completion and harvest jobs, refreshed in place (htmx
polling of the `jobs` partial) while any of them is still active."""

import contextlib

from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from accounts.access import approved_required

from . import selectors, services
from .figures import harvest_norm_figure
from .models import HarvestJobStatus

# How often the page re-reads the jobs while one is queued or running.
POLL_SECONDS = 2


def _plotted_job(harvest_jobs, wanted: str | None):
    # Done jobs, and failed ones that kept the batches they wrote (with their stats).
    plottable = [
        job
        for job in harvest_jobs
        if job.files and job.status in (HarvestJobStatus.DONE, HarvestJobStatus.FAILED)
    ]
    if wanted:
        return next((job for job in plottable if str(job.pk) == wanted), None)
    return plottable[0] if plottable else None


@approved_required
@require_GET
def jobs_page(request):
    return _render_jobs(request)


def _render_jobs(request):
    jobs = selectors.jobs_for_user(user=request.user)
    plotted = _plotted_job(jobs["harvest_jobs"], request.GET.get("plot"))
    harvest_rows = [
        {"job": job, "links": selectors.harvest_download_links(job=job)}
        for job in jobs["harvest_jobs"]
    ]
    context = {
        **jobs,
        "harvest_rows": harvest_rows,
        "plotted": plotted,
        "figure": harvest_norm_figure(plotted) if plotted else None,
        "poll_seconds": POLL_SECONDS,
        "harvest_retention_days": selectors.harvest_retention_days(),
    }
    template = "jobs/page.html#jobs" if request.htmx else "jobs/page.html"
    return render(request, template, context)


@approved_required
@require_GET
def completion_result(request, job_id):
    """The stored result (completion or error envelope) of the user's finished job."""
    job = selectors.completion_job_get(user_id=request.user.pk, job_id=job_id)
    if job is None or not job.is_finished:
        raise Http404("No finished completion job with this id.")
    response = JsonResponse(job.result_body, status=200)
    response["Content-Disposition"] = f'attachment; filename="completion-{job.pk}.json"'
    return response


@approved_required
@require_POST
def harvest_cancel(request, job_id):
    job = selectors.harvest_job_get(user_id=request.user.pk, job_id=job_id)
    if job is None:
        raise Http404("No harvest job with this id.")
    # A job that ended meanwhile is not an error here: the page shows how it ended.
    with contextlib.suppress(services.HarvestNotCancellable):
        services.harvest_job_cancel(job=job)
    if request.htmx:
        return _render_jobs(request)
    return redirect("jobs_portal:index")
