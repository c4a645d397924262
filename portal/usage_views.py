"""Usage pages: a user's own usage, request log and request detail; the staff overview and
staff's view of one user's usage. Every period is whole UTC days."""

from django.http import Http404, HttpResponse, HttpResponseBadRequest
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.utils.safestring import mark_safe

from accounts.access import approved_required, staff_required
from accounts.models import ApiKey, ServiceSettings, User
from accounts.selectors import pending_applications_count
from api import selectors as api_selectors
from infra.htmx import varies_on_htmx, wants_fragment
from infra.spreadsheet import SafeWriter
from metering import selectors as usage_selectors
from metering.windows import utc_day

from .billing import billed
from .figures import usage_figures
from .usage_forms import RequestLogFilterForm, UsageFilterForm, cursor_encode

TABLE_COLUMNS = [
    "day",
    "requests",
    "2xx",
    "4xx",
    "5xx",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "latency_ms_avg",
]


# ---------------------------------------------------------------------------------------
# Usage of one user (the user's own, or any user's for staff)


def _usage_form(request, subject: User) -> UsageFilterForm:
    return UsageFilterForm(
        request.GET,
        today=utc_day(timezone.now()),
        keys=ApiKey.objects.filter(user=subject).order_by("name", "pk"),
        models=usage_selectors.usage_models(user_id=subject.pk),
    )


def _render_usage(request, subject: User, *, base_path: str, staff_view: bool):
    form = _usage_form(request, subject)
    context = {
        "form": form,
        "subject": subject,
        "base_path": base_path,
        "staff_view": staff_view,
    }
    if form.is_valid():
        date_range = form.date_range(user_id=subject.pk)
        context.update(_summary_context(usage_selectors.usage_summary(date_range), date_range))
    template = "usage/usage.html#results" if wants_fragment(request) else "usage/usage.html"
    return varies_on_htmx(render(request, template, context))


def _summary_context(summary: dict, date_range) -> dict:
    return {
        "summary": summary,
        "date_range": date_range,
        "day_rows_html": [_day_row_html(cells) for cells in _day_table(summary)],
        "figures": usage_figures(summary),
    }


def _day_table(summary: dict) -> list[list[str]]:
    """The per-day table as text cells in `TABLE_COLUMNS` order: the page and the CSV export
    both show exactly these."""
    return [
        [
            row["day"].isoformat(),
            *(str(row[name]) for name in TABLE_COLUMNS[1:-1]),
            "" if row["latency_ms_avg"] is None else f"{row['latency_ms_avg']:.1f}",
        ]
        for row in summary["days"]
    ]


def _day_row_html(cells: list[str]) -> str:
    """One table row. Built here rather than cell by cell in the template, which costs more
    than the queries on a year of days; the cells are digits and ISO dates, nothing to
    escape."""
    day, *numbers = cells
    numbers_html = "".join(f'<td class="num">{n}</td>' for n in numbers)
    return mark_safe(f"<tr><td>{day}</td>{numbers_html}</tr>")


def _export_csv(request, subject: User, *, filename: str) -> HttpResponse:
    form = _usage_form(request, subject)
    if not form.is_valid():
        return HttpResponseBadRequest(
            "".join(f"{field}: {' '.join(errors)}\n" for field, errors in form.errors.items()),
            content_type="text/plain; charset=utf-8",
        )
    date_range = form.date_range(user_id=subject.pk)
    summary = usage_selectors.usage_summary(date_range)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = (
        f'attachment; filename="{filename}-{date_range.start}-{date_range.end}-utc.csv"'
    )
    writer = SafeWriter(response)
    writer.writerow(TABLE_COLUMNS)
    writer.writerows(_day_table(summary))
    return response


@approved_required
def usage_page(request):
    return _render_usage(request, request.user, base_path="/usage/", staff_view=False)


@approved_required
def usage_export_csv(request):
    return _export_csv(request, request.user, filename="usage")


# ---------------------------------------------------------------------------------------
# Request log


@approved_required
def request_log(request):
    form = RequestLogFilterForm(
        request.GET,
        keys=ApiKey.objects.filter(user=request.user).order_by("name", "pk"),
        models=usage_selectors.usage_models(user_id=request.user.pk),
    )
    context = {"form": form, "records": [], "next_cursor": None}
    if form.is_valid():
        records, next_row = usage_selectors.request_log_page(
            form.log_filter(user_id=request.user.pk), before=form.cleaned_data["before"]
        )
        context["records"] = [(record, billed(record)) for record in records]
        context["next_cursor"] = cursor_encode(*next_row) if next_row else None
        context["is_first_page"] = form.cleaned_data["before"] is None
    template = "usage/requests.html#log" if wants_fragment(request) else "usage/requests.html"
    return varies_on_htmx(render(request, template, context))


@approved_required
def request_detail(request, record_id: int):
    record = usage_selectors.usage_record_for_user(user_id=request.user.pk, record_id=record_id)
    if record is None:
        raise Http404("No such request in your log.")
    # The playground keeps the bodies of its runs' requests, so a request sent with the
    # playground key links to the playground, which finds its run. Other requests' bodies
    # are never stored.
    return render(
        request,
        "usage/request_detail.html",
        {"record": record, "billed": billed(record), "from_playground": record.key.is_playground},
    )


# ---------------------------------------------------------------------------------------
# Staff


@staff_required
def staff_overview(request):
    now = timezone.now()
    form = UsageFilterForm(request.GET, today=utc_day(now))
    context = {"form": form}
    if form.is_valid():
        date_range = form.date_range(user_id=None)
        context.update(_summary_context(usage_selectors.usage_summary(date_range), date_range))
        top = usage_selectors.usage_top_users_and_keys(date_range)
        context["top_users"], context["top_keys"] = top["users"], top["keys"]
    if wants_fragment(request):
        return varies_on_htmx(render(request, "usage/staff.html#results", context))
    service = ServiceSettings.objects.filter(pk=1).first()
    context.update(
        upstreams=api_selectors.upstream_states(),
        latencies=usage_selectors.latency_percentiles(now=now),
        latency_sample=usage_selectors.LATENCY_SAMPLE_PER_MODEL,
        pending_applications=pending_applications_count(),
        spend_cap_paused=bool(service and service.spend_cap_paused),
        spend_cap_reason=service.spend_cap_reason if service else "",
    )
    return varies_on_htmx(render(request, "usage/staff.html", context))


@staff_required
def staff_user_usage(request, user_id: int):
    subject = get_object_or_404(User, pk=user_id)
    return _render_usage(
        request, subject, base_path=f"/usage/staff/users/{subject.pk}/", staff_view=True
    )


@staff_required
def staff_user_export_csv(request, user_id: int):
    subject = get_object_or_404(User, pk=user_id)
    return _export_csv(request, subject, filename=f"usage-user-{subject.pk}")
