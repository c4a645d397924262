"""A linear-probe experiment: one harvest job sent through /v1 with the user's playground key,
then one logistic-regression probe per layer fitted by a worker."""

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from infra.lifecycle import ENDED, WorkRow


class Pooling(models.TextChoices):
    LAST = "last", "Last token"
    MEAN = "mean", "Mean over positions after the first"


class Probe(WorkRow):
    """A work row (`infra.lifecycle.WorkRow`): status moves queued → running (the harvest
    submitted, followed, then the fit) → succeeded | failed | cancelled. `dataset` holds the
    texts and labels as given (`classes`: the two labels in sorted order, the second the
    positive class); `results` the numbers per layer (see `fitting.layer_results`) and
    `weights` each layer's fitted probe (kept apart: the page never needs them, saving a vector
    does). Every write of the worker is fenced by its claim (`infra.lifecycle.Attempt`), so a
    cancel wins over a late write."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="probes"
    )
    model = models.CharField(max_length=64)
    dataset = models.JSONField()
    # len(dataset["texts"]), kept apart so that the page, which reads it while the probe runs,
    # need not load the dataset.
    n_rows = models.PositiveIntegerField()
    dataset_sha256 = models.CharField(max_length=64)
    classes = models.JSONField()
    layers = models.JSONField()
    pooling = models.CharField(max_length=8, choices=Pooling.choices)
    seed = models.PositiveIntegerField()
    test_fraction = models.FloatField()
    regularisation_c = models.FloatField()
    # The tokens the harvest bills, stated before submitting: every prompt token plus the one
    # token each capture generates.
    token_cost = models.PositiveIntegerField()
    harvest_job_id = models.UUIDField(null=True, blank=True)
    prompts_done = models.PositiveIntegerField(default=0)
    # "harvest" while the harvest runs, then "fit" (the layers fitted so far in `results`).
    stage = models.CharField(max_length=10, blank=True)
    results = models.JSONField(null=True, blank=True)
    weights = models.JSONField(null=True, blank=True)
    submit_token = models.UUIDField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["user", "-created_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "submit_token"],
                condition=Q(submit_token__isnull=False),
                name="one_probe_per_form_submission",
            )
        ]

    def __str__(self):
        return f"probe {self.id} ({self.status})"

    @property
    def is_ended(self) -> bool:
        return self.status in ENDED

    @property
    def positive_class(self) -> str:
        return self.classes[1]
