"""Playground forms. Limits shown next to each field are the API contract's; the API checks
them again, and its error code is shown on the run if a request still fails there."""

import json
import math
import uuid

from django import forms
from django.core.validators import MaxValueValidator

from acs_client.protocol import (
    MAX_HARVEST_PROMPTS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    NON_STREAMING_MAX_TOKENS,
    OUTPUT_WORK_CAP,
    RuleBroken,
    check_capture_request,
    check_field_pairs,
    check_output_work,
    check_steering_positions,
    quartile_layers,
)
from api.errors import ApiError
from api.limits import MAX_BODY_BYTES
from api.schemas import DEFAULT_MAX_TOKENS

from .figures import TYPICAL_NORM_DEFINITION
from .models import SteeringVector, VectorMethod
from .run_tokens import numbered_tokens, shown_tokens, tokenize
from .services.vectors import VectorError, steering_entry, vector_from_npy

DEFAULT_MAX_LOGPROBS = 100
MAX_SWEEP_SCALES = 12
# |scale| (or |multiple of the typical norm|) above this swamps the residual stream entirely.
MAX_SCALE = 1000.0
# Layer lists when the model list (and so the model's layer count) cannot be read.
MAX_LAYERS_UNKNOWN_MODEL = 64
# Contrast prompts are short phrases; each is captured at one layer.
MAX_CONTRAST_PROMPT_CHARS = 2000
# The steering prompt is sent once per scale plus the baseline.
MAX_STEERING_PROMPT_CHARS = 8000
# A comma-separated list field: long enough for every layer of a large model, written out.
LIST_FIELD_MAX_CHARS = 1000


def split_list(text: str, *, field: str, max_count: int) -> list[str]:
    """The comma-separated parts of `text`, refused before splitting when there are more
    than `max_count` (a field of 100,000 zeros must not become a list of 100,000)."""
    if text.count(",") >= max_count:
        raise forms.ValidationError(
            f"{field}: at most {max_count}; you gave {text.count(',') + 1:,}."
        )
    return [part for part in text.replace(" ", "").split(",") if part]


def first_repeated(values: list):
    """The first value of `values` that an earlier one equals, or None: one pass with a set
    (a position list of 32,000 is checked in 32,000 steps, not half a billion)."""
    seen = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


def int_list(text: str, *, field: str, max_count: int) -> list[int]:
    """Distinct whole numbers, at most `max_count` of them."""
    try:
        values = [int(part) for part in split_list(text, field=field, max_count=max_count)]
    except ValueError:
        raise forms.ValidationError(f"{field}: write whole numbers separated by commas.") from None
    if not values:
        raise forms.ValidationError(f"{field}: give at least one number.")
    repeated = first_repeated(values)
    if repeated is not None:
        raise forms.ValidationError(f"{field}: {repeated} is listed more than once.")
    return values


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


def float_list(text: str, *, field: str, max_count: int) -> list[float]:
    try:
        values = [float(p) for p in split_list(text, field=field, max_count=max_count)]
    except ValueError:
        raise forms.ValidationError(f"{field}: write numbers separated by commas.") from None
    if not values or not all(math.isfinite(value) for value in values):
        raise forms.ValidationError(f"{field}: give at least one finite number.")
    return values


class SubmitOnceForm(forms.Form):
    """A form whose submission creates runs. It carries a hidden one-time token, new each
    time the form is rendered, stored with the first run it creates: the same token posted
    again (a double click, a resent page) returns what the first post made."""

    submit_token = forms.UUIDField(widget=forms.HiddenInput, required=False)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["submit_token"].initial = uuid.uuid4()


class ModelCapabilities:
    """What the form needs from one `/v1/models` entry; unknown values get the contract's
    defaults so the form still works when the model list cannot be read."""

    def __init__(self, entry: dict | None):
        entry = entry or {}
        capabilities = entry.get("capabilities") or {}
        self.id = entry.get("id", "")
        self.max_model_len = capabilities.get("max_model_len")
        self.max_logprobs = capabilities.get("max_logprobs") or DEFAULT_MAX_LOGPROBS
        self.full_vocab_max_prompt_tokens = capabilities.get("full_vocab_max_prompt_tokens", 256)
        self.activations = bool(capabilities.get("activations"))
        self.n_layers = capabilities.get("n_layers")
        self.hidden_size = capabilities.get("hidden_size")
        self.max_steering_vectors = capabilities.get("max_steering_vectors", 8)

    @property
    def activations_reason(self) -> str:
        """Why capture and steering are unavailable ("" when they are available)."""
        if not self.id:
            return "The model list could not be read, so activation support is unknown."
        if not self.activations:
            return f"{self.id} does not support activation capture or steering."
        return ""


class CompletionForm(SubmitOnceForm):
    """Every field of POST /v1/completions, grouped in the template."""

    model = forms.ChoiceField()
    prompt = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), strip=False)
    several_prompts = forms.BooleanField(
        required=False, label="Several prompts", help_text="One prompt per line."
    )
    max_tokens = forms.IntegerField(
        required=False,
        min_value=1,
        help_text=f"Needed with several prompts or n > 1; ≤ {NON_STREAMING_MAX_TOKENS:,} "
        f"without streaming; prompts × n × max_tokens ≤ {OUTPUT_WORK_CAP:,}.",
    )
    temperature = forms.FloatField(
        required=False,
        min_value=0,
        max_value=MAX_TEMPERATURE,
        help_text=f"0–{MAX_TEMPERATURE:g}; default 1.0.",
    )
    top_p = forms.FloatField(required=False, min_value=0, max_value=1, help_text="(0, 1]; 1.0.")
    top_k = forms.IntegerField(required=False, min_value=-1, help_text="−1 (off) or ≥ 1.")
    seed = forms.IntegerField(required=False, help_text="Same seed, same output when idle.")
    stop = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        strip=False,
        help_text=f"Up to {MAX_STOP_STRINGS} strings, one per line.",
    )
    n = forms.IntegerField(required=False, min_value=1, max_value=MAX_N, help_text=f"1–{MAX_N}.")
    logprobs = forms.IntegerField(required=False, min_value=0)
    prompt_logprobs = forms.IntegerField(required=False, min_value=-1)
    echo = forms.BooleanField(required=False, help_text="Prefix the prompt to the text.")
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
        super().__init__(*args, **kwargs)
        self.capabilities = capabilities
        if "steer_vector" in self.fields:  # (the Jobs page's subclass does not steer)
            self.fields["steer_vector"].queryset = SteeringVector.objects.filter(user=user)
            if capabilities.n_layers:
                self.fields["steer_layers"].help_text += f" 0–{capabilities.n_layers - 1}."
        self.fields["model"].choices = [(m["id"], m["id"]) for m in models] or [
            (capabilities.id, capabilities.id or "(model list unavailable)")
        ]
        limit = capabilities.max_logprobs
        self.fields["logprobs"].widget.attrs["max"] = limit
        self.fields["logprobs"].help_text = f"Top-k per generated token, 0–{limit}."
        self.fields["prompt_logprobs"].widget.attrs["max"] = limit
        self.fields["prompt_logprobs"].help_text = (
            f"−1 (whole vocabulary, ≤ {capabilities.full_vocab_max_prompt_tokens} prompt tokens"
            f" × n) to {limit}."
        )
        if "capture" in self.fields:  # (the Jobs page's subclass has no capture)
            self._describe_capture(capabilities)

    def _describe_capture(self, capabilities: ModelCapabilities) -> None:
        if capabilities.n_layers:
            self.fields[
                "capture_layers"
            ].help_text = f"Layer indices 0–{capabilities.n_layers - 1}, e.g. 0, 8, 16."
        reason = capabilities.activations_reason
        if reason:
            for name in ("capture", "capture_layers"):
                self.fields[name].disabled = True
                self.fields[name].help_text = reason

    def clean_stop(self):
        stops = [line for line in self.cleaned_data["stop"].splitlines() if line]
        if len(stops) > MAX_STOP_STRINGS:
            raise forms.ValidationError(
                f"At most {MAX_STOP_STRINGS} stop strings; you gave {len(stops)}."
            )
        return stops

    def clean_logprobs(self):
        return self._within_max_logprobs("logprobs")

    def clean_prompt_logprobs(self):
        return self._within_max_logprobs("prompt_logprobs")

    def _within_max_logprobs(self, name):
        value = self.cleaned_data[name]
        if value is not None and value > self.capabilities.max_logprobs:
            raise forms.ValidationError(f"At most {self.capabilities.max_logprobs} for this model.")
        return value

    def clean(self):
        data = super().clean()
        prompt = data.get("prompt") or ""
        prompts = (
            [line for line in prompt.splitlines() if line]
            if data.get("several_prompts")
            else [prompt]
        )
        data["prompts"] = prompts
        if not prompts and "prompt" in data:
            self.add_error("prompt", "Several prompts: one per line, and every line here is empty.")
        n = data.get("n") or 1
        max_tokens = data.get("max_tokens")
        if (len(prompts) > 1 or n > 1) and max_tokens is None:
            self.add_error("max_tokens", "Set max_tokens when sending several prompts or n > 1.")
        if max_tokens:
            self._rule(check_output_work, sequences=len(prompts) * n, max_tokens=max_tokens)
        self._rule(
            check_field_pairs,
            stream=bool(data.get("stream")),
            prompt_logprobs=data.get("prompt_logprobs"),
            echo=bool(data.get("echo")),
            # Asked for by the playground itself, only without echo (run_tokens.with_token_ids).
            return_token_ids=False,
        )
        if max_tokens and not data.get("stream") and max_tokens > NON_STREAMING_MAX_TOKENS:
            self.add_error(
                "max_tokens",
                f"Without streaming max_tokens is at most {NON_STREAMING_MAX_TOKENS:,}.",
            )
        capture = data.get("capture")
        if capture == "layers":
            try:
                data["layers"] = _layer_list(data.get("capture_layers") or "", self.capabilities)
            except forms.ValidationError as error:
                self.add_error("capture_layers", error)
        if capture:
            self._rule(
                check_capture_request,
                prompts=len(prompts),
                n=n,
                stream=bool(data.get("stream")),
                fields={"prompt": "capture", "n": "capture"},
            )
        if "steer_vector" in self.fields:
            self._clean_steering(data)
        return data

    def _rule(self, check, *, fields: dict | None = None, **terms) -> None:
        """`check(**terms)`, a rule the API enforces too (`acs_client.protocol`), its message
        a field error: on the field it names, or on `fields[that field]`."""
        try:
            check(**terms)
        except RuleBroken as error:
            self.add_error((fields or {}).get(error.field, error.field), str(error))

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
                _layer_list(data["steer_layers"], self.capabilities)
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
        prompts = data["prompts"]
        body = {"model": data["model"], "prompt": prompts if len(prompts) > 1 else prompts[0]}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n"):
            if data.get(name) is not None:
                body[name] = data[name]
        if data["stop"]:
            body["stop"] = data["stop"]
        for name in ("logprobs", "prompt_logprobs"):
            if data.get(name) is not None:
                body[name] = data[name]
        if data.get("echo"):
            body["echo"] = True
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


def _layer_list(text: str, capabilities: ModelCapabilities) -> list[int]:
    """Distinct layer indices of the model, at most one per layer it has."""
    n_layers = capabilities.n_layers
    layers = int_list(text, field="Layers", max_count=n_layers or MAX_LAYERS_UNKNOWN_MODEL)
    outside = next((v for v in layers if v < 0 or (n_layers and v >= n_layers)), None)
    if outside is not None:
        top = f" Layers run from 0 to {n_layers - 1}." if n_layers else ""
        raise forms.ValidationError(f"No such layer: {outside}.{top}")
    return layers


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
                _layer_list(data["layers"], self.capabilities)
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


class CompletionJobForm(CompletionForm):
    """The Jobs page's completion job: the playground's completion fields, without streaming
    (a job's result is fetched when it is done) and capture."""

    prefix = "completion"
    stream = None
    include_usage = None
    capture = None
    capture_layers = None
    steer_vector = None
    steer_layers = None
    steer_scale = None
    steer_positions = None


def prompts_from_file(upload) -> list[str]:
    """The prompts of an uploaded file: one per line of a text file, or one per line of a
    JSON Lines file (`.jsonl`), each line a JSON string or an object with a "prompt" string.
    Blank lines are skipped. A prompt holding NUL is refused, as the API refuses it
    (`api.bodies`)."""
    # No larger than the request body the API takes.
    if upload.size > MAX_BODY_BYTES:
        raise forms.ValidationError(f"The file is larger than {MAX_BODY_BYTES // 2**20} MiB.")
    try:
        lines = upload.read().decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise forms.ValidationError("The file is not UTF-8 text.") from None
    jsonl = upload.name.lower().endswith(".jsonl")
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        value = _jsonl_prompt(line, number) if jsonl else line
        if "\0" in value:
            raise forms.ValidationError(
                f"Line {number} holds a NUL character, which prompts cannot contain."
            )
        prompts.append(value)
    return prompts


def _jsonl_prompt(line: str, number: int) -> str:
    try:
        value = json.loads(line)
    except ValueError:
        raise forms.ValidationError(f"Line {number} is not JSON.") from None
    if isinstance(value, dict):
        value = value.get("prompt")
    if not isinstance(value, str) or not value:
        raise forms.ValidationError(
            f'Line {number}: give a JSON string or an object with a "prompt" string.'
        )
    return value


class HarvestJobForm(SubmitOnceForm):
    """A harvest job: prompts pasted (one per line) or uploaded, layers picked from the
    model's layers. None is ticked at first: the layers sent are exactly those ticked, and
    none ticked sends none, so the API captures its default (the quartile layers, named in
    the help text)."""

    prefix = "harvest"

    model = forms.ChoiceField()
    prompts = forms.CharField(
        required=False,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 4}),
        label="Prompts, one per line",
    )
    prompts_file = forms.FileField(
        required=False,
        label="Or upload prompts",
        help_text='A .txt file (one prompt per line) or .jsonl (one JSON string or {"prompt": '
        f"…}} per line); at most {MAX_HARVEST_PROMPTS:,} prompts.",
    )
    layers = forms.TypedMultipleChoiceField(
        coerce=int, required=False, widget=forms.CheckboxSelectMultiple, label="Layers to capture"
    )
    add_special_tokens = forms.BooleanField(
        required=False, initial=True, help_text="Start each prompt with the model's BOS token."
    )

    def __init__(self, *args, models: list[dict], capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.capabilities = capabilities
        self.fields["model"].choices = [(m["id"], m["id"]) for m in models] or [
            (capabilities.id, capabilities.id or "(model list unavailable)")
        ]
        self.fields["model"].initial = capabilities.id
        n_layers = capabilities.n_layers or 0
        self.fields["layers"].choices = [(layer, str(layer)) for layer in range(n_layers)]
        default = ", ".join(str(layer) for layer in quartile_layers(n_layers)) if n_layers else ""
        self.fields["layers"].help_text = (
            f"Only the layers you tick. None ticked: the API's default, layers {default} "
            "(a quarter, half and three quarters deep)."
            if default
            else "None ticked: the API's default, the quartile layers of the model."
        )
        reason = capabilities.activations_reason
        if reason:
            self.fields["model"].help_text = reason

    def clean(self):
        data = super().clean()
        if self.capabilities.activations_reason:
            self.add_error("model", self.capabilities.activations_reason)
        pasted = [line for line in (data.get("prompts") or "").splitlines() if line.strip()]
        upload = data.get("prompts_file")
        if pasted and upload:
            self.add_error("prompts", "Paste prompts or upload a file, not both.")
            return data
        try:
            prompts = prompts_from_file(upload) if upload else pasted
        except forms.ValidationError as error:
            self.add_error("prompts_file", error)
            return data
        if not prompts:
            self.add_error("prompts", "Give at least one prompt, here or as a file.")
        elif len(prompts) > MAX_HARVEST_PROMPTS:
            self.add_error(
                "prompts_file" if upload else "prompts",
                f"At most {MAX_HARVEST_PROMPTS:,} prompts per job; you gave {len(prompts):,}.",
            )
        data["prompt_list"] = prompts
        return data

    def to_request(self) -> dict:
        """The POST /v1/harvest body."""
        data = self.cleaned_data
        layers = {"layers": data["layers"]} if data["layers"] else {}
        return {
            "model": data["model"],
            "prompts": data["prompt_list"],
            **layers,
            "add_special_tokens": data["add_special_tokens"],
        }
