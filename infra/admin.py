"""The admin of background-work rows (`infra.lifecycle`), shared by every app that has them."""

from django.contrib import admin


class RecordAdmin(admin.ModelAdmin):
    """What the API answered or a worker recorded: shown, never edited (editing would falsify
    the record) nor added by hand."""

    raw_id_fields = ["user"]

    def get_readonly_fields(self, request, obj=None):
        return [field.name for field in self.model._meta.fields]

    def has_add_permission(self, request):
        return False
