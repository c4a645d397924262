"""Playground forms. Limits shown next to each field are the API contract's; the API checks
them again, and its error code is shown on the run if a request still fails there."""

from django import forms

from acs_client.protocol import (
    XARGS_CAPTURE,
    XARGS_STEERING,
    CompletionFields,
    check_capture_request,
)
from api.request_forms import (
    LIST_FIELD_MAX_CHARS,
    CompletionRequestForm,
    ModelCapabilities,
    layer_list,
)
from api.schemas import DEFAULT_MAX_TOKENS
from playground.fields import (
    MAX_SCALE,
    positions_text,
    steering_position_list,
    steering_positions_field,
)
from playground.models import SteeringVector
from playground.vectors.services import steering_entry


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
            body[XARGS_CAPTURE] = True
        elif data.get("capture") == "layers":
            body[XARGS_CAPTURE] = data["layers"]
        if data.get("steer_vector"):
            body[XARGS_STEERING] = [
                steering_entry(
                    data["steer_vector"],
                    layers=data["steer_layer_list"],
                    scale=data["steer_scale"],
                    positions=data.get("steer_position_list"),
                )
            ]
        return body

    @staticmethod
    def initial_from_request(request: CompletionFields) -> dict:
        """Form values that reproduce a stored request (for edit-and-re-run); a sampling
        field the request left out stays empty (the form's own default)."""
        prompt = request.prompt
        several = isinstance(prompt, list)
        initial = {
            "model": request.model,
            "prompt": "\n".join(prompt) if several else prompt,
            "several_prompts": several,
            "stop": "\n".join(request.stop_strings()),
            "echo": request.echo,
            "stream": request.stream,
            "include_usage": bool(request.stream_options and request.stream_options.include_usage),
        }
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n"):
            initial[name] = getattr(request, name) if name in request.model_fields_set else None
        initial["logprobs"] = request.logprobs
        initial["prompt_logprobs"] = request.prompt_logprobs
        capture = request.output_residual_stream
        if capture is True:
            initial["capture"] = "all"
        elif isinstance(capture, list):
            initial["capture"] = "layers"
            initial["capture_layers"] = ", ".join(str(layer) for layer in capture)
        steering = request.apply_steering_vectors or []
        if len(steering) == 1:
            initial["steer_layers"] = ", ".join(str(layer) for layer in steering[0].layer_indices)
            initial["steer_scale"] = steering[0].scale
            if steering[0].position_indices:
                initial["steer_positions"] = positions_text(steering[0].position_indices)
        return initial
