"""The steering form: a baseline and steered runs of one prompt, one scale or a sweep."""

from django import forms

from acs_client.protocol import (
    MAX_TEMPERATURE,
)
from api.request_forms import (
    LIST_FIELD_MAX_CHARS,
    ModelCapabilities,
    SubmitOnceForm,
    layer_list,
)
from playground.captures import TYPICAL_NORM_DEFINITION
from playground.fields import (
    MAX_SCALE,
    float_list,
    steering_position_list,
    steering_positions_field,
)
from playground.models import SteeringVector

MAX_SWEEP_SCALES = 12
# The steering prompt is sent once per scale plus the baseline.
MAX_STEERING_PROMPT_CHARS = 8000


class SteeringForm(SubmitOnceForm):
    """A baseline (scale 0) and steered runs with the same seed; several scales make a sweep."""

    prefix = "steer"

    vector = forms.ModelChoiceField(queryset=SteeringVector.objects.none())
    prompt = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2}), strip=False, max_length=MAX_STEERING_PROMPT_CHARS
    )
    layers = forms.CharField(
        required=False,
        max_length=LIST_FIELD_MAX_CHARS,
        help_text="Layers to add the vector at; empty: the vector's own layer.",
    )
    positions = steering_positions_field()
    scale_unit = forms.ChoiceField(
        choices=[("absolute", "Absolute scale"), ("typical", "× layer's typical norm")],
        initial="absolute",
    )
    scales = forms.CharField(
        initial="4",
        max_length=LIST_FIELD_MAX_CHARS,
        help_text=f"One scale, or up to {MAX_SWEEP_SCALES} different ones separated by commas "
        f"for a sweep; each within ±{MAX_SCALE:g}.",
    )
    max_tokens = forms.IntegerField(min_value=1, max_value=256, initial=16)
    temperature = forms.FloatField(min_value=0, max_value=MAX_TEMPERATURE, initial=0)
    seed = forms.IntegerField(initial=0)
    logprobs = forms.IntegerField(min_value=0, max_value=20, initial=5)
    target_token = forms.CharField(
        required=False, strip=False, help_text="For a sweep: token whose logprob to plot."
    )

    def __init__(self, *args, user, capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.capabilities = capabilities
        vectors = SteeringVector.objects.filter(user=user)
        self.fields["vector"].queryset = vectors
        if capabilities.n_layers:
            self.fields["layers"].help_text += f" 0–{capabilities.n_layers - 1}."
        measured = [
            f"{vector.name} (layer {vector.layer}): {vector.layer_typical_norm:.2f}"
            for vector in vectors.exclude(layer_typical_norm=None).defer("data")[:6]
        ]
        self.fields["scale_unit"].help_text = (
            f"× typical norm: a multiple of the typical norm of the vector's layer, "
            f"{TYPICAL_NORM_DEFINITION} (contrast vectors measure it when built)"
            + (f". Typical norms: {'; '.join(measured)}." if measured else ".")
        )

    def clean(self):
        data = super().clean()
        vector = data.get("vector")
        if vector is None:
            return data
        try:
            data["layer_list"] = (
                layer_list(data["layers"], self.capabilities)
                if data.get("layers")
                else [vector.layer]
            )
        except forms.ValidationError as error:
            self.add_error("layers", error)
        if data.get("positions") and data.get("prompt") and data.get("max_tokens"):
            try:
                data["position_list"] = steering_position_list(
                    data["positions"],
                    model_id=vector.model,
                    prompts=[data["prompt"]],
                    max_tokens=data["max_tokens"],
                )
            except forms.ValidationError as error:
                self.add_error("positions", error)
        try:
            scales = float_list(
                data.get("scales") or "", field="Scales", max_count=MAX_SWEEP_SCALES
            )
        except forms.ValidationError as error:
            self.add_error("scales", error)
            return data
        if len(set(scales)) != len(scales):
            self.add_error(
                "scales", "Scales: each scale once; the sweep runs one request per scale."
            )
            return data
        if any(abs(scale) > MAX_SCALE for scale in scales):
            self.add_error("scales", f"Scales: each within ±{MAX_SCALE:g}.")
            return data
        data["entered_scales"] = scales
        if data.get("scale_unit") == "typical":
            if not vector.layer_typical_norm or not vector.norm:
                self.add_error(
                    "scale_unit",
                    "This vector has no typical layer norm (contrast vectors measure it when "
                    "built); use an absolute scale.",
                )
                return data
            if data.get("layer_list") != [vector.layer]:
                self.add_error(
                    "layers",
                    f"× typical norm is layer {vector.layer}'s typical norm (the vector's "
                    f"layer): steer at layer {vector.layer} only, or give an absolute scale.",
                )
                return data
            # A multiple m adds a vector whose norm is m × the layer's typical norm.
            scales = [m * vector.layer_typical_norm / vector.norm for m in scales]
        data["scale_list"] = [round(scale, 6) for scale in scales]
        return data

    def base_request(self) -> dict:
        data = self.cleaned_data
        return {
            "model": data["vector"].model,
            "prompt": data["prompt"],
            "max_tokens": data["max_tokens"],
            "temperature": data["temperature"],
            "seed": data["seed"],
            "logprobs": data["logprobs"],
        }
