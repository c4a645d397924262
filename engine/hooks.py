"""Per-layer hooks on the residual stream: steering additions and residual-stream capture.

Hooks are made for one forward pass at a time and only for the layers some row needs, so a
batch without steering or capture runs the plain model.
"""

from dataclasses import dataclass

import torch

from engine.decoder import LayerHook
from engine.preparation import SteeringAddition


@dataclass
class RowHooks:
    """What one batch row needs: its steering additions per layer, its capture store (layer ->
    list of [tokens, hidden] tensors, or None), the absolute positions of its input tokens, and
    `offset`, the number of padding positions before them in the batch's time dimension (left
    padding of a batched prefill; 0 in a decode step). Padding is never steered or captured."""

    steering: dict[int, list[SteeringAddition]]
    capture: dict[int, list[torch.Tensor]] | None
    positions: list[int]
    offset: int = 0

    def layers(self) -> set[int]:
        return set(self.steering) | set(self.capture or ())


def layer_hooks(rows: list[RowHooks]) -> dict[int, LayerHook]:
    """The hooks (see `LlamaDecoder.forward`) that steer and capture the residual stream after
    each layer as `rows` (one per batch row) say."""
    needed = set().union(*(row.layers() for row in rows)) if rows else set()
    return {layer: _layer_hook(layer, rows) for layer in needed}


def _layer_hook(layer: int, rows: list[RowHooks]) -> LayerHook:
    def hook(hidden: torch.Tensor) -> None:
        for row_index, row in enumerate(rows):
            # A view of the row's real tokens: steering in place writes through to `hidden`.
            tokens = hidden[row_index, row.offset :]
            for addition in row.steering.get(layer, ()):
                add_steering(tokens, addition, row.positions)
            # Captured after steering: a capture records the steered state.
            if row.capture is not None and layer in row.capture:
                row.capture[layer].append(tokens.clone())

    return hook


def add_steering(hidden: torch.Tensor, addition: SteeringAddition, positions: list[int]) -> None:
    """Add `addition` in place to `hidden` [tokens, size], whose rows sit at `positions`."""
    if addition.positions is None:
        token_rows = torch.arange(hidden.shape[0], device=hidden.device)
        vectors = addition.vector.to(hidden.device).expand(hidden.shape[0], -1)
    else:
        row_of_position = {position: row for row, position in enumerate(positions)}
        pairs = [
            (row_of_position[position], index)
            for index, position in enumerate(addition.positions)
            if position in row_of_position
        ]
        if not pairs:
            return
        token_rows = torch.tensor([row for row, _ in pairs], device=hidden.device)
        if addition.vector.ndim == 1:
            vectors = addition.vector.expand(len(pairs), -1)
        else:
            vectors = addition.vector[torch.tensor([index for _, index in pairs])]
        vectors = vectors.to(hidden.device)
    states = hidden[token_rows].float()
    if addition.norm_match:
        vector_norms = vectors.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        vectors = vectors / vector_norms * states.norm(dim=-1, keepdim=True)
    hidden[token_rows] = (states + addition.scale * vectors).to(hidden.dtype)
