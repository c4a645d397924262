"""Django admin for every accounts model. Status, budget and key changes go through the
audited services (admin actions), so those fields are read-only in the forms."""

from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.core.exceptions import ValidationError
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from . import login_throttle
from .models import AccessApplication, ApiKey, AuditLog, ServiceSettings, User
from .services import applications, keys, second_factor, users

# django-otp's admins of these would show every staff member's authenticator secret and
# recovery codes to a superuser. A lost second factor is reset with the users' action below.
admin.site.unregister(TOTPDevice)
admin.site.unregister(StaticDevice)


def _service_action(name, description, call):
    """An admin action `name` applying `call(obj, acting_user)` to each selected object; a
    refused object is reported and the others still go through."""

    @admin.action(description=description)
    def action(modeladmin, request, queryset):
        done = 0
        for obj in queryset:
            try:
                call(obj, request.user)
                done += 1
            except ValidationError as error:
                modeladmin.message_user(
                    request, f"{obj}: {' '.join(error.messages)}", messages.WARNING
                )
        modeladmin.message_user(request, f"{description}: {done} done.")

    action.__name__ = name
    return action


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ["-date_joined"]
    list_display = ["email", "name", "organisation", "status", "monthly_token_budget", "is_staff"]
    list_filter = ["status", "is_staff"]
    search_fields = ["email", "name", "organisation"]
    readonly_fields = ["status", "status_changed_at", "monthly_token_budget", "date_joined"]
    fieldsets = [
        (None, {"fields": ["email", "password"]}),
        ("Profile", {"fields": ["name", "organisation"]}),
        (
            "Access",
            {"fields": ["status", "status_changed_at", "monthly_token_budget", "key_limit"]},
        ),
        ("Permissions", {"fields": ["is_active", "is_staff", "is_superuser", "groups"]}),
        ("Dates", {"fields": ["last_login", "date_joined"]}),
    ]
    add_fieldsets = [(None, {"classes": ["wide"], "fields": ["email", "password1", "password2"]})]
    filter_horizontal = ["groups"]
    actions = [
        _service_action(
            "suspend",
            "Suspend selected accounts",
            lambda user, actor: users.user_suspend(user=user, acting_user=actor),
        ),
        _service_action(
            "reactivate",
            "Reactivate selected accounts",
            lambda user, actor: users.user_reactivate(user=user, acting_user=actor),
        ),
        _service_action(
            "lift_login_lock",
            "Lift the sign-in lock of selected accounts",
            lambda user, actor: login_throttle.login_lock_lift(user=user, acting_user=actor),
        ),
        _service_action(
            "reset_second_factor",
            "Reset the second factor of selected accounts",
            lambda user, actor: second_factor.second_factor_reset(user=user, acting_user=actor),
        ),
    ]


@admin.register(AccessApplication)
class AccessApplicationAdmin(admin.ModelAdmin):
    list_display = ["user", "status", "created_at", "decided_at", "decided_by"]
    list_filter = ["status"]
    search_fields = ["user__email", "planned_use"]
    readonly_fields = ["status", "decided_at", "decided_by", "decision_note", "created_at"]
    list_select_related = ["user", "decided_by"]
    actions = [
        _service_action(
            "approve",
            "Approve selected applications",
            lambda app, actor: applications.application_approve(application=app, acting_user=actor),
        ),
        _service_action(
            "reject",
            "Reject selected applications",
            lambda app, actor: applications.application_reject(application=app, acting_user=actor),
        ),
    ]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "user", "status", "is_playground", "created_at"]
    list_filter = ["status", "is_playground"]
    search_fields = ["prefix", "name", "user__email"]
    list_select_related = ["user"]
    exclude = ["secret_hash", "encrypted_secret", "pending_reveal"]
    actions = [
        _service_action(
            "disable",
            "Pause selected keys",
            lambda key, actor: keys.api_key_disable(key=key, acting_user=actor),
        ),
        _service_action(
            "enable",
            "Resume selected keys",
            lambda key, actor: keys.api_key_enable(key=key, acting_user=actor),
        ),
        _service_action(
            "revoke",
            "Revoke selected keys",
            lambda key, actor: keys.api_key_revoke(key=key, acting_user=actor),
        ),
    ]

    def has_add_permission(self, request):
        return False

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields if f.name not in self.exclude]


@admin.register(AuditLog)
class AuditLogAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "actor", "action", "target_type", "target_repr"]
    list_filter = ["action", "target_type"]
    search_fields = ["target_repr", "actor__email", "action"]
    list_select_related = ["actor"]


@admin.register(ServiceSettings)
class ServiceSettingsAdmin(ReadOnlyAdmin):
    """Read-only here: the spend cap is set on /staff/spend-cap/ (audited)."""

    list_display = ["spend_cap_paused", "spend_cap_reason", "updated_at", "updated_by"]
