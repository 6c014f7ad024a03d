"""Decoder hyperparameters: one frozen value, built from `config.model`."""
import dataclasses

import jax.numpy as jnp

from jaxrl_batch.kernels.train_attention import BACKENDS as ATTENTION_BACKENDS
from jaxrl_batch.model.rope import RopeScaling

# model.remat -> what a block's backward pass keeps (`jax.checkpoint` policies); None = no rematerialisation.
REMAT_POLICIES = {"none": None, "block": "nothing_saveable", "dots": "dots_with_no_batch_dims_saveable"}


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
    num_experts: experts E of each mixture-of-experts layer (Qwen3-MoE); 0 for a dense model.
    num_experts_per_tok: experts k each token is routed to.
    moe_d_ff: SwiGLU hidden width of one expert.
    norm_topk_prob: renormalise the k chosen experts' router probabilities to sum 1.
    decoder_sparse_step: layer i is an MoE layer iff (i + 1) % decoder_sparse_step == 0 (and not in mlp_only_layers).
    mlp_only_layers: layers kept dense (a SwiGLU of width d_ff) in an MoE model.
    routing_replay: the trainer reuses the experts the sampler chose for each token (`rl` rollouts record them)
      instead of routing again; it changes no parameter.
    logits_chunk: positions per chunk when a training or scoring forward turns hidden states into per-token
      log-probs and entropies (`model.logprobs`): the float32 logits exist for one chunk at a time, (B, chunk, V)
      instead of (B, T, V), and the backward pass recomputes them per chunk. 0, or sequences no longer than one
      chunk: the whole sequence at once. Changes memory, not values.
    remat: what a training forward keeps of each block for the backward pass: "none" (every activation), "block"
      (only the block's input: the block is recomputed), "dots" (the block's matmul outputs without a batch
      dimension, i.e. the projections; attention scores and elementwise results are recomputed). Changes memory
      and time, not values.
    attention: the attention of a forward without a KV cache (training, scoring) when its callers pass
      `masks.Segments` (`masks.training_layout`): "dense" (B x N x T x T float32 scores per layer), "splash" (TPU
      kernel), "flash_gpu" (Pallas/Triton GPU kernel), or "auto" (dense on CPU, splash on TPU, flash_gpu on GPU; the
      platform of the mesh's devices). See `kernels.train_attention`. Changes memory and time; values up to
      rounding.
    moe_chunk: tokens per grouped expert computation of an MoE layer (`moe.chunked_swiglu`): a device's tokens
      (after gathering its expert group's) go through the experts this many at a time, so that the sorted
      assignments (k rows of D per token) exist for one chunk at a time, and the backward pass recomputes them per
      chunk. 0: all at once. Changes memory, not values.
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
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_d_ff: int = 0
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  routing_replay: bool = False
  logits_chunk: int = 1024
  remat: str = "none"
  attention: str = "auto"
  moe_chunk: int = 16_384

  def __post_init__(self):
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
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
    if self.logits_chunk < 0:
      raise ValueError(f"model.logits_chunk={self.logits_chunk} must be >= 0 (0 = the whole sequence at once).")
    if self.moe_chunk < 0:
      raise ValueError(f"model.moe_chunk={self.moe_chunk} must be >= 0 (0 = all of a device's tokens at once).")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r} must be one of {sorted(REMAT_POLICIES)}.")
    if self.attention not in ("auto",) + ATTENTION_BACKENDS:
      raise ValueError(f"model.attention={self.attention!r} must be 'auto' or one of {ATTENTION_BACKENDS}.")
    if self.num_experts:
      self._check_moe()
    elif self.routing_replay:
      raise ValueError("model.routing_replay needs a mixture-of-experts model (model.num_experts > 0).")

  def _check_moe(self):
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise ValueError(f"model.num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                       f"{self.num_experts}.")
    if self.moe_d_ff <= 0 or self.decoder_sparse_step <= 0:
      raise ValueError(f"model.moe_d_ff={self.moe_d_ff} and model.decoder_sparse_step={self.decoder_sparse_step} "
                       "must be positive in a mixture-of-experts model.")
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
    if bad:
      raise ValueError(f"model.mlp_only_layers={list(self.mlp_only_layers)} names layers {bad} outside "
                       f"0..{self.num_layers - 1}.")

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """Indices of the mixture-of-experts layers (Hugging Face's rule); empty for a dense model."""
    if not self.num_experts:
      return ()
    return tuple(i for i in range(self.num_layers)
                 if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

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

  def num_params(self, active: bool = False) -> int:
    """Parameter count (embedding counted once when tied); `active`: only the k experts a token uses per MoE layer
    (the count a token's FLOPs scale with)."""
    attn = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    attn += self.qkv_bias * self.head_dim * (self.num_heads + 2 * self.num_kv_heads) + self.qk_norm * 2 * self.head_dim
    sparse = len(self.moe_layers)
    experts = self.num_experts_per_tok if active else self.num_experts
    mlp = (self.num_layers - sparse) * 3 * self.d_model * self.d_ff
    mlp += sparse * (experts * 3 * self.d_model * self.moe_d_ff + self.d_model * self.num_experts)
    per_layer = attn + 2 * self.d_model
    head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
    return self.vocab_size * self.d_model + self.num_layers * per_layer + mlp + self.d_model + head
