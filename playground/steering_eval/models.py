"""A steering evaluation: its definition (the dataset as tokenized, the vector, the scales,
where it steers) and whether it was cancelled. Its requests are `Run`s of kind
`RunKind.STEERING_EVAL` whose `group` is the evaluation's id; their status is its progress."""

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class SteerAt(models.TextChoices):
    ALL = "all", "Every position (prompt and completion)"
    LAST = "last", "The prompt's last position only"


class SteeringEvaluation(models.Model):
    """`rows`: per dataset row its prompt, target and foil as entered, with their token ids
    and strings (the gateway's tokenizer). `vector_*` keep the library vector's name and
    layer should it be deleted (the runs' requests carry its values). `cost`: what the form
    stated before it was submitted (requests, prompt and generated tokens, activation
    requests)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="steering_evaluations"
    )
    model = models.CharField(max_length=64)
    vector = models.ForeignKey(
        "playground.SteeringVector", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )  # fmt: skip
    vector_name = models.CharField(max_length=100)
    vector_layer = models.PositiveSmallIntegerField()
    scales = models.JSONField()
    steer_at = models.CharField(max_length=8, choices=SteerAt.choices, default=SteerAt.ALL)
    repeats = models.PositiveSmallIntegerField()
    rows = models.JSONField()
    cost = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["user", "-created_at"])]

    def __str__(self):
        return f"steering evaluation {self.id} ({len(self.rows)} prompts)"
