"""Decoder building blocks: RMSNorm, grouped-query attention (RoPE, optional QKV bias and QK-norm), SwiGLU MLP.

Every parameter carries logical axis names (`out_sharding` metadata) that `jaxrl_batch.sharding` maps to mesh
axes. Names used: vocab, embed, heads, kv_heads, head_dim, mlp, norm.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.kernels import decode_attention
from jaxrl_batch.model.masks import DecodeSpan
from jaxrl_batch.model.rope import apply_rope

_NEG_INF = -1e30


def sharded_param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  """A parameter initialised by `init` and annotated with one logical axis name per dimension."""
  assert len(shape) == len(names), (shape, names)
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


def fan_in_normal(fan_in: int, scale: float = 1.0):
  """Normal init with std scale / sqrt(fan_in)."""
  return nnx.initializers.normal(stddev=scale / fan_in**0.5)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale, computed in float32."""

  def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = sharded_param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

  def __call__(self, x_BxTxD):
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(x_BxTxD.dtype)


def attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS):
  """Softmax attention with grouped KV heads; scores and softmax in float32. Returns (B, T, N, H)."""
  b, t, n, h = q_BxTxNxH.shape
  kv = k_BxSxKxH.shape[2]
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kv, n // kv, h)
  scores = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
  scores = jnp.where(mask_BxTxS[:, None, None], scores * h**-0.5, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxH.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH)
  return out.reshape(b, t, n, h)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, optionally reading/writing a KV cache.

  `cfg.qkv_bias` adds biases to q, k, v (Qwen2); `cfg.qk_norm` RMS-normalises each q and k head before RoPE (Qwen3).
  """

  def __init__(self, cfg, rngs: nnx.Rngs):
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

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache=None, layer=0, cache_index=None):
    """Without a cache S == T. With a `KVCache`, the T new keys/values are written in place into layer `layer` at
    slots cache_index..cache_index+T-1 and the queries attend over all S slots. A `DecodeSpan` mask (T == 1, with
    a cache) runs the Pallas decode kernel over the stacked cache in place. Returns (y_BxTxD, cache)."""
    dt = self.cfg.compute_dtype
    q = jnp.einsum("btd,dnh->btnh", x_BxTxD, self.wq[...].astype(dt))
    k = jnp.einsum("btd,dkh->btkh", x_BxTxD, self.wk[...].astype(dt))
    v = jnp.einsum("btd,dkh->btkh", x_BxTxD, self.wv[...].astype(dt))
    if self.cfg.qkv_bias:
      q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions_BxT, self.cfg.rope_theta, self.cfg.rope_scaling)
    k = apply_rope(k, positions_BxT, self.cfg.rope_theta, self.cfg.rope_scaling)
    if cache is not None:
      cache = cache.write(layer, cache_index, k, v)
      k, v = cache.k_LxBxSxKxH[layer], cache.v_LxBxSxKxH[layer]
    if isinstance(mask_BxTxS, DecodeSpan):
      out_BxTxNxH = decode_attention(q[:, 0], cache.k_LxBxSxKxH, cache.v_LxBxSxKxH, mask_BxTxS.ends_B,
                                     mask_BxTxS.starts_B, backend="pallas", layer=layer)[:, None]
    else:
      out_BxTxNxH = attend(q, k.astype(dt), v.astype(dt), mask_BxTxS)
    # dot_general contracts (n, h) in storage order; jnp.einsum emits (h, n), and XLA then transposes wo per call.
    return jax.lax.dot_general(out_BxTxNxH, self.wo[...].astype(dt), (((2, 3), (0, 1)), ((), ()))), cache


class SwiGLU(nnx.Module):
  """y = W_down (silu(W_gate x) * W_up x)."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    d, f, dt = cfg.d_model, cfg.d_ff, cfg.weight_dtype
    self.cfg = cfg
    self.w_gate = sharded_param(rngs, fan_in_normal(d), (d, f), ("embed", "mlp"), dt)
    self.w_up = sharded_param(rngs, fan_in_normal(d), (d, f), ("embed", "mlp"), dt)
    out_scale = (2 * cfg.num_layers) ** -0.5
    self.w_down = sharded_param(rngs, fan_in_normal(f, out_scale), (f, d), ("mlp", "embed"), dt)

  def __call__(self, x_BxTxD):
    dt = self.cfg.compute_dtype
    gate = jax.nn.silu(x_BxTxD @ self.w_gate[...].astype(dt))
    return (gate * (x_BxTxD @ self.w_up[...].astype(dt))) @ self.w_down[...].astype(dt)
