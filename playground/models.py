"""Playground runs (one real /v1 request each) and the user's steering-vector library."""

import uuid
from functools import cached_property

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone
from pydantic import Field

from acs_client.protocol import CompletionFields, SteeringFields
from infra.lifecycle import WorkRow

# Django registers the models of the features' own modules by these imports.
from .patchscopes.models import Patchscope  # noqa: F401
from .probes.models import Probe  # noqa: F401
from .steering_eval.models import SteeringEvaluation  # noqa: F401


class RunKind(models.TextChoices):
    COMPLETION = "completion", "Completion"
    CONTRAST = "contrast", "Contrast capture"
    STEERING_BASELINE = "steering_baseline", "Steering baseline"
    STEERING_STEERED = "steering_steered", "Steered"
    SWEEP = "sweep", "Scale sweep"
    PATCHING_CAPTURE = "patching_capture", "Patching capture"
    PATCHED = "patched", "Patched run"
    STEERING_EVAL = "steering_eval", "Steering evaluation"
    PATCHSCOPE_CAPTURE = "patchscope_capture", "Patchscope capture"
    PATCHSCOPE = "patchscope", "Patchscope generation"


class StoredRequest(CompletionFields):
    """A run's request as stored (`Run.body`): the wire model, less two limits the gateway
    set after the first runs were stored (a temperature at most 2, a seed within 64 bits), so
    that such a run, served then or refused by the gateway, still shows."""

    temperature: float = Field(default=1.0, ge=0.0)
    seed: int | None = None

    @property
    def steering(self) -> SteeringFields | None:
        """The run's steering: the request's one steering entry (the playground sends at most
        one), or None for an unsteered run."""
        return self.apply_steering_vectors[0] if self.apply_steering_vectors else None

    def steering_body(self) -> list[dict] | None:
        """The steering entries as a body sends them (`apply_steering_vectors`: what another
        request needs to be steered the same), or None for an unsteered run."""
        if not self.apply_steering_vectors:
            return None
        return [entry.model_dump(exclude_unset=True) for entry in self.apply_steering_vectors]


def sent_scale(request: dict) -> float | None:
    """The steering scale a run sending `request` applies (its steering entry's), None when
    unsteered: what `Run.scale` holds."""
    steering = StoredRequest.model_validate(request).steering
    return steering.scale if steering else None


class Run(WorkRow):
    """One request sent to /v1/completions with the user's playground key.

    `request` is the body exactly as sent. Runs of one steering comparison, sweep or contrast
    pair share a `group`. The run's steering is its request's steering entry (`body.steering`)
    and nothing else: `scale` is that entry's scale (None when unsteered), set from the
    request (`sent_scale`) so that a group's runs can be ordered and filtered by it, and
    `vector` names the library vector it came from (provenance only).
    Status moves queued → running → succeeded | failed (or cancelled, with its patching
    grid, before it was sent); a worker claims a run with a conditional update, so only one
    worker ever runs it. A group's runs go to the workers a
    few at a time (`sent_at`), so that a big grid or sweep shares them with everyone else.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="playground_runs"
    )
    kind = models.CharField(max_length=20, choices=RunKind.choices, default=RunKind.COMPLETION)
    group = models.UUIDField(null=True, blank=True, db_index=True)
    scale = models.FloatField(null=True, blank=True)
    # What the page needs besides the request: contrast role, the vector's name (shown once
    # the vector is deleted), a sweep's target, the scale as entered.
    meta = models.JSONField(default=dict, blank=True)
    # The steering vector used or being built (contrast runs); kept for the run's page.
    vector = models.ForeignKey(
        "SteeringVector", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    request = models.JSONField()
    response = models.JSONField(null=True, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    # When its task went to the workers: at once for a run of its own, in turn for the runs
    # of a group (`runs.services.group_runs_dispatch`). None while it waits for its turn.
    sent_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    gateway_ms = models.FloatField(null=True, blank=True)
    upstream_ms = models.FloatField(null=True, blank=True)
    # Time to first token as the worker, a client of /v1, saw it (streamed runs).
    api_ttft_ms = models.FloatField(null=True, blank=True)
    usage = models.JSONField(null=True, blank=True)
    # The prompts' and choices' token ids and strings (`run_tokens`), set when the run
    # succeeds: the labels of every position, whatever the request asked for.
    tokens = models.JSONField(null=True, blank=True)
    # A capture run's logit lens (`run_lens`), set when the run succeeds: the top tokens and
    # log-normaliser at each captured layer × position, or why there is none.
    lens = models.JSONField(null=True, blank=True)
    # The one-time token of the form submission that created this run (the first run of a
    # group): the same token submitted again returns this run instead of creating more.
    submit_token = models.UUIDField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["user", "-created_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "submit_token"],
                condition=Q(submit_token__isnull=False),
                name="one_run_per_form_submission",
            )
        ]

    def __str__(self):
        return f"run {self.id} ({self.kind}, {self.status})"

    @cached_property
    def body(self) -> StoredRequest:
        """`request` read through the wire model: read a run's request here, never from the
        stored dict (`request` stays the body exactly as sent, for sending it again)."""
        return StoredRequest.model_validate(self.request)

    @property
    def prompt_preview(self) -> str:
        """The prompt(s) as text, several joined by " | ". Runs that send token ids (a
        patching grid's) keep the text they were made from in `meta["prompt_text"]`."""
        if "prompt_text" in self.meta:
            return self.meta["prompt_text"]
        prompt = self.body.prompt
        return " | ".join(map(str, prompt)) if isinstance(prompt, list) else prompt

    @property
    def scale_entered(self) -> float | None:
        """The steering scale as the user entered it: a multiple of the layer's typical
        norm when `meta["scale_unit"]` is "typical", else the absolute `scale`."""
        if self.meta.get("scale_unit") == "typical":
            return self.meta["scale_entered"]
        return self.scale

    @property
    def scale_label(self) -> str:
        """The scale as entered, at the precision it was entered, with its unit."""
        if self.scale is None:
            return ""
        if self.meta.get("scale_unit") == "typical":
            return f"{self.scale_entered:g} × typical norm"
        return f"{self.scale:g}"

    @property
    def queue_ms(self):
        if self.started_at is None:
            return None
        return (self.started_at - self.created_at).total_seconds() * 1000

    @property
    def first_token_ms(self):
        if self.first_token_at is None or self.started_at is None:
            return None
        return (self.first_token_at - self.started_at).total_seconds() * 1000

    @property
    def total_ms(self):
        if self.finished_at is None:
            return None
        return (self.finished_at - self.created_at).total_seconds() * 1000


class SteeringScore(WorkRow):
    """The same-token comparison of a steering comparison or sweep (`group`): once its runs
    have finished, a worker sends teacher-forced requests through /v1 with the user's
    playground key (metered and budget-checked like runs; see `scoring`) and keeps, per
    steered run, the logprobs of the baseline's tokens and of the steered run's tokens under
    both models, and the KL divergence where the full distribution was affordable.
    Status moves queued → running → succeeded | failed."""

    group = models.UUIDField(unique=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="steering_scores"
    )
    results = models.JSONField(null=True, blank=True)

    def __str__(self):
        return f"steering score {self.group} ({self.status})"


class VectorMethod(models.TextChoices):
    CONTRAST_LAST = "contrast_last", "Contrast prompts, last-token difference"
    CONTRAST_MEAN = "contrast_mean", "Contrast prompts, mean difference"
    UPLOAD = "upload", "Uploaded .npy"
    CAPTURE_MEAN = "capture_mean", "Mean of a capture"
    LINEAR_PROBE = "linear_probe", "Linear probe direction"


class SteeringVector(models.Model):
    """A vector of the user's library: one row of `hidden_size` values for block `layer`,
    stored in the API's tensor codec (`acs_client.codec`) so it is sent as is."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="steering_vectors"
    )
    name = models.CharField(max_length=100)
    model = models.CharField(max_length=64)
    layer = models.PositiveSmallIntegerField()
    method = models.CharField(max_length=16, choices=VectorMethod.choices)
    details = models.JSONField(default=dict, blank=True)
    hidden_size = models.PositiveIntegerField()
    norm = models.FloatField()
    # Mean residual norm at `layer` seen when the vector was built (contrast only); lets a
    # scale be given as a multiple of the layer's typical norm.
    layer_typical_norm = models.FloatField(null=True, blank=True)
    data = models.JSONField()
    # The contrast run pair that built it: at most one vector per pair.
    source_group = models.UUIDField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["source_group"],
                condition=Q(source_group__isnull=False),
                name="one_vector_per_contrast_group",
            )
        ]

    def __str__(self):
        return f"{self.name} (layer {self.layer})"


class RunComparison(WorkRow):
    """Two runs of one user scored on the same tokens (see `compare`): once asked for on the
    comparison page, a worker sends teacher-forced requests through /v1 with the user's
    playground key (metered like runs), each run's tokens under `run_a`'s request settings
    and under `run_b`'s, and keeps the token ids sent and the raw answers in `results`.
    Status moves queued → running → succeeded | failed."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="run_comparisons"
    )
    run_a = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+")
    run_b = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+")
    results = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run_a", "run_b"], name="one_comparison_per_run_pair")
        ]

    def __str__(self):
        return f"comparison {self.run_a_id} vs {self.run_b_id} ({self.status})"
