"""Playground forms. Limits shown next to each field are the API contract's; the API checks
them again, and its error code is shown on the run if a request still fails there."""

import math

from django import forms
from django.core.validators import MaxValueValidator

from acs_client.protocol import (
    MAX_TEMPERATURE,
    RuleBroken,
    check_capture_request,
    check_steering_positions,
)
from api.errors import ApiError
from api.limits import MAX_BODY_BYTES
from api.request_forms import (
    LIST_FIELD_MAX_CHARS,
    CompletionRequestForm,
    ModelCapabilities,
    SubmitOnceForm,
    first_repeated,
    layer_list,
    split_list,
)
from api.schemas import DEFAULT_MAX_TOKENS
from playground.captures import TYPICAL_NORM_DEFINITION
from playground.models import SteeringVector, VectorMethod
from playground.runs.tokens import numbered_tokens, shown_tokens, tokenize
from playground.vectors.services import VectorError, steering_entry, vector_from_npy

MAX_SWEEP_SCALES = 12
# |scale| (or |multiple of the typical norm|) above this swamps the residual stream entirely.
MAX_SCALE = 1000.0
# Contrast prompts are short phrases; each is captured at one layer.
MAX_CONTRAST_PROMPT_CHARS = 2000
# The steering prompt is sent once per scale plus the baseline.
MAX_STEERING_PROMPT_CHARS = 8000


def position_list(text: str, *, count: int) -> list[int]:
    """Positions written as whole numbers and ranges ("1-4, 7"), each once, all below
    `count`."""
    positions = []
    for part in split_list(text.replace("–", "-"), field="Positions", max_count=count):
        first, _, last = part.partition("-")
        try:
            start, end = int(first), int(last or first)
        except ValueError:
            raise forms.ValidationError(
                f"Positions: {part!r} is not a number or a range like 1-4."
            ) from None
        if not 0 <= start <= end < count:
            raise forms.ValidationError(
                f"Positions: {part} is outside 0–{count - 1}, or a range that runs backwards."
            )
        positions.extend(range(start, end + 1))
    if not positions:
        raise forms.ValidationError("Positions: give at least one.")
    repeated = first_repeated(positions)
    if repeated is not None:
        raise forms.ValidationError(f"Positions: {repeated} is listed more than once.")
    return positions


def steering_positions_field() -> forms.CharField:
    """The field of the prompt positions to steer at (`steering_position_list` reads it)."""
    return forms.CharField(
        required=False,
        max_length=LIST_FIELD_MAX_CHARS,
        label="Steering positions",
        help_text="The prompt's positions to add the vector at, e.g. 1-3, 5 (0: its first "
        "token); empty: every position. Generated tokens cannot be steered by position, and "
        "position 0 only with max_tokens 1.",
    )


def steering_position_list(
    text: str, *, model_id: str, prompts: list[str], max_tokens: int
) -> list[int]:
    """The positions `text` names, checked against the shortest prompt's tokens as the API
    checks them (`check_steering_positions`); a ValidationError listing that prompt's tokens
    by position otherwise."""
    try:
        tokenized = tokenize(model_id, [(prompt, True) for prompt in prompts])
    except ApiError as error:
        raise forms.ValidationError(
            f"The prompt could not be tokenized ({error.code}: {error.message})."
        ) from None
    shortest = min(tokenized, key=lambda tokens: len(tokens.ids))
    tokens = f"The prompt's tokens: {numbered_tokens(shortest)}."
    try:
        positions = position_list(text, count=len(shortest.ids) + max_tokens)
        check_steering_positions(positions, prompt_tokens=len(shortest.ids), max_tokens=max_tokens)
    except (forms.ValidationError, RuleBroken) as error:
        message = error.messages[0] if isinstance(error, forms.ValidationError) else error
        raise forms.ValidationError(f"{message} {tokens}") from None
    return positions


def positions_text(positions: list[int]) -> str:
    """`positions` written as `position_list` reads them, consecutive ones as a range."""
    if len(positions) > 1 and positions == list(range(positions[0], positions[-1] + 1)):
        return f"{positions[0]}-{positions[-1]}"
    return ", ".join(str(position) for position in positions)


def _float_list(text: str, *, field: str, max_count: int) -> list[float]:
    try:
        values = [float(p) for p in split_list(text, field=field, max_count=max_count)]
    except ValueError:
        raise forms.ValidationError(f"{field}: write numbers separated by commas.") from None
    if not values or not all(math.isfinite(value) for value in values):
        raise forms.ValidationError(f"{field}: give at least one finite number.")
    return values


class CompletionForm(CompletionRequestForm):
    """Every field of POST /v1/completions, grouped in the template: the shared completion
    fields, streaming, capture and steering with a vector of the user's library."""

    stream = forms.BooleanField(required=False, initial=True, help_text="Tokens as they come.")
    include_usage = forms.BooleanField(
        required=False, initial=True, label="Usage frame", help_text="stream_options."
    )
    capture = forms.ChoiceField(
        required=False,
        choices=[("", "Off"), ("all", "All layers"), ("layers", "These layers")],
        label="Capture residual stream",
    )
    capture_layers = forms.CharField(
        required=False, max_length=LIST_FIELD_MAX_CHARS, help_text="Layer indices, e.g. 0, 8, 16."
    )
    steer_vector = forms.ModelChoiceField(
        queryset=SteeringVector.objects.none(),
        required=False,
        label="Steer with",
        empty_label="No steering",
        help_text="A vector of your library, added to the residual stream at every position "
        "or at the steering positions.",
    )
    steer_layers = forms.CharField(
        required=False,
        max_length=LIST_FIELD_MAX_CHARS,
        label="Steering layers",
        help_text="Layers to add the vector at; empty: the vector's own layer.",
    )
    steer_scale = forms.FloatField(
        required=False,
        initial=4,
        label="Steering scale",
        help_text=f"The vector is multiplied by this before it is added; within ±{MAX_SCALE:g}.",
    )
    steer_positions = steering_positions_field()

    def __init__(
        self,
        *args,
        models: list[dict],
        capabilities: ModelCapabilities,
        user=None,
        **kwargs,
    ):
        super().__init__(*args, models=models, capabilities=capabilities, **kwargs)
        self.fields["steer_vector"].queryset = SteeringVector.objects.filter(user=user)
        if capabilities.n_layers:
            self.fields["steer_layers"].help_text += f" 0–{capabilities.n_layers - 1}."
            self.fields[
                "capture_layers"
            ].help_text = f"Layer indices 0–{capabilities.n_layers - 1}, e.g. 0, 8, 16."
        reason = capabilities.activations_reason
        if reason:
            for name in ("capture", "capture_layers"):
                self.fields[name].disabled = True
                self.fields[name].help_text = reason

    def clean(self):
        data = super().clean()
        capture = data.get("capture")
        if capture == "layers":
            try:
                data["layers"] = layer_list(data.get("capture_layers") or "", self.capabilities)
            except forms.ValidationError as error:
                self.add_error("capture_layers", error)
        if capture:
            self.rule(
                check_capture_request,
                prompts=len(data["prompts"]),
                n=data.get("n") or 1,
                stream=bool(data.get("stream")),
                fields={"prompt": "capture", "n": "capture"},
            )
        self._clean_steering(data)
        return data

    def _clean_steering(self, data: dict) -> None:
        """Check the steering fields; sets `steer_layer_list` when a vector is picked."""
        vector = data.get("steer_vector")
        if vector is None:
            if data.get("steer_layers"):
                self.add_error("steer_vector", "Pick a vector to steer with, or clear the layers.")
            return
        if self.capabilities.activations_reason:
            self.add_error("steer_vector", self.capabilities.activations_reason)
            return
        if data.get("model") and vector.model != data["model"]:
            self.add_error(
                "steer_vector",
                f"{vector.name} was made for {vector.model}; pick a vector of {data['model']}.",
            )
            return
        hidden = self.capabilities.hidden_size
        if hidden and vector.hidden_size != hidden:
            self.add_error(
                "steer_vector",
                f"{vector.name} has {vector.hidden_size} values; {data['model']} needs {hidden}.",
            )
            return
        try:
            data["steer_layer_list"] = (
                layer_list(data["steer_layers"], self.capabilities)
                if data.get("steer_layers")
                else [vector.layer]
            )
        except forms.ValidationError as error:
            self.add_error("steer_layers", error)
        scale = data.get("steer_scale")
        if scale is None:
            self.add_error("steer_scale", "Give the scale to steer with.")
        elif abs(scale) > MAX_SCALE:
            self.add_error("steer_scale", f"Within ±{MAX_SCALE:g}.")
        if data.get("steer_positions") and data.get("prompts"):
            self._clean_steering_positions(data)

    def _clean_steering_positions(self, data: dict) -> None:
        """Sets `steer_position_list` (see `steering_position_list`), or a field error."""
        try:
            data["steer_position_list"] = steering_position_list(
                data["steer_positions"],
                model_id=self.capabilities.id,
                prompts=data["prompts"],
                max_tokens=data.get("max_tokens") or DEFAULT_MAX_TOKENS,
            )
        except forms.ValidationError as error:
            self.add_error("steer_positions", error)

    def to_request(self) -> dict:
        """The request body exactly as it will be sent (empty fields left out)."""
        data = self.cleaned_data
        body = super().to_request()
        if data.get("stream"):
            body["stream"] = True
            if data.get("include_usage"):
                body["stream_options"] = {"include_usage": True}
        if data.get("capture") == "all":
            body["output_residual_stream"] = True
        elif data.get("capture") == "layers":
            body["output_residual_stream"] = data["layers"]
        if data.get("steer_vector"):
            body["apply_steering_vectors"] = [
                steering_entry(
                    data["steer_vector"],
                    layers=data["steer_layer_list"],
                    scale=data["steer_scale"],
                    positions=data.get("steer_position_list"),
                )
            ]
        return body

    @staticmethod
    def initial_from_request(request: dict) -> dict:
        """Form values that reproduce a stored request (for edit-and-re-run)."""
        prompt = request.get("prompt", "")
        several = isinstance(prompt, list)
        initial = {
            "model": request.get("model"),
            "prompt": "\n".join(prompt) if several else prompt,
            "several_prompts": several,
            "stop": "\n".join(request.get("stop") or []),
            "echo": bool(request.get("echo")),
            "stream": bool(request.get("stream")),
            "include_usage": bool((request.get("stream_options") or {}).get("include_usage")),
        }
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n"):
            initial[name] = request.get(name)
        initial["logprobs"] = request.get("logprobs")
        initial["prompt_logprobs"] = request.get("prompt_logprobs")
        capture = request.get("output_residual_stream")
        if capture is True:
            initial["capture"] = "all"
        elif isinstance(capture, list):
            initial["capture"] = "layers"
            initial["capture_layers"] = ", ".join(str(layer) for layer in capture)
        steering = request.get("apply_steering_vectors") or []
        if len(steering) == 1:
            layers = steering[0]["layer_indices"]
            initial["steer_layers"] = ", ".join(str(layer) for layer in layers)
            initial["steer_scale"] = steering[0].get("scale", 1.0)
            if steering[0].get("position_indices"):
                initial["steer_positions"] = positions_text(steering[0]["position_indices"])
        return initial


def _limit_layer(field: forms.IntegerField, capabilities: ModelCapabilities) -> None:
    if capabilities.n_layers:
        top = capabilities.n_layers - 1
        field.validators.append(MaxValueValidator(top))
        field.widget.attrs["max"] = top
        field.help_text = f"0–{top}."


class ContrastVectorForm(SubmitOnceForm):
    """Two prompts captured at one layer; the vector is the difference of their rows after
    position 0 (`services.vectors.contrast_difference`), so each prompt needs two tokens."""

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
            scales = _float_list(
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
