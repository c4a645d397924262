"""Forms of the vector library: a vector from two contrast prompts, an uploaded .npy, a
capture's mean saved as a vector, and a vector renamed."""

from django import forms
from django.core.validators import MaxValueValidator

from acs_client.protocol import XARGS_CAPTURE
from api.errors import ApiError
from api.limits import MAX_BODY_BYTES
from api.request_forms import (
    ModelCapabilities,
    SubmitOnceForm,
)
from infra.lifecycle import WorkStatus
from playground.captures import Capture
from playground.fields import position_list, positions_text
from playground.models import Run, SteeringVector, VectorMethod
from playground.tokens import shown_tokens, tokenize
from playground.vectors.captures import default_positions
from playground.vectors.services import VectorError, vector_from_npy

# Contrast prompts are short phrases; each is captured at one layer.
MAX_CONTRAST_PROMPT_CHARS = 2000

# The runs offered to subtract: the user's latest captures of the same model.
SUBTRACT_CHOICES = 50


class RunChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, run: Run) -> str:
        preview = run.prompt_preview
        preview = preview if len(preview) <= 50 else preview[:49] + "…"
        return f"{preview} ({run.created_at:%Y-%m-%d %H:%M} UTC)"


class SaveVectorForm(forms.Form):
    """Save the mean of a capture run's residual stream at one layer over chosen positions,
    optionally minus another capture's mean at that layer, as a library vector."""

    name = forms.CharField(max_length=100)
    layer = forms.TypedChoiceField(coerce=int)
    positions = forms.CharField(max_length=1000)
    subtract_run = RunChoiceField(
        queryset=Run.objects.none(),
        required=False,
        label="Minus the mean of",
        empty_label="Nothing (the mean alone)",
        help_text="Another capture of the same model, at the same layer, over all its positions "
        "but the first.",
    )

    def __init__(self, *args, run: Run, capture: Capture, **kwargs):
        super().__init__(*args, **kwargs)
        self.count = capture.tensor.shape[1]
        self.fields["layer"].choices = [(layer, str(layer)) for layer in capture.layers]
        self.fields["positions"].initial = positions_text(default_positions(self.count))
        self.fields["positions"].help_text = (
            f"Whole numbers and ranges, e.g. 1-{self.count - 1} or 2, 5; "
            f"0–{self.count - 1}: {' '.join(capture.labels)}. The default leaves out position 0, "
            "whose residual stream (an attention sink) dwarfs the others."
        )
        captures = (
            Run.objects.filter(
                user=run.user_id,
                status=WorkStatus.SUCCEEDED,
                request__has_key=XARGS_CAPTURE,
                request__model=run.body.model,
            )
            .exclude(pk=run.pk)
            .values_list("pk", flat=True)
        )
        self.fields["subtract_run"].queryset = Run.objects.filter(
            pk__in=list(captures[:SUBTRACT_CHOICES])
        ).defer("response")

    def clean_positions(self):
        return position_list(self.cleaned_data["positions"], count=self.count)


class RenameVectorForm(forms.ModelForm):
    class Meta:
        model = SteeringVector
        fields = ["name"]


def _limit_layer(field: forms.IntegerField, capabilities: ModelCapabilities) -> None:
    if capabilities.n_layers:
        top = capabilities.n_layers - 1
        field.validators.append(MaxValueValidator(top))
        field.widget.attrs["max"] = top
        field.help_text = f"0–{top}."


class ContrastVectorForm(SubmitOnceForm):
    """Two prompts captured at one layer; the vector is the difference of their rows after
    position 0 (`services.contrast_difference`), so each prompt needs two tokens."""

    prefix = "contrast"
    name = forms.CharField(max_length=100)
    layer = forms.IntegerField(min_value=0)
    positive = forms.CharField(
        label="Prompt towards",
        max_length=MAX_CONTRAST_PROMPT_CHARS,
        widget=forms.Textarea(attrs={"rows": 2}),
    )
    negative = forms.CharField(
        label="Prompt away from",
        max_length=MAX_CONTRAST_PROMPT_CHARS,
        widget=forms.Textarea(attrs={"rows": 2}),
    )
    method = forms.ChoiceField(
        choices=[
            (VectorMethod.CONTRAST_LAST, "Last token"),
            (VectorMethod.CONTRAST_MEAN, "Mean over tokens"),
        ],
        help_text="Both leave out position 0, an attention sink whose residual stream is "
        "several times the typical norm whatever its token.",
    )

    def __init__(self, *args, capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.capabilities = capabilities
        _limit_layer(self.fields["layer"], capabilities)

    def clean(self):
        data = super().clean()
        names = [name for name in ("positive", "negative") if data.get(name)]
        if len(names) < 2:
            return data
        try:
            prompts = tokenize(self.capabilities.id, [(data[name], True) for name in names])
        except ApiError as error:
            raise forms.ValidationError(
                f"The prompts could not be tokenized ({error.code}: {error.message})."
            ) from None
        for name, tokens in zip(names, prompts, strict=True):
            if len(tokens.ids) < 2:
                self.add_error(
                    name,
                    f"This prompt is one token, {shown_tokens(tokens)}: its only position is "
                    "0, the attention sink, so the vector would be the sink's (several times "
                    "the typical norm, whatever the word). Put a word before it (“I love”): "
                    "the vector comes from the positions after the first.",
                )
        return data


class UploadVectorForm(forms.Form):
    prefix = "upload"
    name = forms.CharField(max_length=100)
    layer = forms.IntegerField(min_value=0)
    file = forms.FileField(label=".npy file", help_text="Shape [hidden] or [1, hidden].")

    def __init__(self, *args, capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.capabilities = capabilities
        _limit_layer(self.fields["layer"], capabilities)
        if capabilities.hidden_size:
            self.fields[
                "file"
            ].help_text = f"Shape [{capabilities.hidden_size}] or [1, {capabilities.hidden_size}]."

    def clean_file(self):
        upload = self.cleaned_data["file"]
        if upload.size > MAX_BODY_BYTES:
            raise forms.ValidationError(f"The file is larger than {MAX_BODY_BYTES // 2**20} MiB.")
        hidden = self.capabilities.hidden_size
        if not hidden:
            raise forms.ValidationError("The model's hidden size is unknown; try again later.")
        try:
            return vector_from_npy(upload.read(), hidden_size=hidden)
        except VectorError as error:
            raise forms.ValidationError(str(error)) from None
