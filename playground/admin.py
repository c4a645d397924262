from django.contrib import admin

from .models import JobSubmission, Run, RunComparison, SteeringScore, SteeringVector


class RecordAdmin(admin.ModelAdmin):
    """What the API answered or a worker recorded: shown, never edited (editing would falsify
    the record) nor added by hand."""

    raw_id_fields = ["user"]

    def get_readonly_fields(self, request, obj=None):
        return [field.name for field in self.model._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(Run)
class RunAdmin(RecordAdmin):
    list_display = ["id", "user", "kind", "status", "error_code", "created_at", "finished_at"]
    list_filter = ["status", "kind"]
    search_fields = ["id", "user__email", "request_id", "error_code"]
    raw_id_fields = ["user", "vector"]


@admin.register(SteeringScore)
class SteeringScoreAdmin(RecordAdmin):
    list_display = ["group", "user", "status", "error_code", "created_at", "finished_at"]
    list_filter = ["status"]
    search_fields = ["group", "user__email", "error_code"]


@admin.register(RunComparison)
class RunComparisonAdmin(RecordAdmin):
    list_display = ["id", "user", "run_a", "run_b", "status", "error_code", "created_at"]
    list_filter = ["status"]
    search_fields = ["user__email", "error_code"]
    raw_id_fields = ["user", "run_a", "run_b"]


@admin.register(JobSubmission)
class JobSubmissionAdmin(RecordAdmin):
    list_display = ["id", "user", "kind", "status", "job_id", "error_code", "created_at"]
    list_filter = ["status", "kind"]
    search_fields = ["id", "user__email", "job_id", "error_code"]


@admin.register(SteeringVector)
class SteeringVectorAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "model", "layer", "method", "norm", "created_at"]
    list_filter = ["method", "model"]
    search_fields = ["name", "user__email"]
    raw_id_fields = ["user"]
    exclude = ["data"]
