"""Decoder hyperparameters: one frozen value, built from `config.model`."""
import dataclasses

import jax.numpy as jnp

from jaxrl_batch.model.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama/Qwen-style decoder.

  Attributes:
    vocab_size: rows of the embedding table; must cover every tokenizer id.
    d_model: residual stream width D.
    num_layers: decoder blocks L.
    num_heads: query heads N.
    num_kv_heads: key/value heads K (grouped-query attention; N % K == 0).
    head_dim: width H of one head.
    d_ff: SwiGLU hidden width F.
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: reuse the embedding table as the output head.
    dtype: activation dtype ("float32" or "bfloat16"); softmax and logits stay float32.
    param_dtype: parameter dtype.
    qkv_bias: add a learned bias to the query, key and value projections (Qwen2).
    qk_norm: RMSNorm over head_dim on each query and key head before RoPE (Qwen3).
    rope_scaling: RoPE context extension (Llama 3.1+ "llama3", or "linear"); None for plain RoPE.
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"
  qkv_bias: bool = False
  qk_norm: bool = False
  rope_scaling: RopeScaling | None = None

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads} "
          "(grouped-query attention shares each KV head among num_heads // num_kv_heads query heads).")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        raise ValueError(f"model.{name} must be 'float32' or 'bfloat16', got {getattr(self, name)!r}.")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)

  @classmethod
  def from_config(cls, cfg) -> "ModelConfig":
    """Builds from a ConfigDict/dict (`rope_scaling` may be a nested dict); unknown keys are an error."""
    fields = {f.name for f in dataclasses.fields(cls)}
    given = dict(cfg)
    unknown = sorted(set(given) - fields)
    if unknown:
      raise ValueError(f"Unknown model config keys {unknown}; valid keys are {sorted(fields)}.")
    if given.get("rope_scaling") is not None and not isinstance(given["rope_scaling"], RopeScaling):
      given["rope_scaling"] = RopeScaling(**dict(given["rope_scaling"]))
    return cls(**given)

  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    attn = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    attn += self.qkv_bias * self.head_dim * (self.num_heads + 2 * self.num_kv_heads) + self.qk_norm * 2 * self.head_dim
    mlp = 3 * self.d_model * self.d_ff
    per_layer = attn + mlp + 2 * self.d_model
    head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
    return self.vocab_size * self.d_model + self.num_layers * per_layer + self.d_model + head
