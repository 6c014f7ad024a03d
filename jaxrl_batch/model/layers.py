"""Decoder building blocks: RMSNorm, grouped-query attention (RoPE, optional QKV bias and QK-norm), SwiGLU MLP.

Every parameter carries logical axis names (`out_sharding` metadata) that `jaxrl_batch.runtime.sharding` maps to mesh
axes. Names used: vocab, embed, heads, kv_heads, head_dim, mlp, norm.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.kernels.train_attention import attend, segment_attention
from jaxrl_batch.model import lora as lora_lib
from jaxrl_batch.model.linear import linear
from jaxrl_batch.model.masks import Segments
from jaxrl_batch.model.rope import apply_rope
from jaxrl_batch.runtime import sharding


def sharded_param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  """A parameter initialised by `init` and annotated with one logical axis name per dimension."""
  assert len(shape) == len(names), (shape, names)
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


def fan_in_normal(fan_in: int, scale: float = 1.0):
  """Normal init with std scale / sqrt(fan_in)."""
  return nnx.initializers.normal(stddev=scale / fan_in**0.5)


def add_adapters(module: nnx.Module, weights: dict[str, int], lora: lora_lib.LoRAConfig | None, rngs: nnx.Rngs):
  """Gives `module` an adapter `<name>_lora` for each weight `name` (-> its number of in axes) that `lora` targets."""
  if lora is None:
    return
  for name, contract in weights.items():
    if lora.adapts(name):
      setattr(module, name + lora_lib.SUFFIX, lora_lib.adapter_for(getattr(module, name), contract, lora, rngs))


def project(module: nnx.Module, name: str, x, dtype, contract: int = 1):
  """x through `module`'s weight `name` in `dtype` (`linear`), plus its adapter's low-rank update if it has one."""
  y = linear(x, getattr(module, name)[...].astype(dtype), contract=contract)
  adapter = getattr(module, name + lora_lib.SUFFIX, None)
  return y if adapter is None else y + adapter(x, dtype)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale, computed in float32."""

  def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = sharded_param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

  def __call__(self, x_BxTxD):
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(x_BxTxD.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, optionally reading/writing a KV cache.

  `cfg.qkv_bias` adds biases to q, k, v (Qwen2); `cfg.qk_norm` RMS-normalises each q and k head before RoPE (Qwen3).
  """

  def __init__(self, cfg, rngs: nnx.Rngs, lora: lora_lib.LoRAConfig | None = None):
    d, n, k, h, dt = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.weight_dtype
    self.cfg = cfg
    self.wq = sharded_param(rngs, fan_in_normal(d), (d, n, h), ("embed", "heads", "head_dim"), dt)
    self.wk = sharded_param(rngs, fan_in_normal(d), (d, k, h), ("embed", "kv_heads", "head_dim"), dt)
    self.wv = sharded_param(rngs, fan_in_normal(d), (d, k, h), ("embed", "kv_heads", "head_dim"), dt)
    out_scale = (2 * cfg.num_layers) ** -0.5
    self.wo = sharded_param(rngs, fan_in_normal(n * h, out_scale), (n, h, d), ("heads", "head_dim", "embed"), dt)
    if cfg.qkv_bias:
      zeros = nnx.initializers.zeros
      self.bq = sharded_param(rngs, zeros, (n, h), ("heads", "head_dim"), dt)
      self.bk = sharded_param(rngs, zeros, (k, h), ("kv_heads", "head_dim"), dt)
      self.bv = sharded_param(rngs, zeros, (k, h), ("kv_heads", "head_dim"), dt)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps, dt, rngs)
      self.k_norm = RMSNorm(h, cfg.norm_eps, dt, rngs)
    add_adapters(self, dict(wq=1, wk=1, wv=1, wo=2), lora, rngs)

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache=None, layer=0, cache_index=None,
               decode_backend: str | None = None):
    """Without a cache S == T. With a cache (a `KVCache`, or a `PagedKVCache` whose rows see S = M x C slots
    through their page table), the T new keys/values are written in place into layer `layer` at slots
    cache_index..cache_index+T-1 (for T == 1 `cache_index` may be an int (B,), each row's slot) and the queries
    attend over its S slots.

    `decode_backend` None: `mask_BxTxS` is a dense bool mask, read by `attend`, or without a cache a
    `masks.Segments`, read by `kernels.train_attention.segment_attention` with backend `cfg.attention` (no T x T
    array). "xla" or "pallas" (static): a cached one-token step (T == 1) whose `mask_BxTxS` is a `masks.DecodeSpan`,
    read by that backend of the cache's `decode_attention` (`kernels.decode_attention` or `kernels.paged_attention`)
    in place. Returns (y_BxTxD, cache).
    """
    if decode_backend is not None and (cache is None or x_BxTxD.shape[1] != 1):
      raise ValueError(f"decode_backend={decode_backend!r} is for a cached one-token step, got T = "
                       f"{x_BxTxD.shape[1]}{'' if cache is not None else ' and no cache'}.")
    segments = isinstance(mask_BxTxS, Segments)
    if segments and cache is not None:
      raise ValueError("masks.Segments describe a forward without a KV cache; a cached forward takes a dense mask.")
    dt = self.cfg.compute_dtype
    q, k, v = (project(self, w, x_BxTxD, dt) for w in ("wq", "wk", "wv"))
    if self.cfg.qkv_bias:
      q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions_BxT, self.cfg.rope_theta, self.cfg.rope_scaling)
    k = apply_rope(k, positions_BxT, self.cfg.rope_theta, self.cfg.rope_scaling)
    if cache is not None:
      cache = cache.write(layer, cache_index, k, v)
    if decode_backend is not None:
      out_BxTxNxH = cache.decode_attention(layer, q[:, 0], mask_BxTxS.starts_B, mask_BxTxS.ends_B,
                                           backend=decode_backend, window=mask_BxTxS.window)[:, None]
    elif segments:
      out_BxTxNxH = segment_attention(q, k, v, mask_BxTxS.segment_ids_BxT, backend=self.cfg.attention)
    else:
      k_BxKxHxS, v_BxKxSxH = (cache.layer(layer) if cache is not None else
                              (jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)))
      out_BxTxNxH = attend(q, k_BxKxHxS.astype(dt), v_BxKxSxH.astype(dt), mask_BxTxS)
    return sharding.constrain_rows(project(self, "wo", out_BxTxNxH, dt, contract=2)), cache


class SwiGLU(nnx.Module):
  """y = W_down (silu(W_gate x) * W_up x)."""

  def __init__(self, cfg, rngs: nnx.Rngs, lora: lora_lib.LoRAConfig | None = None):
    d, f, dt = cfg.d_model, cfg.d_ff, cfg.weight_dtype
    self.cfg = cfg
    self.w_gate = sharded_param(rngs, fan_in_normal(d), (d, f), ("embed", "mlp"), dt)
    self.w_up = sharded_param(rngs, fan_in_normal(d), (d, f), ("embed", "mlp"), dt)
    out_scale = (2 * cfg.num_layers) ** -0.5
    self.w_down = sharded_param(rngs, fan_in_normal(f, out_scale), (f, d), ("mlp", "embed"), dt)
    add_adapters(self, dict(w_gate=1, w_up=1, w_down=1), lora, rngs)

  def __call__(self, x_BxTxD):
    dt = self.cfg.compute_dtype
    gate = jax.nn.silu(project(self, "w_gate", x_BxTxD, dt))
    h_BxTxF = sharding.constrain_rows(gate * project(self, "w_up", x_BxTxD, dt))
    return sharding.constrain_rows(project(self, "w_down", h_BxTxF, dt))
