from django.db import migrations

from api.errors import ERROR_CODES

# A failed job's error is stored as its code and message (`infra.lifecycle.WorkRow`), from
# which /v1 builds the body it answers; before, a harvest job kept the error object and a
# completion job the whole error envelope (and its HTTP status) as its result. Both are the
# contract's error (`api.errors.ApiError`), so the object's type and the envelope's status
# follow from the code.


def forward(apps, schema_editor):
    HarvestJob = apps.get_model("jobs", "HarvestJob")
    for job in HarvestJob.objects.filter(error__isnull=False):
        job.error_code, job.error_message = job.error["code"], job.error["message"]
        job.save(update_fields=["error_code", "error_message"])
    CompletionJob = apps.get_model("jobs", "CompletionJob")
    for job in CompletionJob.objects.filter(status="failed", result_body__has_key="error"):
        error = job.result_body["error"]
        job.error_code, job.error_message = error["code"], error["message"]
        job.result_status = job.result_body = None
        job.save(update_fields=["error_code", "error_message", "result_status", "result_body"])


def backward(apps, schema_editor):
    HarvestJob = apps.get_model("jobs", "HarvestJob")
    for job in HarvestJob.objects.exclude(error_code=""):
        job.error = _error_object(job)
        job.save(update_fields=["error"])
    CompletionJob = apps.get_model("jobs", "CompletionJob")
    for job in CompletionJob.objects.exclude(error_code=""):
        job.result_status = ERROR_CODES[job.error_code].status
        job.result_body = {"error": _error_object(job)}
        job.save(update_fields=["result_status", "result_body"])


def _error_object(job) -> dict:
    code = job.error_code
    return {"code": code, "message": job.error_message, "type": ERROR_CODES[code].type}


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_work_row_columns"),
    ]

    operations = [migrations.RunPython(forward, backward)]
