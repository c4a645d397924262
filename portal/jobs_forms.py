"""The Jobs page's forms: a completion job and a harvest job, each written as its /v1 body."""

import json

from django import forms

from acs_client.protocol import MAX_HARVEST_PROMPTS, quartile_layers
from api.limits import MAX_BODY_BYTES
from api.request_forms import CompletionRequestForm, ModelCapabilities, SubmitOnceForm


class CompletionJobForm(CompletionRequestForm):
    """The Jobs page's completion job: the completion fields without streaming (a job's result
    is fetched when it is done), capture or steering."""

    prefix = "completion"


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
