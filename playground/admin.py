from django.contrib import admin

from .models import Run, SteeringVector


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["id", "user", "kind", "status", "error_code", "queued_at", "finished_at"]
    list_filter = ["status", "kind"]
    search_fields = ["id", "user__email", "request_id", "error_code"]
    raw_id_fields = ["user", "vector"]
    # Runs are what the API answered; editing them would falsify the record.
    readonly_fields = [field.name for field in Run._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(SteeringVector)
class SteeringVectorAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "model", "layer", "method", "norm", "created_at"]
    list_filter = ["method", "model"]
    search_fields = ["name", "user__email"]
    raw_id_fields = ["user"]
    exclude = ["data"]
