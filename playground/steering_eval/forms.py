"""The steering evaluation form: a library vector, scales, where to steer and a dataset of
prompts with a target and a foil (pasted or uploaded), tokenized as the gateway counts them,
priced, and checked against what the user's playground key has left. The cost is stated
before anything is sent: a submission whose `confirmed_cost` is not the evaluation's token
count only shows the cost (see `views.steering_eval_submit`)."""

from django import forms

from api.errors import ApiError
from api.request_forms import LIST_FIELD_MAX_CHARS, ModelCapabilities, SubmitOnceForm
from playground.fields import MAX_SCALE, float_list
from playground.tokens import shown_tokens, tokenize

from ..models import SteeringVector
from . import dataset as datasets
from .models import SteerAt
from .selectors import budget_shortfall
from .services import REPEATS, evaluation_cost

MAX_SCALES = 6
MAX_PROMPT_TOKENS = 128
MAX_COMPLETION_TOKENS = 8
# An uploaded file: at most this many bytes (UTF-8 of the largest text accepted).
MAX_UPLOAD_BYTES = 4 * datasets.MAX_DATASET_CHARS


class SteeringEvalForm(SubmitOnceForm):
    prefix = "steereval"

    vector = forms.ModelChoiceField(
        queryset=SteeringVector.objects.none(),
        help_text="From your vector library; added at its own layer.",
    )
    scales = forms.CharField(
        initial="0, 4, 8",
        max_length=LIST_FIELD_MAX_CHARS,
        help_text=f"Up to {MAX_SCALES} absolute scales separated by commas, each within "
        f"±{MAX_SCALE:g}. Include 0: steering at scale 0 is an exact no-op, so its change must "
        "sit within the noise floor — the control that the comparison is fair.",
    )
    steer_at = forms.ChoiceField(
        choices=SteerAt.choices,
        initial=SteerAt.ALL,
        label="Steer at",
        help_text="Default: every position, the prompt's and the completion's (as a steered "
        "generation is). Or only the prompt's last token.",
    )
    dataset = forms.CharField(
        required=False,
        strip=False,
        max_length=datasets.MAX_DATASET_CHARS,
        widget=forms.Textarea(attrs={"rows": 6, "spellcheck": "false"}),
        label="Dataset",
        help_text=datasets.FORMAT_HELP,
    )
    dataset_file = forms.FileField(
        required=False,
        label="Or upload it",
        help_text="A .csv or .jsonl file in the same format; it replaces the text above.",
    )
    # The token count the page stated: the evaluation runs only once it has been shown.
    confirmed_cost = forms.IntegerField(required=False, widget=forms.HiddenInput)

    def __init__(self, *args, user, capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user
        self.capabilities = capabilities
        vectors = SteeringVector.objects.filter(user=user).defer("data")
        self.fields["vector"].queryset = vectors
        if not vectors.exists():
            self.fields["vector"].help_text = (
                "Your library has no vector yet: make one on the playground page (contrast "
                "prompts, an upload or a capture)."
            )

    def clean_dataset_file(self):
        upload = self.cleaned_data.get("dataset_file")
        if upload is None:
            return None
        if upload.size > MAX_UPLOAD_BYTES:
            raise forms.ValidationError(
                f"The file is {upload.size:,} bytes; at most {MAX_UPLOAD_BYTES:,}."
            )
        try:
            return upload.read().decode("utf-8-sig")
        except UnicodeDecodeError:
            raise forms.ValidationError("The file is not UTF-8 text.") from None

    def clean_scales(self):
        scales = float_list(self.cleaned_data["scales"], field="Scales", max_count=MAX_SCALES)
        if len(set(scales)) != len(scales):
            raise forms.ValidationError("Scales: each scale once.")
        if any(abs(scale) > MAX_SCALE for scale in scales):
            raise forms.ValidationError(f"Scales: each within ±{MAX_SCALE:g}.")
        return scales

    def clean(self):
        data = super().clean()
        reason = self.capabilities.activations_reason
        if reason:
            raise forms.ValidationError(reason)
        vector = data.get("vector")
        if vector is not None and vector.model != self.capabilities.id:
            self.add_error(
                "vector",
                f"This vector was made on {vector.model}; the evaluation runs on "
                f"{self.capabilities.id}.",
            )
        field = "dataset_file" if data.get("dataset_file") else "dataset"
        text = data.get("dataset_file") or data.get("dataset") or ""
        if not text.strip():
            if "dataset_file" not in self.errors:
                self.add_error("dataset", "Paste the dataset or upload a file.")
            return data
        try:
            rows = datasets.parse_dataset(text)
        except datasets.DatasetError as error:
            self.add_error(field, str(error))
            return data
        if self.errors:
            return data
        data["text"] = text
        data["rows"] = self._tokenized(rows, field)
        if self.errors:
            return data
        data["cost"] = evaluation_cost(rows=data["rows"], scales=data["scales"])
        shortfall = budget_shortfall(user=self.user, cost=data["cost"])
        if shortfall:
            self.add_error(None, shortfall)
        return data

    def _tokenized(self, rows: list[datasets.DatasetRow], field: str) -> list[dict]:
        """Each row with its texts' token ids and strings; an error naming the first row
        whose prompt or completion is too long."""
        texts = []
        for row in rows:
            texts += [(row.prompt, True), (row.target, False), (row.foil, False)]
        try:
            tokens = tokenize(self.capabilities.id, texts)
        except ApiError as error:
            raise forms.ValidationError(
                f"The dataset could not be tokenized ({error.code}: {error.message})."
            ) from None
        result = []
        for index, row in enumerate(rows):
            prompt, target, foil = tokens[3 * index : 3 * index + 3]
            limits = (("prompt", prompt, MAX_PROMPT_TOKENS), ("target", target,
                      MAX_COMPLETION_TOKENS), ("foil", foil, MAX_COMPLETION_TOKENS))  # fmt: skip
            for name, counted, limit in limits:
                if len(counted.ids) > limit:
                    self.add_error(
                        field,
                        f"Row {index + 1}: the {name} is {len(counted.ids)} tokens; at most "
                        f"{limit}: {shown_tokens(counted)}.",
                    )
                    return []
            result.append(
                {
                    "prompt": row.prompt, "target": row.target, "foil": row.foil,
                    "prompt_ids": prompt.ids, "prompt_strings": prompt.strings,
                    "target_ids": target.ids, "target_strings": target.strings,
                    "foil_ids": foil.ids, "foil_strings": foil.strings,
                }
            )  # fmt: skip
        return result


def cost_statement(cost: dict, *, prompts: int, scales: int) -> str:
    """The cost as the page states it before the evaluation is submitted."""
    return (
        f"{cost['requests']:,} requests ({prompts} prompt{'s' * (prompts != 1)} × ({scales} "
        f"scale{'s' * (scales != 1)} + {REPEATS} "
        f"unsteered repeats) × 2 completions): {cost['prompt_tokens']:,} prompt tokens + "
        f"{cost['completion_tokens']:,} generated tokens (one per request) = "
        f"{cost['total_tokens']:,} tokens, and {cost['activation_requests']:,} activation "
        "requests (the steered ones), from your Playground key's budgets."
    )
