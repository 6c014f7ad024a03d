"""The static engine: one prefill into a KV cache, then a jitted decode loop whose cost follows the tokens
generated, not the token budget.

Prompts are left-padded, so every row writes its next token at the same cache slot and attends one span
(`masks.DecodeSpan`). With the xla decode backend a step reads a cache window that grows through power-of-two
buckets (`cache_buckets`), one `lax.while_loop` segment each, the rest skipped once every row has stopped: one
program, no host round trip. The pallas kernel reads only each row's live blocks, so one segment covers the whole
length. The rows of a group (`group_size`) share one prefill of their prompt. Details (where the window lives on
each platform, the random stream, compiles): docs/results/2026-12-06-engine-notes.md.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.kernels.platform import current_platform
from jaxrl_batch.model import DecodeSpan, KVCache, cache_mask, positions_from_valid
from jaxrl_batch.model.moe import stacked_experts
from jaxrl_batch.sampling.engine_settings import resolved_backend
from jaxrl_batch.sampling.strategies import Strategy, choose

_KERNEL_SLOTS = 128  # a kernel cache's slots are a multiple of this: a TPU lane width, whole bf16 and f32 tiles


class Rollout(NamedTuple):
  """Generated responses, right-padded.

  tokens_BxN: sampled ids; `pad_id` after a sequence's EOS.
  logprobs_BxN: float32 log-prob of each sampled token under softmax(logits / T); 0 where masked.
  mask_BxN: True for generated tokens up to and including EOS.
  lengths_B: number of True entries per row.
  truncated_B: True where no EOS was produced within the token budget.
  experts_BxTxLxK: for a mixture-of-experts model, int16 experts each token fed to the model went to in each of
    its L MoE layers (`model.step`), T = P + N: the prompt's positions, then the response's; -1 where nothing was
    fed (padding, and each response's last token). Routing replay and `router_mismatch_frac` read it. None for a
    dense model.
  """

  tokens_BxN: jax.Array
  logprobs_BxN: jax.Array
  mask_BxN: jax.Array
  lengths_B: jax.Array
  truncated_B: jax.Array
  experts_BxTxLxK: jax.Array | None = None


def recorded_experts(prompt_experts_BxPxLxK, prompt_valid_BxP, experts_BxNxLxK, lengths_B):
  """`Rollout.experts_BxTxLxK` from the prefill's and the decode steps' records (None for a dense model): -1 at
  padding and at response index >= length - 1 (never fed)."""
  if prompt_experts_BxPxLxK is None:
    return None
  fed_BxN = jnp.arange(experts_BxNxLxK.shape[1])[None, :] < lengths_B[:, None] - 1
  fed_BxT = jnp.concatenate([prompt_valid_BxP.astype(bool), fed_BxN], axis=1)
  experts_BxTxLxK = jnp.concatenate([prompt_experts_BxPxLxK, experts_BxNxLxK], axis=1)
  return jnp.where(fed_BxT[:, :, None, None], experts_BxTxLxK, jnp.int16(-1))


class _Carry(NamedTuple):
  step: jax.Array  # tokens chosen so far; the last one, token_B, is fed at cache slot P + step - 1
  cache: KVCache
  token_B: jax.Array
  position_B: jax.Array
  done_B: jax.Array
  tokens_BxN: jax.Array
  logprobs_BxN: jax.Array
  experts_BxNxLxK: jax.Array | None  # experts of each response token fed (MoE models)
  rng: jax.Array


def grows_in_place() -> bool:
  """Whether the decode segments read growing windows of one full-size cache (TPU, GPU) rather than copies into
  growing caches (CPU): on CPU reading part of a larger buffer costs a copy per layer and step; elsewhere copying
  into a growing cache would need twice the memory. The platform the program is traced for."""
  return current_platform() != "cpu"


def cache_buckets(prompt_len: int, max_new_tokens: int, backend: str) -> tuple[int, ...]:
  """Cache sizes (slots) of the decode segments; the last holds slot P + N - 2, the last one fed. The kernels'
  single size is rounded up to a multiple of _KERNEL_SLOTS: with P + N - 1 = 4,095 slots (not whole TPU tiles) the
  TPU compiler laid the engine's cache out in a layout of its own choosing (rows minor to slots) and copied every
  layer's keys and values into the Mosaic kernel's layout on every step: 2x the roofline's bytes at 256 rows
  (`launch.decode_roofline`, docs/results/2026-12-06-decode-roofline.md)."""
  full = prompt_len + max_new_tokens - 1
  if backend == "pallas":
    return (-(-full // _KERNEL_SLOTS) * _KERNEL_SLOTS,)
  sizes, size = [], 1 << prompt_len.bit_length()  # the smallest power of two > P: room for the first step
  while size < full:
    sizes.append(size)
    size *= 2
  return (*sizes, full)


def _prefilled(model, prompt_BxP, prompt_valid_BxP, *, group_size: int, length: int):
  """The prompts prefilled once per group of `group_size` rows (only each group's first row is read) into a cache
  of `length` slots: (the cache with each group's row repeated to its rows, logits_GxV of each group's last
  position, int16 experts_BxPxLxK of the prompt tokens for an MoE model, else None)."""
  b, p = prompt_BxP.shape
  g = group_size
  valid_GxP = prompt_valid_BxP[::g].astype(bool)
  kv_valid_GxS = jnp.pad(valid_GxP, ((0, 0), (0, length - p)))
  cache = KVCache.zeros(model.cfg, b // g, length)
  hidden_GxPxD, cache, routings = model.forward(prompt_BxP[::g], positions_from_valid(valid_GxP),
                                                cache_mask(kv_valid_GxS, 0, p), cache, 0)
  logits_GxV = model.logits(hidden_GxPxD[:, -1:])[:, 0]
  prompt_experts = stacked_experts(routings, b // g, p)
  prompt_experts = None if prompt_experts is None else jnp.repeat(prompt_experts, g, axis=0)
  return cache.repeat_rows(g), logits_GxV, prompt_experts


def _decoded(model, carry: _Carry, starts_B, budget_B, *, p: int, buckets: tuple[int, ...], in_place: bool,
             eos_id: int, pad_id: int, sampling: Strategy, backend: str):
  """Runs the decode segments from `carry` (see the module docstring) after a prompt of P = p slots: segment i
  takes the steps whose slot fits the window buckets[i], then, unless every row has stopped, the later segments.
  Returns (steps run + 1, tokens_BxN, logprobs_BxN, experts_BxNxLxK)."""
  b, n = carry.tokens_BxN.shape

  def body(c: _Carry, window: int):
    slot = p + c.step - 1  # cache slot of the previous token, fed now
    span = DecodeSpan(starts_B, jnp.full((b,), slot + 1), window)
    logits_Bx1xV, cache, experts_Bx1xLxK = model.step(c.token_B[:, None], c.position_B[:, None], span, c.cache,
                                                      slot, decode_backend=backend)
    rng, step_rng = jax.random.split(c.rng)
    token_B, logp_B = choose(logits_Bx1xV[:, 0], step_rng, sampling)
    token_B = jnp.where(c.done_B, pad_id, token_B)
    logp_B = jnp.where(c.done_B, 0.0, logp_B)
    return _Carry(
        step=c.step + 1,
        cache=cache,
        token_B=token_B,
        position_B=c.position_B + 1,
        done_B=c.done_B | (token_B == eos_id) | (c.step + 1 >= budget_B),
        tokens_BxN=jax.lax.dynamic_update_slice(c.tokens_BxN, token_B[:, None], (0, c.step)),
        logprobs_BxN=jax.lax.dynamic_update_slice(c.logprobs_BxN, logp_B[:, None], (0, c.step)),
        experts_BxNxLxK=None if experts_Bx1xLxK is None else jax.lax.dynamic_update_slice(
            c.experts_BxNxLxK, experts_Bx1xLxK, (0, c.step - 1, 0, 0)),
        rng=rng)

  def result(c: _Carry):
    return c.step, c.tokens_BxN, c.logprobs_BxN, c.experts_BxNxLxK

  def decode(i: int, c: _Carry):
    size = buckets[i]
    end = min(n, size - p + 1)
    step = functools.partial(body, window=size if in_place else None)
    c = jax.lax.while_loop(lambda c: (c.step < end) & ~jnp.all(c.done_B), step, c)
    if i + 1 == len(buckets):
      return result(c)
    grown = (lambda c: c) if in_place else (lambda c: c._replace(cache=c.cache.resized(buckets[i + 1])))
    return jax.lax.cond(jnp.all(c.done_B), result, lambda c: decode(i + 1, grown(c)), c)

  return decode(0, carry)


def _rollout(steps, tokens_BxN, logprobs_BxN, experts_BxNxLxK, budget_B, prompt_experts_BxPxLxK, prompt_valid_BxP,
             *, eos_id: int, pad_id: int) -> Rollout:
  """The decoded tokens as a right-padded Rollout: each row up to its EOS, its budget or the steps run."""
  n = tokens_BxN.shape[1]
  is_eos_BxN = tokens_BxN == eos_id
  eos_before_BxN = jnp.cumsum(is_eos_BxN, axis=1) - is_eos_BxN
  written_BxN = jnp.arange(n)[None, :] < jnp.minimum(steps, budget_B[:, None])
  mask_BxN = (eos_before_BxN == 0) & written_BxN
  lengths_B = mask_BxN.sum(axis=1).astype(jnp.int32)
  return Rollout(
      tokens_BxN=jnp.where(mask_BxN, tokens_BxN, pad_id),
      logprobs_BxN=jnp.where(mask_BxN, logprobs_BxN, 0.0),
      mask_BxN=mask_BxN,
      lengths_B=lengths_B,
      truncated_B=~jnp.any(is_eos_BxN & mask_BxN, axis=1),
      experts_BxTxLxK=recorded_experts(prompt_experts_BxPxLxK, prompt_valid_BxP, experts_BxNxLxK, lengths_B))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id", "pad_id", "sampling",
                                             "group_size", "attention_backend"))
def generate(graphdef, params, prompt_BxP, prompt_valid_BxP, rng, *, max_new_tokens: int, eos_id: int,
             pad_id: int, sampling: Strategy, group_size: int = 1, budget_B=None,
             attention_backend: str = "auto") -> Rollout:
  """Samples up to `max_new_tokens` tokens after each left-padded prompt by `sampling`; stops each row at EOS, or
  at its own token budget `budget_B` (optional int (B,), <= max_new_tokens). `attention_backend` as
  `EngineSettings.attention_backend`'s.

  The loop ends as soon as every row has produced EOS, and each step reads a cache sized to the live length (see
  the module docstring), so the cost follows the tokens generated. `group_size` > 1 promises that consecutive
  groups of that many rows share their prompt (only each group's first row is read) and prefills once per group.
  """
  model = nnx.merge(graphdef, params)
  b, p = prompt_BxP.shape
  n, g = max_new_tokens, group_size
  if n < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {n}.")
  if g < 1 or b % g:
    raise ValueError(f"group_size={g} must divide the batch of {b} prompts.")
  backend = resolved_backend(attention_backend)
  buckets = cache_buckets(p, n, backend)
  cache, logits_GxV, prompt_experts = _prefilled(model, prompt_BxP, prompt_valid_BxP, group_size=g,
                                                 length=buckets[0])
  in_place = grows_in_place()
  if in_place:
    cache = cache.resized(buckets[-1])
  rng, first_rng = jax.random.split(rng)
  token_B, logp_B = choose(jnp.repeat(logits_GxV, g, axis=0), first_rng, sampling)
  budget_B = jnp.full((b,), n, jnp.int32) if budget_B is None else budget_B.astype(jnp.int32)
  starts_B = p - prompt_valid_BxP.astype(jnp.int32).sum(axis=1)
  carry = _Carry(
      step=jnp.array(1, jnp.int32),
      cache=cache,
      token_B=token_B,
      position_B=positions_from_valid(prompt_valid_BxP)[:, -1] + 1,
      done_B=(token_B == eos_id) | (budget_B <= 1),
      tokens_BxN=jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(token_B),
      logprobs_BxN=jnp.zeros((b, n), jnp.float32).at[:, 0].set(logp_B),
      experts_BxNxLxK=None if prompt_experts is None else jnp.full((b, n, *prompt_experts.shape[2:]), -1,
                                                                   jnp.int16),
      rng=rng)
  decoded = _decoded(model, carry, starts_B, budget_B, p=p, buckets=buckets, in_place=in_place, eos_id=eos_id,
                     pad_id=pad_id, sampling=sampling, backend=backend)
  return _rollout(*decoded, budget_B, prompt_experts, prompt_valid_BxP, eos_id=eos_id, pad_id=pad_id)
