"""Django admin for the metering models: read-only (the money path writes them)."""

from django.contrib import admin

from accounts.admin import ReadOnlyAdmin

from .models import BudgetReservation, UsageDaily, UsagePeriod, UsageRecord


@admin.register(UsagePeriod)
class UsagePeriodAdmin(ReadOnlyAdmin):
    list_display = ["user", "key", "period", "start", "used_tokens", "reserved_tokens"]
    list_filter = ["period"]
    search_fields = ["user__email", "key__prefix"]
    list_select_related = ["user", "key"]


@admin.register(BudgetReservation)
class BudgetReservationAdmin(ReadOnlyAdmin):
    list_display = ["id", "key", "status", "created_at", "prompt_tokens", "output_tokens"]
    list_filter = ["status"]
    list_select_related = ["key"]


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "user", "key", "model", "endpoint", "status_code", "error_code"]
    list_filter = ["status_code", "endpoint"]
    search_fields = ["request_id", "user__email", "key__prefix"]
    list_select_related = ["user", "key"]


@admin.register(UsageDaily)
class UsageDailyAdmin(ReadOnlyAdmin):
    list_display = ["day", "user", "key", "model", "status_code", "requests"]
    list_select_related = ["user", "key"]
