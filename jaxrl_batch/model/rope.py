"""Rotary position embedding (half-split convention, as Llama and Qwen) and its context-extension scalings."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How RoPE frequencies are stretched past the pretraining context (Hugging Face `rope_scaling`).

  Attributes:
    rope_type: "linear" (every frequency divided by `factor`) or "llama3" (Llama 3.1+: long wavelengths divided
      by `factor`, short ones kept, a smooth blend between).
    factor: context extension factor (> 0).
    low_freq_factor: llama3: wavelengths (tokens) above original_max_position_embeddings / low_freq_factor scale.
    high_freq_factor: llama3: wavelengths (tokens) below original_max_position_embeddings / high_freq_factor stay.
    original_max_position_embeddings: llama3: pretraining context length in tokens.
  """

  rope_type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"model.rope_scaling.rope_type={self.rope_type!r} is not supported; use one of {ROPE_TYPES} "
                       "or rope_scaling=None for plain RoPE.")
    if self.factor <= 0:
      raise ValueError(f"model.rope_scaling.factor must be positive, got {self.factor}.")
    if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(f"model.rope_scaling: llama3 needs 0 < low_freq_factor ({self.low_freq_factor}) < "
                       f"high_freq_factor ({self.high_freq_factor}).")


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
  """(H/2,) float32 angle per position of each rotated pair i: theta^(-2i/H), then scaled."""
  inv_freq_F = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is not None and scaling.rope_type == "linear":
    inv_freq_F = inv_freq_F / scaling.factor
  elif scaling is not None:  # llama3
    context = scaling.original_max_position_embeddings
    wavelength_F = 2 * math.pi / inv_freq_F
    smooth_F = (context / wavelength_F - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended_F = (1 - smooth_F) * inv_freq_F / scaling.factor + smooth_F * inv_freq_F
    inv_freq_F = np.where(wavelength_F > context / scaling.low_freq_factor, inv_freq_F / scaling.factor,
                          np.where(wavelength_F < context / scaling.high_freq_factor, inv_freq_F, blended_F))
  return inv_freq_F.astype(np.float32)


def apply_rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, theta: float,
               scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary embedding: pairs (i, i + H/2) rotate by position * inverse_frequencies(H, theta, scaling)[i]."""
  h = x_BxTxNxH.shape[-1]
  angle_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inverse_frequencies(h, theta, scaling)
  sin, cos = jnp.sin(angle_BxTxF)[:, :, None, :], jnp.cos(angle_BxTxF)[:, :, None, :]
  x = x_BxTxNxH.astype(jnp.float32)
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxH.dtype)
