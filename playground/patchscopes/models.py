"""A Patchscope: what the model "says" about a hidden state of one of the user's capture runs.

The source run's residual stream at one position, at each of the chosen source layers, is
injected into an inspection prompt at one position and a target layer, and the inspection
prompt is continued greedily (see `services`). Its requests are `playground.Run`s of its
group (`Patchscope.id`): one capture of the inspection prompt, then one generation per
source layer."""

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class Patchscope(models.Model):
    """What the form asked for, with the source states copied from the source run (so the
    generations can be built however long after, whatever happens to that run). The status
    is its runs' (`selectors.PatchscopeView`); `cancelled` and `build_error` are what the
    runs cannot say."""

    # Also the `group` of its runs.
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="patchscopes"
    )
    source_run = models.ForeignKey(
        "playground.Run", null=True, on_delete=models.SET_NULL, related_name="+"
    )
    model = models.CharField(max_length=64)
    source_position = models.PositiveIntegerField()
    # The source position's token as the source run's tokens name it ("" when unknown).
    source_token = models.CharField(max_length=200, blank=True)
    source_layers = models.JSONField()
    # The residual stream of the source run at `source_position`, one row per source layer,
    # in the API's tensor codec (bfloat16, as the API gave it).
    source_states = models.JSONField()
    inspection_prompt = models.TextField()
    inspection_ids = models.JSONField()
    inspection_strings = models.JSONField(null=True)
    inspection_position = models.PositiveIntegerField()
    # None: each source layer is injected at the same layer; else at this one layer.
    target_layer = models.PositiveSmallIntegerField(null=True, blank=True)
    max_tokens = models.PositiveSmallIntegerField()
    cancelled = models.BooleanField(default=False)
    build_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"patchscope {self.id} ({len(self.source_layers)} source layers)"

    def target_layer_of(self, source_layer: int) -> int:
        """The layer the state of `source_layer` is injected at."""
        return source_layer if self.target_layer is None else self.target_layer

    @property
    def target_layers(self) -> list[int]:
        """The layers the inspection prompt's own residual stream is captured at."""
        return sorted({self.target_layer_of(layer) for layer in self.source_layers})
