"""Running per-layer statistics of a harvest's activations (`stats.safetensors`)."""

import numpy as np

from acs_client.codec import bfloat16_bits_to_float32

from ..storage import Tensor, safetensors_bytes


class ActivationStats:
    """Running per-layer statistics over all positions but the first (the first token's
    residual stream is an outlier in most models): mean and std per hidden unit, and the
    mean L2 norm of the activation vectors."""

    TENSORS = ("mean", "std", "norm_mean", "positions")

    def __init__(self, *, n_layers: int, hidden_size: int):
        self.sum = np.zeros((n_layers, hidden_size), dtype=np.float64)
        self.sum_squares = np.zeros((n_layers, hidden_size), dtype=np.float64)
        self.norm_sum = np.zeros(n_layers, dtype=np.float64)
        self.positions = 0

    def add(self, bits: np.ndarray) -> None:
        """Add one capture given as bfloat16 bit patterns [layers, tokens, hidden]."""
        values = bfloat16_bits_to_float32(bits[:, 1:, :]).astype(np.float64)
        self.sum += values.sum(axis=1)
        self.sum_squares += np.square(values).sum(axis=1)
        self.norm_sum += np.linalg.norm(values, axis=2).sum(axis=1)
        self.positions += values.shape[1]

    def safetensors(self) -> bytes:
        count = max(self.positions, 1)
        mean = self.sum / count
        variance = np.maximum(self.sum_squares / count - np.square(mean), 0.0)
        return safetensors_bytes(
            {
                "mean": Tensor.from_array(mean.astype(np.float32)),
                "std": Tensor.from_array(np.sqrt(variance).astype(np.float32)),
                "norm_mean": Tensor.from_array((self.norm_sum / count).astype(np.float32)),
                "positions": Tensor.from_array(np.asarray([self.positions], dtype=np.int64)),
            }
        )
