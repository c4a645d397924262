from django.contrib import admin

from infra.admin import RecordAdmin

from .models import Run, RunComparison, SteeringScore, SteeringVector


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


@admin.register(SteeringVector)
class SteeringVectorAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "model", "layer", "method", "norm", "created_at"]
    list_filter = ["method", "model"]
    search_fields = ["name", "user__email"]
    raw_id_fields = ["user"]
    exclude = ["data"]
