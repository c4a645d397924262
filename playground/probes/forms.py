"""The probe form: the dataset (pasted, or an uploaded file that takes its place), the layers
(`check_layer_list`), the pooling, the seed, the held-out fraction and C; and what it costs,
counted with the model's tokenizer as the gateway counts the harvest's prompts."""

from asgiref.sync import async_to_sync
from django import forms

from api.errors import ApiError
from api.request_forms import (
    LIST_FIELD_MAX_CHARS,
    ModelCapabilities,
    SubmitOnceForm,
    layer_list,
)
from api.selectors import model_get
from api.tokenizer import count_prompt_tokens

from .datasets import (
    FORMAT_HELP,
    MAX_DATASET_BYTES,
    DatasetError,
    check_split,
    parse_dataset,
)
from .fitting import BOOTSTRAP_RESAMPLES
from .models import Pooling

# The harvest's activations (bfloat16: layers × tokens × hidden × 2 bytes, summed over the
# texts) that a probe may ask for: the worker downloads them whole before pooling.
MAX_HARVEST_BYTES = 256 * 1024 * 1024
MAX_C = 1e6


def harvest_bytes(token_counts: list[int], *, layers: int, hidden_size: int) -> int:
    return 2 * layers * hidden_size * sum(token_counts)


class ProbeForm(SubmitOnceForm):
    prefix = "probe"

    dataset = forms.CharField(
        required=False,
        strip=False,
        max_length=MAX_DATASET_BYTES,
        widget=forms.Textarea(attrs={"rows": 8, "spellcheck": "false"}),
        label="Dataset (text, label)",
        help_text=FORMAT_HELP,
    )
    dataset_file = forms.FileField(
        required=False,
        label="Or upload it",
        help_text="A .csv or .jsonl file in the same format; it replaces the text above.",
    )
    layers = forms.CharField(
        max_length=LIST_FIELD_MAX_CHARS,
        help_text="Comma-separated layer indices (the output of decoder block k); one probe "
        "is fitted per layer.",
    )
    pooling = forms.ChoiceField(
        choices=Pooling.choices,
        initial=Pooling.MEAN,
        help_text="What represents a text at a layer: its last token's residual stream, or "
        "the mean over its positions after the first (position 0, an attention sink whose "
        "norm dwarfs the others', is left out).",
    )
    seed = forms.IntegerField(
        min_value=0,
        max_value=2**32 - 1,
        initial=0,
        help_text="Seeds the held-out split, the shuffled-label control and the bootstrap.",
    )
    test_fraction = forms.FloatField(
        min_value=0.1,
        max_value=0.5,
        initial=0.25,
        label="Held-out fraction",
        help_text="The share of rows held out (stratified by label) to measure each probe on.",
    )
    regularisation_c = forms.FloatField(
        min_value=1e-6,
        max_value=MAX_C,
        initial=1.0,
        label="Regularisation C",
        help_text="scikit-learn's LogisticRegression C, the inverse of the L2 penalty's "
        "strength, on standardised features (smaller: a simpler probe).",
    )
    # The cost the page stated (`ProbeForm.cost`): a submission whose cost differs (the
    # dataset changed since, or the cost was never counted) is shown its cost first.
    confirmed_tokens = forms.IntegerField(required=False, widget=forms.HiddenInput)

    def __init__(self, *args, capabilities: ModelCapabilities, **kwargs):
        super().__init__(*args, **kwargs)
        self.capabilities = capabilities
        if capabilities.n_layers:
            self.fields[
                "layers"
            ].help_text += f" This model has layers 0–{capabilities.n_layers - 1}."
        self.fields["regularisation_c"].help_text += (
            f" Intervals: 95% percentile bootstrap over the held-out rows, "
            f"{BOOTSTRAP_RESAMPLES:,} resamples drawn with the seed."
        )
        self._uploaded_text()

    def _uploaded_text(self) -> None:
        """An uploaded file takes the pasted text's place, so that the form shown again (with
        an error, or its cost) holds the dataset without another upload."""
        self._upload_error = ""
        upload = self.files.get(self.add_prefix("dataset_file")) if self.is_bound else None
        if upload is None:
            return
        if upload.size > MAX_DATASET_BYTES:
            self._upload_error = f"The file is larger than {MAX_DATASET_BYTES // 2**20} MiB."
            return
        try:
            text = upload.read().decode("utf-8")
        except UnicodeDecodeError:
            self._upload_error = "The file is not UTF-8 text."
            return
        self.data = self.data.copy()
        self.data[self.add_prefix("dataset")] = text

    def clean(self):
        data = super().clean()
        if error := self._upload_error:
            self.add_error("dataset_file", error)
            return data
        if reason := self.capabilities.activations_reason:
            raise forms.ValidationError(reason)
        layers = self._layers(data.get("layers"))
        if "dataset" in self.errors or data.get("test_fraction") is None:
            return data
        try:
            dataset = parse_dataset(data.get("dataset") or "")
            check_split(dataset, test_fraction=data["test_fraction"])
        except DatasetError as error:
            self.add_error("dataset", str(error))
            return data
        try:
            counts = async_to_sync(_token_counts)(self.capabilities.id, dataset.texts)
        except ApiError as error:
            raise forms.ValidationError(
                f"The texts could not be tokenized ({error.code}: {error.message})."
            ) from None
        if data.get("pooling") == Pooling.MEAN:
            short = next((row for row, count in enumerate(counts) if count < 2), None)
            if short is not None:
                self.add_error(
                    "dataset",
                    f"Row {short + 1} (“{dataset.texts[short]}”) is one token: its mean after "
                    "the first position is empty. Use the last token, or a longer text.",
                )
                return data
        data["dataset_parsed"] = dataset
        data["token_counts"] = counts
        if layers is None:
            return data
        data["layer_list"] = layers
        size = harvest_bytes(
            counts, layers=len(layers), hidden_size=self.capabilities.hidden_size or 0
        )
        if size > MAX_HARVEST_BYTES:
            self.add_error(
                "layers",
                f"{len(layers)} layers over the dataset's {sum(counts):,} tokens is "
                f"{size / 2**20:,.0f} MiB of activations; at most {MAX_HARVEST_BYTES // 2**20} "
                "MiB. Choose fewer layers, or fewer or shorter texts.",
            )
        return data

    def _layers(self, text: str | None) -> list[int] | None:
        if not text:
            return None
        try:
            layers = layer_list(text, self.capabilities)
        except forms.ValidationError as error:
            self.add_error("layers", error)
            return None
        return sorted(layers)

    @property
    def cost(self) -> dict | None:
        """What the harvest bills, once the dataset is valid: every prompt token and one
        generated token per text (a capture generates one), one activation request per text
        and one harvest job."""
        counts = self.cleaned_data.get("token_counts") if hasattr(self, "cleaned_data") else None
        if counts is None:
            return None
        return {
            "rows": len(counts),
            "prompt_tokens": sum(counts),
            "generated_tokens": len(counts),
            "tokens": sum(counts) + len(counts),
            "activation_requests": len(counts),
        }

    @property
    def cost_confirmed(self) -> bool:
        cost = self.cost
        return cost is not None and self.cleaned_data.get("confirmed_tokens") == cost["tokens"]


async def _token_counts(model_id: str, texts: list[str]) -> list[int]:
    model = await model_get(model_id)
    return await count_prompt_tokens(model, texts, add_special_tokens=True)
