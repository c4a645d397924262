from django.contrib import admin

from infra.admin import RecordAdmin

from .models import JobSubmission


@admin.register(JobSubmission)
class JobSubmissionAdmin(RecordAdmin):
    list_display = ["id", "user", "kind", "status", "job_id", "error_code", "created_at"]
    list_filter = ["status", "kind"]
    search_fields = ["id", "user__email", "job_id", "error_code"]
