"""The activation patching form: prompts tokenized as the gateway counts them (the path
`run_tokens` uses for Run.tokens), checked to be of the same length, the target (and, for
the logit difference, the corrupted target) of a few tokens, the metric shown first, and the
layers and positions to patch."""

from django import forms

from api.errors import ApiError
from api.request_forms import (
    LIST_FIELD_MAX_CHARS,
    ModelCapabilities,
    SubmitOnceForm,
    int_list,
    layers_check,
)
from playground.patching.metrics import METRICS
from playground.patching.services import PatchingTarget
from playground.tokens import shown_tokens, tokenize

# Each cell is one request through the workers; a grid larger than this is refused (a
# 30-layer model and a 16-token prompt make 480 cells).
MAX_PATCHING_CELLS = 512
MAX_PATCHING_PROMPT_TOKENS = 64
MAX_PATCHING_PROMPT_CHARS = 1000
# A target's tokens are appended to every prompt of the grid and scored teacher-forced.
MAX_TARGET_TOKENS = 8


class PatchingForm(SubmitOnceForm):
    """A clean and a corrupted prompt of the same token length, the target (and the
    corrupted target for the logit difference), the metric shown first, and the layers and
    positions to patch (empty: all)."""

    prefix = "patch"

    clean_prompt = forms.CharField(
        label="Clean prompt",
        strip=False,
        max_length=MAX_PATCHING_PROMPT_CHARS,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="The prompt whose activations are patched in.",
    )
    corrupted_prompt = forms.CharField(
        label="Corrupted prompt",
        strip=False,
        max_length=MAX_PATCHING_PROMPT_CHARS,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="Same number of tokens as the clean prompt; usually a few words changed.",
    )
    target = forms.CharField(
        label="Target",
        strip=False,
        max_length=100,
        help_text=f"What the clean prompt should make likely, with its leading space (e.g. "
        f"“ Paris”); up to {MAX_TARGET_TOKENS} tokens, scored as the sum of their logprobs "
        "(each after the prompt and the target tokens before it).",
    )
    corrupted_target = forms.CharField(
        label="Corrupted target",
        required=False,
        strip=False,
        max_length=100,
        help_text="What the corrupted prompt makes likely instead (e.g. “ Rome”); needed for "
        "the logit difference.",
    )
    metric = forms.ChoiceField(
        choices=list(METRICS.items()),
        initial="logprob",
        help_text="Shown first; the grid page switches between the metrics its requests "
        "scored. Logit difference: log p(target) − log p(corrupted target) after the prompt "
        "(for one-token targets, logit(target) − logit(corrupted target) at the last "
        "position: the two share the normaliser).",
    )
    layers = forms.CharField(
        required=False,
        max_length=LIST_FIELD_MAX_CHARS,
        help_text="Comma-separated layer indices; empty: every layer.",
    )
    positions = forms.CharField(
        required=False,
        max_length=LIST_FIELD_MAX_CHARS,
        help_text="Comma-separated token positions (0 is the first token); empty: every one.",
    )

    def __init__(self, *args, capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.capabilities = capabilities
        if capabilities.n_layers:
            self.fields["layers"].help_text += f" Layers 0–{capabilities.n_layers - 1}."
        self.fields[
            "positions"
        ].help_text += f" At most {MAX_PATCHING_CELLS} layers × positions (one request each)."

    def clean(self):
        data = super().clean()
        reason = self.capabilities.activations_reason
        if reason:
            raise forms.ValidationError(reason)
        if not all(data.get(name) for name in ("clean_prompt", "corrupted_prompt", "target")):
            return data
        if data.get("metric") == "logit_diff" and not data.get("corrupted_target"):
            self.add_error(
                "corrupted_target",
                "The logit difference compares the target with the corrupted target: give it.",
            )
            return data
        texts = [(data["clean_prompt"], True), (data["corrupted_prompt"], True)]
        texts += [(data[name], False) for name in ("target", "corrupted_target") if data.get(name)]
        try:
            clean, corrupted, *targets = tokenize(self.capabilities.id, texts)
        except ApiError as error:
            raise forms.ValidationError(
                f"The prompts could not be tokenized ({error.code}: {error.message})."
            ) from None
        if len(clean.ids) != len(corrupted.ids):
            self.add_error(
                "corrupted_prompt",
                f"The corrupted prompt is {len(corrupted.ids)} tokens and the clean prompt "
                f"{len(clean.ids)}; patching needs the same length. Clean: {shown_tokens(clean)}. "
                f"Corrupted: {shown_tokens(corrupted)}.",
            )
        elif len(clean.ids) > MAX_PATCHING_PROMPT_TOKENS:
            self.add_error(
                "clean_prompt",
                f"The prompts are {len(clean.ids)} tokens; at most {MAX_PATCHING_PROMPT_TOKENS}.",
            )
        for name, tokens in zip(("target", "corrupted_target"), targets, strict=False):
            if len(tokens.ids) > MAX_TARGET_TOKENS:
                self.add_error(
                    name,
                    f"At most {MAX_TARGET_TOKENS} tokens; this is {len(tokens.ids)}: "
                    f"{shown_tokens(tokens)}.",
                )
        if len(targets) > 1 and targets[0].ids == targets[1].ids:
            self.add_error("corrupted_target", "The corrupted target must differ from the target.")
        if self.errors:
            return data
        data["clean_tokens"], data["corrupted_tokens"] = clean, corrupted
        data["targets"] = [
            PatchingTarget(text=data[name], tokens=tokens)
            for name, tokens in zip(("target", "corrupted_target"), targets, strict=False)
        ]
        data["layer_list"] = self._indices("layers", self.capabilities.n_layers, "layer")
        data["position_list"] = self._indices("positions", len(clean.ids), "position")
        if self.errors:
            return data
        cells = len(data["layer_list"]) * len(data["position_list"])
        if cells > MAX_PATCHING_CELLS:
            self.add_error(
                "positions",
                f"{len(data['layer_list'])} layers × {len(data['position_list'])} positions "
                f"is {cells} requests; at most {MAX_PATCHING_CELLS}. Choose fewer.",
            )
        return data

    def _indices(self, name: str, count: int | None, what: str) -> list[int] | None:
        """The sorted indices given in field `name` (all `count` when empty), each checked."""
        text = self.cleaned_data.get(name) or ""
        if not text.strip():
            if count is None:
                self.add_error(name, f"The model's {what} count is unknown: list the {name}.")
                return None
            return list(range(count))
        try:
            values = int_list(text, field=name.capitalize(), max_count=count or 1000)
        except forms.ValidationError as error:
            self.add_error(name, error)
            return None
        if what == "layer" and count:
            try:
                layers_check(values, n_layers=count, field=name.capitalize())
            except forms.ValidationError as error:
                self.add_error(name, error)
                return None
        outside = next((v for v in values if v < 0 or (count and v >= count)), None)
        if outside is not None:
            self.add_error(name, f"No such {what}: {outside}. They run from 0 to {count - 1}.")
            return None
        return sorted(values)
