"""Autoregressive generation: one prefill into a preallocated KV cache, then a jitted `lax.while_loop` decode.

Prompts are left-padded (right-aligned) so every sequence writes its next token at the same cache slot.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.model import KVCache, cache_mask, positions_from_valid
from jaxrl_batch.sampling.strategies import SamplingParams, choose


class Rollout(NamedTuple):
  """Generated responses, right-padded.

  tokens_BxN: sampled ids; `pad_id` after a sequence's EOS.
  logprobs_BxN: float32 log-prob of each sampled token under softmax(logits / T); 0 where masked.
  mask_BxN: True for generated tokens up to and including EOS.
  lengths_B: number of True entries per row.
  truncated_B: True where no EOS was produced within the token budget.
  """

  tokens_BxN: jax.Array
  logprobs_BxN: jax.Array
  mask_BxN: jax.Array
  lengths_B: jax.Array
  truncated_B: jax.Array


class _Carry(NamedTuple):
  step: jax.Array
  cache: KVCache
  kv_valid_BxS: jax.Array
  token_B: jax.Array
  position_B: jax.Array
  done_B: jax.Array
  tokens_BxN: jax.Array
  logprobs_BxN: jax.Array
  rng: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id", "pad_id", "sampling"))
def generate(graphdef, params, prompt_BxP, prompt_valid_BxP, rng, *, max_new_tokens: int, eos_id: int,
             pad_id: int, sampling: SamplingParams) -> Rollout:
  """Samples up to `max_new_tokens` tokens after each left-padded prompt; stops each row at EOS.

  The loop ends as soon as every row has produced EOS, so the cost follows the longest response.
  """
  model = nnx.merge(graphdef, params)
  b, p = prompt_BxP.shape
  n = max_new_tokens
  cache = KVCache.zeros(model.cfg, b, p + n)
  kv_valid_BxS = jnp.concatenate([prompt_valid_BxP.astype(bool), jnp.zeros((b, n), bool)], axis=1)
  positions_BxP = positions_from_valid(prompt_valid_BxP)
  logits_BxPxV, cache = model(prompt_BxP, positions_BxP, cache_mask(kv_valid_BxS, 0, p), cache, 0)

  rng, first_rng = jax.random.split(rng)
  token_B, logp_B = choose(logits_BxPxV[:, -1], first_rng, sampling)
  carry = _Carry(
      step=jnp.array(1, jnp.int32),
      cache=cache,
      kv_valid_BxS=kv_valid_BxS,
      token_B=token_B,
      position_B=positions_BxP[:, -1] + 1,
      done_B=token_B == eos_id,
      tokens_BxN=jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(token_B),
      logprobs_BxN=jnp.zeros((b, n), jnp.float32).at[:, 0].set(logp_B),
      rng=rng)

  def cond(c: _Carry):
    return (c.step < n) & ~jnp.all(c.done_B)

  def body(c: _Carry):
    slot = p + c.step - 1  # cache slot of the previous token, fed now
    kv_valid_BxS = c.kv_valid_BxS.at[:, slot].set(True)
    logits_Bx1xV, cache = model(c.token_B[:, None], c.position_B[:, None], cache_mask(kv_valid_BxS, slot, 1),
                                c.cache, slot)
    rng, step_rng = jax.random.split(c.rng)
    token_B, logp_B = choose(logits_Bx1xV[:, 0], step_rng, sampling)
    token_B = jnp.where(c.done_B, pad_id, token_B)
    logp_B = jnp.where(c.done_B, 0.0, logp_B)
    return _Carry(
        step=c.step + 1,
        cache=cache,
        kv_valid_BxS=kv_valid_BxS,
        token_B=token_B,
        position_B=c.position_B + 1,
        done_B=c.done_B | (token_B == eos_id),
        tokens_BxN=jax.lax.dynamic_update_slice(c.tokens_BxN, token_B[:, None], (0, c.step)),
        logprobs_BxN=jax.lax.dynamic_update_slice(c.logprobs_BxN, logp_B[:, None], (0, c.step)),
        rng=rng)

  carry = jax.lax.while_loop(cond, body, carry)
  is_eos_BxN = carry.tokens_BxN == eos_id
  eos_before_BxN = jnp.cumsum(is_eos_BxN, axis=1) - is_eos_BxN
  written_BxN = jnp.arange(n)[None, :] < carry.step
  mask_BxN = (eos_before_BxN == 0) & written_BxN
  return Rollout(
      tokens_BxN=jnp.where(mask_BxN, carry.tokens_BxN, pad_id),
      logprobs_BxN=jnp.where(mask_BxN, carry.logprobs_BxN, 0.0),
      mask_BxN=mask_BxN,
      lengths_B=mask_BxN.sum(axis=1).astype(jnp.int32),
      truncated_B=~jnp.any(is_eos_BxN & mask_BxN, axis=1))
