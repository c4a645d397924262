"""A harvest job's files: one safetensors shard per batch, the stats, the manifest."""

import numpy as np
from django.conf import settings

from acs_client.downloads import capture_metadata, file_metadata
from api.errors import ApiError

from ..capture import Capture
from ..models import HarvestJob
from ..storage import (
    MANIFEST_NAME,
    STATS_NAME,
    Tensor,
    harvest_bytes_estimate,
    harvest_file_write,
    harvest_shard_captures,
    manifest_bytes,
    safetensors_bytes,
)
from .statistics import ActivationStats


def batch_request_id(job: HarvestJob, first_index: int) -> str:
    """The request id of the batch starting at prompt `first_index`: its usage record's, and
    its shard's."""
    return f"harvest-{job.pk.hex[:12]}-{first_index}"


class HarvestOutput:
    """A job's files as its batches arrive: one shard per batch, the running stats, and the
    bytes written, kept under ACS_HARVEST_MAX_JOB_BYTES. It starts from the shards an
    earlier attempt recorded (`HarvestJob.shards`), reading them back for the stats.

    Attempt `attempt` (the claim's count, `infra.lifecycle.Attempt`) names its shards
    `shard_00003.safetensors` on the first attempt and `shard_00003-attempt2.safetensors`
    on the second: a worker whose attempt went stale (another claimed the job) may still
    write a shard before it finds out, and then writes a file of its own, which no attempt
    records, rather than replacing one that a later attempt recorded."""

    def __init__(self, job: HarvestJob, *, hidden_size: int, attempt: int = 1):
        self.job = job
        self.attempt = attempt
        self.hidden_size = hidden_size
        self.stats = ActivationStats(n_layers=len(job.layers), hidden_size=hidden_size)
        self.shards: list[dict] = list(job.shards)
        self.bytes_written = sum(shard["bytes"] for shard in self.shards)
        self.prompts_written = sum(shard["prompts"] for shard in self.shards)
        for shard in self.shards:
            for bits in harvest_shard_captures(job.storage_prefix, shard["name"]):
                self.stats.add(bits)

    def overflow(self, token_lists: list[list[int]], *, first_index: int) -> ApiError | None:
        """The 413 request_too_large if the batch's captures would take the job's files past
        the cap (asked before they are paid for), else None."""
        limit = settings.ACS_HARVEST_MAX_JOB_BYTES
        needed = harvest_bytes_estimate(
            prompt_tokens=sum(len(tokens) for tokens in token_lists),
            n_layers=len(self.job.layers),
            hidden_size=self.hidden_size,
        )
        if self.bytes_written + needed <= limit:
            return None
        return harvest_too_large(
            f"The captures from prompt {first_index} on take this job's files past "
            f"{limit} bytes, the most one harvest job may write"
        )

    def add_shard(
        self,
        captures: list[Capture],
        *,
        first_index: int,
        token_strings: list[list[str] | None],
    ) -> None:
        """Write one batch's shard (`shard_write`) and count it as written (`shard_keep`)."""
        shard = self.shard_write(captures, first_index=first_index, token_strings=token_strings)
        self.shard_keep(shard, captures)

    def shard_write(
        self,
        captures: list[Capture],
        *,
        first_index: int,
        token_strings: list[list[str] | None],
    ) -> dict:
        """Write one batch's shard file, as the next shard: per prompt i its activations
        (`prompt_i`) and token ids (`tokens_i`), with the metadata `acs_client.downloads`
        reads (token strings, layers, model, request id). Returns its entry of
        `HarvestJob.shards`; it counts once given to `shard_keep` (when it was recorded)."""
        tensors, described = {}, []
        request_id = batch_request_id(self.job, first_index)
        for index, (capture, strings) in enumerate(
            zip(captures, token_strings, strict=True), start=first_index
        ):
            tensors[f"prompt_{index}"] = Tensor.bfloat16(capture.bits)
            tensors[f"tokens_{index}"] = Tensor.from_array(
                np.asarray(capture.tokens, dtype=np.int32)
            )
            # A capture generates one token and covers the prompt's positions only.
            described.append(
                capture_metadata(
                    index=index,
                    token_strings=strings,
                    prompt_length=len(capture.tokens),
                    request_id=request_id,
                )
            )
        suffix = "" if self.attempt == 1 else f"-attempt{self.attempt}"
        name = f"shard_{len(self.shards):05d}{suffix}.safetensors"
        metadata = file_metadata(
            kind="harvest_shard",
            model=self.job.model,
            layers=self.job.layers,
            captures=described,
            job_id=str(self.job.pk),
            hidden_size=self.hidden_size,
            add_special_tokens=self.job.add_special_tokens,
        )
        content = safetensors_bytes(tensors, metadata)
        harvest_file_write(self.job.storage_prefix, name, content)
        return {
            "name": name,
            "tensors": list(tensors),
            "prompts": len(captures),
            "bytes": len(content),
        }

    def shard_keep(self, shard: dict, captures: list[Capture]) -> None:
        """Count the shard `shard_write` wrote for `captures` as one of the job's."""
        for capture in captures:
            self.stats.add(capture.bits)
        self.shards.append(shard)
        self.bytes_written += shard["bytes"]
        self.prompts_written += shard["prompts"]

    def finish(self) -> list[str]:
        """Write the stats and the manifest of the shards written; the files' names, the
        manifest last."""
        harvest_file_write(self.job.storage_prefix, STATS_NAME, self.stats.safetensors())
        manifest = {
            "job_id": str(self.job.pk),
            "model": self.job.model,
            "layers": self.job.layers,
            "hidden_size": self.hidden_size,
            "dtype": "bfloat16",
            "n_prompts": self.job.n_prompts,
            "prompts_captured": self.prompts_written,
            "add_special_tokens": self.job.add_special_tokens,
            "shards": [{"name": s["name"], "tensors": s["tensors"]} for s in self.shards],
            "stats": {"name": STATS_NAME, "tensors": list(ActivationStats.TENSORS)},
        }
        harvest_file_write(self.job.storage_prefix, MANIFEST_NAME, manifest_bytes(manifest))
        return [*(shard["name"] for shard in self.shards), STATS_NAME, MANIFEST_NAME]


def harvest_too_large(reason: str) -> ApiError:
    """The 413 for a harvest whose files would pass ACS_HARVEST_MAX_JOB_BYTES."""
    return ApiError(
        "request_too_large",
        f"{reason}; send fewer or shorter prompts, or capture fewer layers.",
    )
