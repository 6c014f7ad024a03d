"""The decoder-only transformer."""
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.model.config import REMAT_POLICIES, ModelConfig
from jaxrl_batch.model.kv_cache import KVCache
from jaxrl_batch.model.layers import Attention, RMSNorm, SwiGLU, fan_in_normal, sharded_param
from jaxrl_batch.model.linear import linear
from jaxrl_batch.model.lora import LoRAConfig
from jaxrl_batch.model.masks import DecodeSpan
from jaxrl_batch.model.moe import MoE, stacked_experts


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)); the MLP is an `MoE` if `sparse`."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sparse: bool = False, lora: LoRAConfig | None = None):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.weight_dtype, rngs)
    self.attn = Attention(cfg, rngs, lora)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.weight_dtype, rngs)
    self.sparse = sparse
    self.mlp = MoE(cfg, rngs, lora) if sparse else SwiGLU(cfg, rngs, lora)

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache=None, layer=0, cache_index=None, decode_backend=None,
               replay_BxTxK=None):
    """(x_BxTxD, cache, routing): routing is the MoE layer's `moe.Routing`, None in a dense block."""
    h, cache = self.attn(self.attn_norm(x_BxTxD), positions_BxT, mask_BxTxS, cache, layer, cache_index,
                         decode_backend)
    x_BxTxD = x_BxTxD + h
    if self.sparse:
      live_BxT = mask_BxTxS.live_B[:, None] if isinstance(mask_BxTxS, DecodeSpan) else None
      y, routing = self.mlp(self.mlp_norm(x_BxTxD), replay_BxTxK, live_BxT)
    else:
      y, routing = self.mlp(self.mlp_norm(x_BxTxD)), None
    return x_BxTxD + y, cache, routing


class Transformer(nnx.Module):
  """Llama/Qwen-style decoder: embed -> L blocks -> RMSNorm -> (tied) output head.

  One entry point per use: `forward` (hidden states and routing: training and scoring, which apply the head in
  chunks with `logits`), `step` (logits, cache and the experts chosen: the decode engines) and `__call__` (logits
  and cache: a plain language model, as users and the parity tests call it).

  `lora`: low-rank adapters on the projections it targets (`model.lora`; an MoE layer's experts: "experts")."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
    self.cfg = cfg
    dt = cfg.weight_dtype
    self.embedding = sharded_param(rngs, fan_in_normal(cfg.d_model), (cfg.vocab_size, cfg.d_model),
                                   ("vocab", "embed"), dt)
    self.blocks = nnx.List([Block(cfg, rngs, layer in cfg.moe_layers, lora) for layer in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dt, rngs)
    if not cfg.tie_embeddings:
      self.lm_head = sharded_param(rngs, fan_in_normal(cfg.d_model), (cfg.d_model, cfg.vocab_size),
                                   ("embed", "vocab"), dt)

  def forward(self, tokens_BxT, positions_BxT, mask_BxTxS, cache: KVCache | None = None, cache_index=None,
              decode_backend: str | None = None, replay_BxTxLxK=None):
    """Final-normed hidden states (B, T, D) in the compute dtype, the updated cache and the routing of every MoE
    layer: (hidden_BxTxD, cache, routings), routings a tuple of `moe.Routing` over the B*T tokens, one per layer of
    `cfg.moe_layers` (empty for a dense model); args as `__call__`.

    replay_BxTxLxK: optional int experts per token for each of the L MoE layers (routing replay).
    """
    x = jnp.take(self.embedding[...], tokens_BxT, axis=0).astype(self.cfg.compute_dtype)
    policy = REMAT_POLICIES[self.cfg.remat] if cache is None else None
    routings = []
    for layer, block in enumerate(self.blocks):
      replay = None if replay_BxTxLxK is None or not block.sparse else replay_BxTxLxK[:, :, len(routings)]
      if policy is None:
        x, cache, routing = block(x, positions_BxT, mask_BxTxS, cache, layer, cache_index, decode_backend, replay)
      else:
        x, routing = _rematerialised(block, x, positions_BxT, mask_BxTxS, replay, policy)
      if routing is not None:
        routings.append(routing)
    return self.final_norm(x), cache, tuple(routings)

  def __call__(self, tokens_BxT, positions_BxT, mask_BxTxS, cache: KVCache | None = None, cache_index=None,
               decode_backend: str | None = None):
    """Logits for every position.

    Args:
      tokens_BxT: int token ids.
      positions_BxT: RoPE positions (see `masks.positions_from_valid`).
      mask_BxTxS: bool, query t may attend key s (`masks.causal_mask` without a cache, `masks.cache_mask` with);
        for a decode step (`decode_backend` set) the `masks.DecodeSpan` of the cache slots attended.
      cache: optional KV cache; the new keys/values are written at slots cache_index..cache_index+T-1.
      cache_index: int scalar, first cache slot written; or for a one-token step an int (B,), each row's slot.
      decode_backend: None, or for a cached one-token step (T == 1) the static `kernels.decode_attention` backend
        ("xla" or "pallas") that reads the span.
    Returns:
      (logits_BxTxV float32, updated cache or None).
    """
    logits_BxTxV, cache, _ = self.step(tokens_BxT, positions_BxT, mask_BxTxS, cache, cache_index, decode_backend)
    return logits_BxTxV, cache

  def step(self, tokens_BxT, positions_BxT, mask_BxTxS, cache: KVCache | None = None, cache_index=None,
           decode_backend: str | None = None):
    """`__call__`'s (logits, cache) and the experts each token went to in each MoE layer, int16 (B, T, L, K)
    (`moe.stacked_experts`; None for a dense model): what the engines record for routing replay."""
    x, cache, routings = self.forward(tokens_BxT, positions_BxT, mask_BxTxS, cache, cache_index, decode_backend)
    return self.logits(x), cache, stacked_experts(routings, *tokens_BxT.shape)

  def logits(self, hidden_BxTxD):
    """The output head on final-normed hidden states: logits_BxTxV float32."""
    dt = hidden_BxTxD.dtype
    if self.cfg.tie_embeddings:
      return jnp.einsum("btd,vd->btv", hidden_BxTxD, self.embedding[...].astype(dt), preferred_element_type=jnp.float32)
    return linear(hidden_BxTxD, self.lm_head[...].astype(dt), preferred_element_type=jnp.float32)


def _rematerialised(block: Block, x_BxTxD, positions_BxT, mask_BxTxS, replay_BxTxK, policy: str):
  """An uncached block under `jax.checkpoint` with the named `jax.checkpoint_policies` policy: its backward pass
  recomputes what the policy does not save (`ModelConfig.remat`). Returns (x_BxTxD, routing)."""
  def run(blk, x, positions, mask, replay):
    y, _, routing = blk(x, positions, mask, replay_BxTxK=replay)
    return y, routing

  return nnx.remat(run, policy=getattr(jax.checkpoint_policies, policy))(block, x_BxTxD, positions_BxT, mask_BxTxS,
                                                                          replay_BxTxK)
