"""How fast a decode step could be: the device's measured rates and the roofline of one step.

The roofline of a decode step of B rows is the larger of
  bytes read (every weight once, the embedding table only when tied, + the live KV cache) / memory bandwidth,
  FLOPs (2 x matmul weights x B + attention over the live cache) / matmul rate,
with both rates measured on the device (`measure_machine`), not taken from a datasheet.

In a mixture-of-experts model a step reads, of each MoE layer's E experts, only those its B tokens are routed to:
under uniform routing (each token's k experts a uniformly random k-subset, tokens independent) the expected
`expected_distinct_experts(E, k, B)` = E (1 - (1 - k / E)^B), k at B = 1, tending to E. The weights read are then
the dense ones (attention, norms, routers, dense MLPs, head) + that many experts' 3 D moe_d_ff parameters per MoE
layer, and the matmul FLOPs those of the active parameters (k experts a token). A trained router is less uniform
(popular experts are shared more often), so it reads fewer experts than this at the same B.
"""
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxrl_batch.model import ModelConfig


def best_seconds(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
  """Best wall time in seconds of each of `fns` (blocking on its result) over `repeats` rounds that call each once
  in turn, after one untimed call each: interleaved, the runs compared see the same load."""
  for fn in fns:
    jax.block_until_ready(fn())
  times = [[] for _ in fns]
  for _ in range(repeats):
    for fn, fn_times in zip(fns, times):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      fn_times.append(time.perf_counter() - start)
  return [min(t) for t in times]


def measure_machine(dtype, bandwidth_mb: int, matmul_size: int) -> dict[str, float]:
  """Rates of the default device in `dtype`, each the best of many runs (other processes only slow runs down).

  Returns copy_bytes_per_s (an array copy, read + write bytes), read_bytes_per_s (a read-only sum),
  bandwidth_bytes_per_s (the better of the two), all over a `bandwidth_mb` MiB array, and matmul_flops_per_s (a
  square matmul of side `matmul_size`, 2 n^3 FLOPs).
  """
  dtype = jnp.dtype(dtype)
  x = jnp.ones((bandwidth_mb << 20) // dtype.itemsize, dtype)
  copy, read = jax.jit(lambda x: x + 1), jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  copy_s, read_s = best_seconds([lambda: copy(x), lambda: read(x)], 20)
  m = jnp.ones((matmul_size, matmul_size), dtype)
  matmul = jax.jit(lambda a: a @ a)
  matmul_s, = best_seconds([lambda: matmul(m)], 10)
  return dict(copy_bytes_per_s=2 * x.nbytes / copy_s, read_bytes_per_s=x.nbytes / read_s,
              bandwidth_bytes_per_s=max(2 * x.nbytes / copy_s, x.nbytes / read_s),
              matmul_flops_per_s=2 * matmul_size**3 / matmul_s)


def step_roofline(cfg: ModelConfig, batch: int, live_len: float, machine: dict[str, float]) -> dict[str, float]:
  """One decode step of `batch` rows at mean live cache length `live_len` (slots), against `machine`'s
  bandwidth_bytes_per_s and matmul_flops_per_s.

  Returns weight_bytes, kv_bytes (bytes read), flops, and memory_roofline_ms, compute_roofline_ms and their
  maximum roofline_ms (milliseconds); for a mixture-of-experts model also expected_distinct_experts (per MoE
  layer), of which weight_bytes counts the expert weights (the module docstring).
  """
  gathered = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model  # the untied embedding: rows gathered only
  weights = cfg.num_params() - gathered
  active = cfg.num_params(active=True) - gathered  # = weights for a dense model
  extra = {}
  if cfg.num_experts:
    expert = 3 * cfg.d_model * cfg.moe_d_ff
    distinct = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
    weights -= len(cfg.moe_layers) * (cfg.num_experts - distinct) * expert
    extra = dict(expected_distinct_experts=distinct)
  weight_bytes = weights * cfg.weight_dtype.itemsize
  kv_bytes = 2 * cfg.num_layers * batch * live_len * cfg.num_kv_heads * cfg.head_dim * cfg.compute_dtype.itemsize
  flops = 2 * active * batch + 4 * cfg.num_layers * batch * cfg.num_heads * cfg.head_dim * live_len
  memory_s = (weight_bytes + kv_bytes) / machine["bandwidth_bytes_per_s"]
  compute_s = flops / machine["matmul_flops_per_s"]
  return dict(weight_bytes=weight_bytes, kv_bytes=kv_bytes, flops=flops, memory_roofline_ms=1e3 * memory_s,
              compute_roofline_ms=1e3 * compute_s, roofline_ms=1e3 * max(memory_s, compute_s), **extra)


def expected_distinct_experts(num_experts: int, k: int, tokens: int) -> float:
  """Expected number of distinct experts among `tokens` tokens' choices when each token picks k of `num_experts`
  uniformly at random (a given expert is missed by one token with probability 1 - k / E): E (1 - (1 - k / E)^tokens).
  """
  return num_experts * (1 - (1 - k / num_experts) ** tokens)
