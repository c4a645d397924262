from django.contrib import admin

from .models import LanguageModel


@admin.register(LanguageModel)
class LanguageModelAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "status",
        "is_default",
        "supports_activations",
        "max_model_len",
        "n_layers",
        "hidden_size",
    ]
    list_filter = ["status", "supports_activations"]
    search_fields = ["name", "served_model_name"]
