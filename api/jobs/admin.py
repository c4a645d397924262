from django.contrib import admin

from .models import CompletionJob, HarvestJob


@admin.register(CompletionJob)
class CompletionJobAdmin(admin.ModelAdmin):
    list_display = ["id", "user", "status", "attempts", "created_at", "finished_at"]
    list_filter = ["status"]
    search_fields = ["id", "user__email", "idempotency_key"]
    readonly_fields = [field.name for field in CompletionJob._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(HarvestJob)
class HarvestJobAdmin(admin.ModelAdmin):
    list_display = ["id", "user", "model", "status", "prompts_done", "n_prompts", "created_at"]
    list_filter = ["status", "model"]
    search_fields = ["id", "user__email"]
    readonly_fields = [field.name for field in HarvestJob._meta.fields]

    def has_add_permission(self, request):
        return False
