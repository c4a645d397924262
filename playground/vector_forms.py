"""Forms of the vector library: save a capture's mean as a vector, rename a vector."""

from django import forms

from infra.lifecycle import WorkStatus

from .figures import Capture
from .forms import position_list, positions_text
from .models import Run, SteeringVector
from .vectors import default_positions

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
                request__has_key="output_residual_stream",
                request__model=run.request_model,
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
