"""The Patchscope form, for one source capture run: the source position (labelled by its
token) and layers (those the run captured), the inspection prompt (tokenized as the gateway
counts it) and position, the target layer and how many tokens to generate."""

import numpy as np
from django import forms

from acs_client.protocol import RuleBroken, check_steering_positions
from api.errors import ApiError
from api.request_forms import (
    LIST_FIELD_MAX_CHARS,
    ModelCapabilities,
    SubmitOnceForm,
    int_list,
    layers_check,
)
from playground.captures import Capture
from playground.tokens import numbered_tokens, tokenize

# The token identity prompt of Ghandeharioun et al. (2024, "Patchscopes"): examples of a
# token repeated after "->" set the model to repeat what stands in the last slot, and the
# "?" there carries no meaning of its own for the injected state to compete with. So what
# the model writes after it is what the injected state says to the model itself, read out
# with no task asked of it.
DEFAULT_INSPECTION_PROMPT = "cat -> cat; 1135 -> 1135; hello -> hello; ?"
DEFAULT_MAX_TOKENS = 10
MAX_PATCHSCOPE_TOKENS = 64
MAX_INSPECTION_PROMPT_TOKENS = 256
MAX_INSPECTION_PROMPT_CHARS = 2000


class PatchscopeForm(SubmitOnceForm):
    prefix = "scope"

    source_position = forms.TypedChoiceField(
        coerce=int,
        label="Source position",
        help_text="The source run's token whose hidden state is read out.",
    )
    source_layers = forms.CharField(
        required=False,
        max_length=LIST_FIELD_MAX_CHARS,
        label="Source layers",
        help_text="Comma-separated; empty: every layer the run captured. One generation each.",
    )
    inspection_prompt = forms.CharField(
        label="Inspection prompt",
        strip=False,
        max_length=MAX_INSPECTION_PROMPT_CHARS,
        initial=DEFAULT_INSPECTION_PROMPT,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="The default is the token identity prompt of Ghandeharioun et al. (2024): "
        "its examples make the model repeat what stands in the last slot, and the neutral “?” "
        "there is what the hidden state replaces, so the model writes out what that state "
        "means to it.",
    )
    inspection_position = forms.IntegerField(
        required=False,
        label="Inspection position",
        help_text="The inspection prompt's token whose hidden state is replaced; empty: its "
        "last token (the “?” of the default).",
    )
    target_layer = forms.IntegerField(
        required=False,
        min_value=0,
        label="Target layer",
        help_text="Where the state is injected; empty (the default): the same layer as each "
        "source layer.",
    )
    max_tokens = forms.IntegerField(
        min_value=1,
        max_value=MAX_PATCHSCOPE_TOKENS,
        initial=DEFAULT_MAX_TOKENS,
        label="Max tokens",
        help_text="Generated greedily by each generation, all of them (the end-of-text token "
        "does not stop it), so the cost stated is the cost billed.",
    )

    def __init__(self, *args, capture: Capture, capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture = capture
        self.capabilities = capabilities
        self.fields["source_position"].choices = [
            (row.row, row.label + (" (generated)" if row.part == "generated" else ""))
            for row in capture.rows
        ]
        self.fields["source_position"].initial = max(capture.prompt_length - 1, 0)
        self.fields["source_layers"].help_text += f" Captured: {_layer_text(capture.layers)}."
        if capabilities.n_layers:
            self.fields["target_layer"].help_text += f" Layers 0–{capabilities.n_layers - 1}."

    def clean_source_layers(self) -> list[int]:
        text = self.cleaned_data.get("source_layers") or ""
        if not text.strip():
            return list(self.capture.layers)
        layers = int_list(text, field="Source layers", max_count=len(self.capture.layers))
        missing = next((layer for layer in layers if layer not in self.capture.layers), None)
        if missing is not None:
            raise forms.ValidationError(
                f"Layer {missing} was not captured by the source run; it captured "
                f"{_layer_text(self.capture.layers)}."
            )
        return sorted(layers)

    def clean_target_layer(self) -> int | None:
        layer = self.cleaned_data.get("target_layer")
        count = self.capabilities.n_layers
        if layer is not None and count:
            layers_check([layer], n_layers=count, field="Target layer")
        return layer

    def clean(self):
        data = super().clean()
        reason = self.capabilities.activations_reason
        if reason:
            raise forms.ValidationError(reason)
        if not data.get("inspection_prompt") or "max_tokens" not in data:
            return data
        try:
            [tokens] = tokenize(self.capabilities.id, [(data["inspection_prompt"], True)])
        except ApiError as error:
            raise forms.ValidationError(
                f"The inspection prompt could not be tokenized ({error.code}: {error.message})."
            ) from None
        if len(tokens.ids) > MAX_INSPECTION_PROMPT_TOKENS:
            self.add_error(
                "inspection_prompt",
                f"The inspection prompt is {len(tokens.ids)} tokens; at most "
                f"{MAX_INSPECTION_PROMPT_TOKENS}.",
            )
            return data
        limit = self.capabilities.max_model_len
        if limit and len(tokens.ids) + data["max_tokens"] > limit:
            self.add_error(
                "max_tokens",
                f"The inspection prompt ({len(tokens.ids)} tokens) and {data['max_tokens']} "
                f"generated tokens exceed the model's context of {limit} tokens.",
            )
            return data
        data["inspection"] = tokens
        position = data.get("inspection_position")
        if position is None:
            position = len(tokens.ids) - 1
        if not 0 <= position < len(tokens.ids):
            message = (
                f"No position {position}: the inspection prompt has {len(tokens.ids)} tokens, "
                f"0–{len(tokens.ids) - 1}."
            )
        else:
            try:
                # As the API will: position 0 is refused when generating several tokens.
                check_steering_positions(
                    [position], prompt_tokens=len(tokens.ids), max_tokens=data["max_tokens"]
                )
                message = ""
            except RuleBroken as error:
                message = f"Position {position} cannot be inspected: {error}"
        if message:
            self.add_error(
                "inspection_position",
                f"{message} The inspection prompt's tokens: {numbered_tokens(tokens)}.",
            )
            return data
        data["inspection_position"] = position
        return data

    def source_states(self) -> np.ndarray:
        """The source run's residual stream at the chosen position and layers,
        `[layers, hidden]` (float32, from the bfloat16 the API gave)."""
        data = self.cleaned_data
        rows = [self.capture.layers.index(layer) for layer in data["source_layers"]]
        return self.capture.tensor[rows, data["source_position"]]

    def source_token(self) -> str:
        return self.capture.rows[self.cleaned_data["source_position"]].token or ""


def _layer_text(layers: list[int]) -> str:
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}–{layers[-1]}"
    return ", ".join(str(layer) for layer in layers)
