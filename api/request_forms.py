"""Django forms that write a /v1 request body, shared by the playground and the portal's Jobs
page: the completion fields, the model's capabilities they are checked against, list fields,
and the one-time submit token. Limits shown next to each field are the API contract's
(`acs_client.protocol`); the API checks them again."""

import uuid

from django import forms

from acs_client.protocol import (
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    NON_STREAMING_MAX_TOKENS,
    OUTPUT_WORK_CAP,
    RuleBroken,
    check_field_pairs,
    check_layer_list,
    check_logprobs_limit,
    check_max_tokens_given,
    check_non_streaming_max_tokens,
    check_output_work,
)

DEFAULT_MAX_LOGPROBS = 100
# Layer lists when the model list (and so the model's layer count) cannot be read.
MAX_LAYERS_UNKNOWN_MODEL = 64
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


class CompletionRequestForm(SubmitOnceForm):
    """The fields of POST /v1/completions that every completion form has (the playground's
    adds streaming, capture and steering): `clean` checks the API's rules on them, and
    `to_request` writes them as the body sends them (empty fields left out)."""

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

    def __init__(self, *args, models: list[dict], capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.capabilities = capabilities
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

    def clean_stop(self):
        stops = [line for line in self.cleaned_data["stop"].splitlines() if line]
        if len(stops) > MAX_STOP_STRINGS:
            raise forms.ValidationError(
                f"At most {MAX_STOP_STRINGS} stop strings; you gave {len(stops)}."
            )
        return stops

    def clean(self):
        """Sets `prompts` (one, or one per line with several prompts)."""
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
        self.rule(check_max_tokens_given, max_tokens=max_tokens, prompts=len(prompts), n=n)
        if max_tokens:
            self.rule(check_output_work, sequences=len(prompts) * n, max_tokens=max_tokens)
        self.rule(
            check_field_pairs,
            stream=bool(data.get("stream")),
            prompt_logprobs=data.get("prompt_logprobs"),
            echo=bool(data.get("echo")),
            # Asked for by the playground itself, only without echo
            # (playground.tokens.with_token_ids).
            return_token_ids=False,
        )
        if max_tokens:
            self.rule(
                check_non_streaming_max_tokens,
                stream=bool(data.get("stream")),
                max_tokens=max_tokens,
            )
        self.rule(
            check_logprobs_limit,
            logprobs=data.get("logprobs"),
            prompt_logprobs=data.get("prompt_logprobs"),
            max_logprobs=self.capabilities.max_logprobs,
        )
        return data

    def rule(self, check, *, fields: dict | None = None, **terms) -> None:
        """`check(**terms)`, a rule the API enforces too (`acs_client.protocol`), its message
        a field error: on the field it names, or on `fields[that field]`."""
        try:
            check(**terms)
        except RuleBroken as error:
            self.add_error((fields or {}).get(error.field, error.field), str(error))

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
        return body


def layer_list(text: str, capabilities: ModelCapabilities, *, field: str = "Layers") -> list[int]:
    """Distinct layer indices, each one of the model's where its layer count is known (the
    API's rule, `layers_check`)."""
    n_layers = capabilities.n_layers
    layers = int_list(text, field=field, max_count=n_layers or MAX_LAYERS_UNKNOWN_MODEL)
    if n_layers:
        layers_check(layers, n_layers=n_layers, field=field)
    return layers


def layers_check(layers: list[int], *, n_layers: int, field: str) -> None:
    """The API's layer-list rule (`check_layer_list`) on a form's field `field`: its message
    as the field's error."""
    try:
        check_layer_list(layers, n_layers=n_layers, field=field)
    except RuleBroken as broken:
        raise forms.ValidationError(str(broken)) from None
