"""Attention of a training forward (no KV cache) over rows described by segment ids: its definition and three backends,
two of which never hold a T x T array.

Semantics (`segment_attention`): query head n of row b at position t attends kv head n // (N // K) at the positions
s <= t with segment_ids_BxT[b, s] == segment_ids_BxT[b, t] != 0; scores are scaled by H**-0.5. Segment 0 marks
padding: its queries' outputs are unused (each backend returns finite values there, not the same ones). A padded row
is one segment (`model.masks.segments`: id 1 on its valid tokens), a packed row (`rl.packing`) one id per sequence.
Backends:
  dense: `attend` under `segment_causal_mask`, in plain jnp: the model's attention with a dense mask, i.e. B x N x T x
    T float32 scores per layer. The reference the others are tested against.
  splash: TPU, `jax.experimental.pallas.ops.tpu.splash_attention` (a causal `MultiHeadMask` and `SegmentIds`; grouped
    kv heads natively), forward and backward kernels that skip the blocks above the diagonal.
  flash_gpu: GPU, the Pallas (Triton) flash attention `jax.experimental.pallas.ops.gpu.attention.mha` with segment ids
    (kv heads repeated to N: the kernel has no grouped form). `jax.nn.dot_product_attention(implementation="cudnn")`
    would do too but takes no segment ids (only right-padded lengths).
Both kernels run in interpret mode on CPU (tests) and pad T to their block multiple with segment id 0 (padding after
every real token: causality keeps it from real queries). Under a mesh (`jax.sharding.get_abstract_mesh()`) they sit
in a `jax.shard_map` (Pallas kernels cannot be partitioned automatically): rows over the batch axes that divide B,
heads over `tensor` where it divides N. Where it does not divide K (Qwen2.5-1.5B: 12 query heads, 2 kv heads,
tensor=4) the kv heads are first repeated by the smallest factor r (a divisor of N // K) for which it divides K * r:
r = 2 there, one kv head per shard for its 3 query heads.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from jaxrl_batch.kernels.platform import current_platform
from jaxrl_batch.runtime.sharding import BATCH_AXES, dividing_axes

BACKENDS = ("dense", "splash", "flash_gpu")
HEAD_AXIS = "tensor"
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_SPLASH_BLOCKS = (512, 256, 128)  # splash's blocks must be multiples of 128 (TPU lanes); the largest dividing T
_GPU_BLOCK = 128  # mha's forward block (its default); shorter T use one block of the next power of two >= 16
_NEG_INF = -1e30


def segment_causal_mask(segment_ids_BxT: jax.Array) -> jax.Array:
  """(B, T, T) bool: query t may attend key s iff s <= t and both belong to the same sequence (segment id), 0
  marking padding."""
  t = segment_ids_BxT.shape[-1]
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
  return causal_TxT[None] & same_BxTxT & (segment_ids_BxT[:, None, :] != 0)


def attend(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, mask_BxTxS):
  """Softmax attention with grouped KV heads over keys and values in the cache layout (`KVCache`), under a dense
  bool mask; scores and softmax in float32. Returns (B, T, N, H)."""
  b, t, n, h = q_BxTxNxH.shape
  kv = k_BxKxHxS.shape[1]
  q_BxKxGxTxH = jnp.moveaxis(q_BxTxNxH.reshape(b, t, kv, n // kv, h), 1, 3)
  scores = jnp.einsum("bkgth,bkhs->bkgts", q_BxKxGxTxH, k_BxKxHxS, preferred_element_type=jnp.float32)
  scores = jnp.where(mask_BxTxS[:, None, None], scores * h**-0.5, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxH.dtype)
  out = jnp.einsum("bkgts,bksh->btkgh", probs, v_BxKxSxH)
  return out.reshape(b, t, n, h)


def segment_attention_dense(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT):
  """The dense backend: `attend` under the (B, T, T) `segment_causal_mask`."""
  return attend(q_BxTxNxH, jnp.transpose(k_BxTxKxH, (0, 2, 3, 1)), jnp.swapaxes(v_BxTxKxH, 1, 2),
                segment_causal_mask(segment_ids_BxT))


def _pad_time(t_pad: int, *arrays):
  """Each (B, T, ...) array zero-padded to t_pad positions."""
  return [jnp.pad(a, [(0, 0), (0, t_pad - a.shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in arrays]


def splash_local(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, *, interpret: bool):
  """The splash backend on the rows and heads held here (no mesh, or one shard_map shard). Returns (B, T, N, H)."""
  _, t, n, h = q_BxTxNxH.shape
  t_pad = -(-t // _SPLASH_BLOCKS[-1]) * _SPLASH_BLOCKS[-1]
  block = next(c for c in _SPLASH_BLOCKS if t_pad % c == 0)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  mask = splash.MultiHeadMask([splash.CausalMask((t_pad, t_pad))] * n)
  kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
  q, k, v, ids_BxT = _pad_time(t_pad, q_BxTxNxH * h**-0.5, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT.astype(jnp.int32))
  q_BxNxTxH, k_BxKxTxH, v_BxKxTxH = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
  out_BxNxTxH = jax.vmap(kernel)(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, splash.SegmentIds(q=ids_BxT, kv=ids_BxT))
  return jnp.swapaxes(out_BxNxTxH, 1, 2)[:, :t]


def flash_gpu_local(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, *, interpret: bool):
  """The flash_gpu backend on the rows and heads held here (no mesh, or one shard_map shard). Returns (B, T, N, H)."""
  _, t, n, h = q_BxTxNxH.shape
  g = n // k_BxTxKxH.shape[2]
  block = min(_GPU_BLOCK, max(16, 1 << (t - 1).bit_length()))
  t_pad = -(-t // block) * block
  k_BxTxNxH, v_BxTxNxH = (jnp.repeat(a, g, axis=2) for a in (k_BxTxKxH, v_BxTxKxH))
  q, k, v, ids_BxT = _pad_time(t_pad, q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, segment_ids_BxT.astype(jnp.int32))
  out_BxTxNxH = gpu_attention.mha(q, k, v, ids_BxT, sm_scale=h**-0.5, causal=True, interpret=interpret)
  return out_BxTxNxH[:, :t]


def on_mesh(local_fn, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT):
  """`local_fn` (a backend's `*_local`) in a `jax.shard_map` over the ambient mesh, as the module docstring says;
  called directly without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return local_fn(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
  b, _, n, _ = q_BxTxNxH.shape
  kv = k_BxTxKxH.shape[2]
  rows = dividing_axes(mesh, BATCH_AXES, b) or None
  heads = dividing_axes(mesh, (HEAD_AXIS,), n)
  if heads:
    tp = mesh.shape[HEAD_AXIS]
    r = next(r for r in range(1, n // kv + 1) if (n // kv) % r == 0 and (kv * r) % tp == 0)
    k_BxTxKxH, v_BxTxKxH = (jnp.repeat(a, r, axis=2) for a in (k_BxTxKxH, v_BxTxKxH))
  spec = P(rows, None, heads or None, None)
  return jax.shard_map(local_fn, mesh=mesh, in_specs=(spec, spec, spec, P(rows, None)), out_specs=spec,
                       check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)


def backend_for(platform: str) -> str:
  """The backend "auto" stands for on `platform` (a `jax.default_backend()` name or a device's platform): splash on
  TPU, flash_gpu on GPU, dense elsewhere (on CPU the kernels only interpret)."""
  return "splash" if platform == "tpu" else "flash_gpu" if platform in _GPU_PLATFORMS else "dense"


def resolve(backend: str, platform: str | None = None) -> str:
  """`backend` ("auto" or one of BACKENDS) as one of BACKENDS; "auto" by `backend_for(platform)`, the platform
  defaulting to `current_platform()`."""
  if backend == "auto":
    return backend_for(platform or current_platform())
  if backend not in BACKENDS:
    raise ValueError(f"unknown training attention backend {backend!r}; choose 'auto' or one of {BACKENDS}")
  return backend


def segment_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, *, backend: str,
                      interpret: bool | None = None):
  """Attention with the semantics of the module docstring by `backend` ("auto" or one of BACKENDS). Returns
  (B, T, N, H) in q's dtype (dense: v's).

  interpret: run a kernel in Pallas interpret mode; None = on CPU (`current_platform()`), where nothing else runs."""
  backend = resolve(backend)
  if backend == "dense":
    return segment_attention_dense(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
  interpret = current_platform() == "cpu" if interpret is None else interpret
  local = splash_local if backend == "splash" else flash_gpu_local
  return on_mesh(functools.partial(local, interpret=interpret), q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
