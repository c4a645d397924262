from django import forms
from django.contrib import admin, messages
from django.db import transaction

from .models import LanguageModel
from .services import (
    InvalidTokenizer,
    ModelSizesUnknown,
    language_model_sizes_fill,
    language_model_tokenizer_set,
    tokenizer_json_check,
)


class LanguageModelForm(forms.ModelForm):
    tokenizer_file = forms.FileField(
        required=False,
        label="Upload tokenizer.json",
        help_text="The model's HF tokenizer.json (plain vLLM serves none): the gateway then "
        "counts prompt tokens itself instead of asking the upstream on every request.",
    )
    remove_tokenizer = forms.BooleanField(
        required=False, help_text="Count prompt tokens through the upstream again."
    )

    class Meta:
        model = LanguageModel
        fields = [
            "name",
            "served_model_name",
            "upstream_urls",
            "activation_upstream_urls",
            "max_model_len",
            "n_layers",
            "hidden_size",
            "vocab_size",
            "supports_activations",
            "max_logprobs",
            "status",
            "is_default",
            "weights_dir",
        ]

    def clean_tokenizer_file(self):
        upload = self.cleaned_data["tokenizer_file"]
        if upload is None:
            return None
        try:
            tokenizer_json_check(upload.read())
        except InvalidTokenizer as error:
            raise forms.ValidationError(str(error)) from error
        upload.seek(0)
        return upload


@admin.register(LanguageModel)
class LanguageModelAdmin(admin.ModelAdmin):
    form = LanguageModelForm
    list_display = [
        "name",
        "status",
        "is_default",
        "supports_activations",
        "max_model_len",
        "n_layers",
        "hidden_size",
        "has_tokenizer",
    ]
    list_filter = ["status", "supports_activations"]
    search_fields = ["name", "served_model_name"]
    readonly_fields = ["tokenizer_sha256"]

    def get_queryset(self, request):
        return super().get_queryset(request).defer("tokenizer_json")

    @admin.display(boolean=True, description="tokenizer attached")
    def has_tokenizer(self, model):
        return bool(model.tokenizer_sha256)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        upload = form.cleaned_data.get("tokenizer_file")
        if upload is not None:
            language_model_tokenizer_set(model=obj, content=upload.read())
        elif form.cleaned_data.get("remove_tokenizer"):
            language_model_tokenizer_set(model=obj, content=None)
        # After the admin's transaction: the fill waits on the upstream.
        transaction.on_commit(lambda: self._sizes_fill(request, obj))

    def _sizes_fill(self, request, model):
        """Blank sizes are filled from the model once it is saved; when they cannot be yet
        (its upstream still starting), the row stays saved and the registry fills them when
        it first serves it."""
        if not model.sizes_missing:
            return
        try:
            language_model_sizes_fill(model=model)
        except ModelSizesUnknown as error:
            self.message_user(
                request,
                f"{error} Until then its requests get 503 model_sizes_unknown.",
                messages.WARNING,
            )
