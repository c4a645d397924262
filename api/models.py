"""The model registry: which models the gateway serves and where their upstreams are."""

from django.core.exceptions import ValidationError
from django.db import models

MAX_LOGPROBS = 100
SIZE_FIELDS = ("max_model_len", "n_layers", "hidden_size", "vocab_size")
SIZE_HELP = (
    "Leave blank: filled from the upstream's GET /v1/models, else from config.json in "
    "weights_dir. A value given here is kept (e.g. a shorter context than the upstream's)."
)


def _validate_url_list(value):
    if not isinstance(value, list) or not all(
        isinstance(url, str) and url.startswith(("http://", "https://")) for url in value
    ):
        raise ValidationError('Give a JSON list of http(s) base URLs, e.g. ["http://host:8001"].')


class ModelStatus(models.TextChoices):
    LIVE = "live", "Live"
    DISABLED = "disabled", "Disabled"


class LanguageModel(models.Model):
    """One model id clients send as `model`. Requests go round-robin over `upstream_urls`;
    capture and steering requests over `activation_upstream_urls` when that list is set."""

    name = models.CharField(
        max_length=64, unique=True, help_text="The short id clients send as model."
    )
    served_model_name = models.CharField(
        max_length=200,
        blank=True,
        help_text="The model name the upstream expects, when it differs from the id.",
    )
    upstream_urls = models.JSONField(default=list, validators=[_validate_url_list])
    activation_upstream_urls = models.JSONField(
        default=list, blank=True, validators=[_validate_url_list]
    )
    # The model's sizes: left blank, they are filled from the model itself
    # (`services.language_model_sizes_fill`), never copied by hand from somewhere else.
    max_model_len = models.PositiveIntegerField(null=True, blank=True, help_text=SIZE_HELP)
    n_layers = models.PositiveIntegerField(null=True, blank=True, help_text=SIZE_HELP)
    hidden_size = models.PositiveIntegerField(null=True, blank=True, help_text=SIZE_HELP)
    vocab_size = models.PositiveIntegerField(null=True, blank=True, help_text=SIZE_HELP)
    supports_activations = models.BooleanField(default=False)
    max_logprobs = models.PositiveIntegerField(default=MAX_LOGPROBS)
    status = models.CharField(max_length=16, choices=ModelStatus.choices, default=ModelStatus.LIVE)
    is_default = models.BooleanField(default=False)
    # Plain vLLM serves no tokenizer.json: without one here, the gateway would ask the upstream
    # to count every prompt (POST /tokenize), a round trip per prompt on every request.
    tokenizer_json = models.TextField(
        blank=True,
        help_text="The model's HF tokenizer.json. When set, the gateway counts prompt tokens "
        "with it instead of asking the upstream.",
    )
    tokenizer_sha256 = models.CharField(max_length=64, blank=True, editable=False)
    # The playground's logit lens needs the model's final norm and unembedding: it reads them
    # from the model's own files (playground/lens/tables.py) on the web and worker machines.
    weights_dir = models.CharField(
        max_length=500,
        blank=True,
        help_text="The model's directory on the web and worker machines (config.json, "
        "model.safetensors, tokenizer.json: what vLLM serves it from). When set, the "
        "playground shows the logit lens and direct logit attribution of capture runs.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["is_default"],
                condition=models.Q(is_default=True),
                name="one_default_language_model",
            )
        ]

    def __str__(self):
        return self.name

    @property
    def upstream_model_name(self) -> str:
        return self.served_model_name or self.name

    @property
    def sizes_missing(self) -> list[str]:
        """The size fields still blank (the registry fills them before it serves the model)."""
        return [name for name in SIZE_FIELDS if getattr(self, name) is None]

    def urls_for(self, *, activation: bool) -> list[str]:
        """The upstream base URLs for a request (with capture or steering if `activation`)."""
        if activation and self.activation_upstream_urls:
            return list(self.activation_upstream_urls)
        return list(self.upstream_urls)
