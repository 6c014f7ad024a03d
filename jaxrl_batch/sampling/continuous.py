"""The continuous engine: `slots` sequences in flight; a slot whose sequence ends takes the next queued request.

Why: with long-tailed response lengths the static engine's block runs to its longest row while the others idle.
Here the host refills free slots between chunks of `sampling.chunk` decode steps (one small upload and one download
per chunk), each prompt is prefilled once for its G samples, and a sequence carried over or preempted is
re-prefilled, or, carried over with its slot (`KeptSlots`, `rollout.carry_kv`), continues on the keys/values already
in its slot's cache; a paged cache (`sampling.page_size` > 0) makes memory follow the live tokens. A request's tokens
depend only on (key, request, token index), not on the slots or the chunk: greedy gives `generate`'s tokens.
`scheduler` decides which request each slot decodes; this module holds the device programs and the loop that runs
those decisions (docs/results/2026-12-06-engine-notes.md has the details and the cost in host syncs).
"""
import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_batch.model import DecodeSpan, KVCache, PagedKVCache, cache_mask, positions_from_valid
from jaxrl_batch.model.kv_cache import layer_sharding
from jaxrl_batch.model.moe import stacked_experts
from jaxrl_batch.runtime import transfer
from jaxrl_batch.sampling.engine_settings import EngineSettings, resolved_backend
from jaxrl_batch.sampling.generate import Rollout, cache_buckets, recorded_experts
from jaxrl_batch.sampling.pages import PageTable
from jaxrl_batch.sampling.scheduler import EVICT, Plan, Scheduler
from jaxrl_batch.sampling.strategies import Strategy, choose


class Prefix(NamedTuple):
  """The Q distinct prompts, prefilled: cache (Q rows of P slots; None once copied into a paged cache's prompt
  pages), logits_QxV float32 of each prompt's last position, length_Q its real tokens, the prompts themselves
  (prompt_QxP, valid_QxP) for re-prefills, and for an MoE model the experts of every prompt token, int16
  experts_QxPxLxK (`model.step`; None for a dense model)."""
  cache: KVCache | None
  logits_QxV: jax.Array
  length_Q: jax.Array
  prompt_QxP: jax.Array
  valid_QxP: jax.Array
  experts_QxPxLxK: jax.Array | None = None


class Requests(NamedTuple):
  """R requests, on the device: prompt_R, the row of each one's prompt among the Q prefilled; uid_R, the id its
  random keys are folded from; budget_R, its token budget (<= N); and the tokens it already holds, tokens_RxN,
  logprobs_RxN and lengths_R (a partial sequence carried over from an earlier call: re-prefilled under the current
  weights, then continued; lengths 0 for a new request). All int32 but logprobs (float32)."""
  prompt_R: jax.Array
  uid_R: jax.Array
  budget_R: jax.Array
  tokens_RxN: jax.Array
  logprobs_RxN: jax.Array
  lengths_R: jax.Array


class Slots(NamedTuple):
  """S sequences in flight. A free slot holds request R (out of range: its writes to the outputs are dropped)."""
  cache: KVCache | PagedKVCache
  request_S: jax.Array  # int32 request decoding in the slot
  token_S: jax.Array  # int32 last token chosen, fed by the next step
  count_S: jax.Array  # int32 tokens chosen so far; the last is fed at cache slot P + count - 1
  position_S: jax.Array  # int32 RoPE position of the token fed next
  start_S: jax.Array  # int32 first real cache slot: P - prompt length
  live_S: jax.Array  # bool, still decoding


class KeptSlots(NamedTuple):
  """Slots kept from one `decode` call for the next (`rollout.carry_kv`, PipelineRL's in-flight weight update): the
  device `state` the earlier call left (its cache holds the keys/values of the weights that wrote them, its counts
  and positions each sequence's place), `slot_R`, host int (R,), the slot of each request of the next call that
  continues in one (-1: none), and `p`, the prompt slots of the call that wrote the cache (calls must agree)."""
  state: Slots
  slot_R: np.ndarray
  p: int


class Outputs(NamedTuple):
  """Per request: tokens_RxN and logprobs_RxN as chosen (stale beyond the length), lengths_R, eos_R (ended by
  EOS), and for an MoE model experts_RxNxLxK, the int16 experts of each token this call fed (-1 for the others,
  e.g. the tokens of a carried sequence, re-prefilled; None for a dense model)."""
  tokens_RxN: jax.Array
  logprobs_RxN: jax.Array
  lengths_R: jax.Array
  eos_R: jax.Array
  experts_RxNxLxK: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
  """Host figures of one rollout: `chunks` run (host syncs: one upload and one download each), `slot_steps`
  (slots x decode steps run, live or not), `decoded` (tokens chosen by decode steps: every token but each
  request's first, which comes from the prefill), `reprefill_s`, the seconds spent re-prefilling carried-over or
  preempted sequences (0 without them), `reprefilled` (how many; kept slots are not), and with a paged cache
  `preempted` (sequences evicted when the pool ran short, re-prefilled later) and `pages_peak` (the most growable
  pages held at once)."""
  chunks: int
  slot_steps: int
  decoded: int
  reprefill_s: float = 0.0
  preempted: int = 0
  pages_peak: int = 0
  reprefilled: int = 0

  @property
  def useful_token_frac(self) -> float:
    """Decoded tokens per slot-step: 1.0 when no slot ever idles."""
    return self.decoded / max(self.slot_steps, 1)


def _row_keys(key, uid_S, index_S):
  return jax.vmap(lambda u, t: jax.random.fold_in(jax.random.fold_in(key, u), t))(uid_S, index_S)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def prefill_prompts(graphdef, params, prompt_QxP, valid_QxP) -> Prefix:
  """The engine's prefill program: the Q prompts' keys/values and each one's last-position logits, in one batch
  (`aot` compiles it: programs `prefill` and `eval_fill`)."""
  model = nnx.merge(graphdef, params)
  q, p = prompt_QxP.shape
  valid_QxP = valid_QxP.astype(bool)
  cache = KVCache.zeros(model.cfg, q, p)
  hidden_QxPxD, cache, routings = model.forward(prompt_QxP, positions_from_valid(valid_QxP),
                                                cache_mask(valid_QxP, 0, p), cache, 0)
  return Prefix(cache, model.logits(hidden_QxPxD[:, -1:])[:, 0], valid_QxP.sum(axis=1).astype(jnp.int32),
                 prompt_QxP, valid_QxP, stacked_experts(routings, q, p))


def _pool(prefix_cache: KVCache, pages: int, page_size: int, slots: int) -> PagedKVCache:
  """A paged cache: the Q prompts' pages (the prefill's P slots cut into W = P / C pages each), `pages` zero pages
  and the trash page; every slot's table row is the trash page until the chunks name its pages."""
  c = page_size

  def paged(x, slot_axis: int):  # (Q, K, H, P) or (Q, K, P, H) -> (Q x W + pages + 1, K, H, C) or (..., K, C, H)
    shape = list(x.shape)
    q, w = shape[0], shape[slot_axis] // c
    split = shape[:slot_axis] + [w, c] + shape[slot_axis + 1:]
    order = (0, slot_axis, *[a for a in range(1, len(split)) if a != slot_axis])
    prompt = jnp.transpose(x.reshape(split), order).reshape(q * w, *[d for a, d in enumerate(split) if a not in
                                                                     (0, slot_axis)])
    return jnp.concatenate([prompt, jnp.zeros((pages + 1, *prompt.shape[1:]), x.dtype)])

  k_layers = tuple(paged(k, 3) for k in prefix_cache.k_layers)
  v_layers = tuple(paged(v, 2) for v in prefix_cache.v_layers)
  return PagedKVCache(k_layers, v_layers, jnp.full((slots, 1), k_layers[0].shape[0] - 1, jnp.int32))


def _start(prefix: Prefix, requests: Requests, *, slots: int, length: int, pages: int = 0, page_size: int = 0
           ) -> tuple[Slots, Outputs]:
  """Free slots with a cache of `length` slots (the prefill's layers, kv heads, head width and dtype), or with
  page_size > 0 a paged cache of `pages` growable pages (`_pool`; P must be a multiple of page_size), and fresh
  output buffers (the chunks donate them) holding the requests' tokens so far."""
  s, r = slots, requests.budget_R.shape[0]
  zeros_S = jnp.zeros((s,), jnp.int32)
  like = prefix.cache
  if page_size:
    cache = _pool(like, pages, page_size, s)
  else:
    cache = KVCache(tuple(jnp.zeros((s, *k.shape[1:3], length), k.dtype) for k in like.k_layers),
                    tuple(jnp.zeros((s, v.shape[1], length, v.shape[3]), v.dtype) for v in like.v_layers))
  state = Slots(cache, jnp.full((s,), r, jnp.int32), zeros_S, zeros_S, zeros_S, zeros_S, jnp.zeros((s,), bool))
  return state, _fresh_outputs(prefix, requests)


def _fresh_outputs(prefix: Prefix, requests: Requests) -> Outputs:
  """Output buffers (the chunks donate them) holding the requests' tokens so far."""
  experts = prefix.experts_QxPxLxK
  return Outputs(jnp.copy(requests.tokens_RxN), jnp.copy(requests.logprobs_RxN), jnp.copy(requests.lengths_R),
                 jnp.zeros_like(requests.lengths_R, bool),
                 None if experts is None else jnp.full((*requests.tokens_RxN.shape, *experts.shape[2:]), -1,
                                                       jnp.int16))


@functools.lru_cache(maxsize=None)
def slots_starter(slots: int, length: int, layers: int, row_sharding, pages: int = 0, page_size: int = 0,
                  moe: bool = False, heads: int = 0):
  """`_start` jitted for a model of `layers` layers (`moe`: with MoE layers), its outputs' leading axes laid out
  by `row_sharding` (if given; a paged cache lives on one device and takes none) and the slot cache's `heads` (the
  prefix cache's, `model.kv_cache.cache_heads`) over `tensor` where they split (`model.kv_cache.layer_sharding`).
  `aot` compiles it for the layout of the chunks' slots and outputs."""
  start = functools.partial(_start, slots=slots, length=length, pages=pages, page_size=page_size)
  if row_sharding is None or page_size:
    return jax.jit(start)
  cache = KVCache(*(tuple(layer_sharding(row_sharding(4), heads) for _ in range(layers)),) * 2)
  state = Slots(cache, *(row_sharding(1),) * 6)
  return jax.jit(start, out_shardings=(state, _outputs_sharding(row_sharding, moe)))


def _outputs_sharding(row_sharding, moe: bool) -> Outputs:
  return Outputs(row_sharding(2), row_sharding(2), row_sharding(1), row_sharding(1), row_sharding(4) if moe else None)


@functools.lru_cache(maxsize=None)
def _outputs_starter(row_sharding, moe: bool):
  """`_fresh_outputs` jitted, laid out as `slots_starter`'s: the outputs of a call whose slots are kept."""
  if row_sharding is None:
    return jax.jit(_fresh_outputs)
  return jax.jit(_fresh_outputs, out_shardings=_outputs_sharding(row_sharding, moe))


def _new_requests(budget_B, batch: int, group_size: int, max_new_tokens: int, pad_id: int) -> Requests:
  b, n = batch, max_new_tokens
  rows_B = jnp.arange(b, dtype=jnp.int32)
  budget_B = jnp.full((b,), n, jnp.int32) if budget_B is None else budget_B.astype(jnp.int32)
  return Requests(rows_B // group_size, rows_B, budget_B, jnp.full((b, n), pad_id, jnp.int32),
                  jnp.zeros((b, n), jnp.float32), jnp.zeros((b,), jnp.int32))


@functools.lru_cache(maxsize=None)
def _request_maker(batch: int, group_size: int, max_new_tokens: int, pad_id: int, budgets: bool, row_sharding):
  make = functools.partial(_new_requests, batch=batch, group_size=group_size, max_new_tokens=max_new_tokens,
                           pad_id=pad_id)
  if not budgets:
    make = functools.partial(make, None)
  if row_sharding is None:
    return jax.jit(make)
  return jax.jit(make, out_shardings=Requests(*(row_sharding(ndim) for ndim in (1, 1, 1, 2, 2, 1))))


def new_requests(batch: int, *, group_size: int, max_new_tokens: int, pad_id: int, budget_B=None,
                 row_sharding=None) -> Requests:
  """`batch` new requests, Q = batch / group_size prompts: request r reads prompt r // group_size and draws from
  uid r; token budgets `budget_B` (device int (B,); default max_new_tokens). Laid out by `row_sharding` as
  `generate_continuous`'s. Built on the device: nothing crosses from the host."""
  make = _request_maker(batch, group_size, max_new_tokens, pad_id, budget_B is not None, row_sharding)
  return make() if budget_B is None else make(budget_B)


@functools.partial(jax.jit, static_argnames=("length",))
def _resized(cache: KVCache, length: int) -> KVCache:
  """The cache with `length` slots: zero-padded, or cut (only slots no live sequence reaches)."""
  if length >= cache.length:
    return cache.resized(length)
  return KVCache(tuple(k[..., :length] for k in cache.k_layers), tuple(v[:, :, :length] for v in cache.v_layers))


def _with_prefix(cache, prefix: Prefix, rows_S, prompt_S):
  """Slot rows `rows_S` (out of range: untouched) get the prefix of prompts `prompt_S` in slots [0, P). A paged
  cache is returned as it is: its rows name their prompt's pages (`_table`)."""
  if isinstance(cache, PagedKVCache):
    return cache
  p = prefix.cache.length
  return KVCache(
      tuple(k.at[rows_S, :, :, :p].set(pk[prompt_S].astype(k.dtype), mode="drop")
            for k, pk in zip(cache.k_layers, prefix.cache.k_layers)),
      tuple(v.at[rows_S, :, :p].set(pv[prompt_S].astype(v.dtype), mode="drop")
            for v, pv in zip(cache.v_layers, prefix.cache.v_layers)))


def _table(cache: PagedKVCache, prefix: Prefix, prompt_S, own_SxM) -> jax.Array:
  """The page table of slots decoding prompts `prompt_S` and holding own pages `own_SxM` (`pages.PageTable`): the
  prompt's W = P / C shared pages, then the own ones."""
  w = prefix.valid_QxP.shape[1] // cache.page_size
  return jnp.concatenate([prompt_S[:, None] * w + jnp.arange(w, dtype=jnp.int32)[None, :], own_SxM], axis=1)


def _admit(state: Slots, outputs: Outputs, prefix: Prefix, requests: Requests, admit_S, key, *, eos_id: int,
           sampling: Strategy):
  """Slots with admit_S >= 0 take that new request: its prompt's prefix and its first token; slots with admit_S ==
  EVICT stop (preempted: their request keeps its tokens so far)."""
  s, r = admit_S.shape[0], requests.budget_R.shape[0]
  admitted_S = admit_S >= 0
  request_S = jnp.maximum(admit_S, 0)
  prompt_S = requests.prompt_R[request_S]
  cache = _with_prefix(state.cache, prefix, jnp.where(admitted_S, jnp.arange(s), s), prompt_S)
  token_S, logp_S = choose(prefix.logits_QxV[prompt_S], _row_keys(key, requests.uid_R[request_S],
                                                                    jnp.zeros((s,), jnp.int32)), sampling)
  written_S = jnp.where(admitted_S, admit_S, r)
  ended_S = (token_S == eos_id) | (requests.budget_R[request_S] <= 1)
  p = prefix.valid_QxP.shape[1]
  outputs = Outputs(outputs.tokens_RxN.at[written_S, 0].set(token_S, mode="drop"),
                    outputs.logprobs_RxN.at[written_S, 0].set(logp_S, mode="drop"),
                    outputs.lengths_R.at[written_S].set(1, mode="drop"),
                    outputs.eos_R.at[written_S].set(token_S == eos_id, mode="drop"), outputs.experts_RxNxLxK)
  length_S = prefix.length_Q[prompt_S]
  state = Slots(cache, jnp.where(admitted_S, admit_S, state.request_S), jnp.where(admitted_S, token_S, state.token_S),
                 jnp.where(admitted_S, 1, state.count_S), jnp.where(admitted_S, length_S, state.position_S),
                 jnp.where(admitted_S, p - length_S, state.start_S),
                 jnp.where(admitted_S, ~ended_S, state.live_S & (admit_S != EVICT)))
  return state, outputs


def fed_bucket(held: int, max_new_tokens: int) -> int:
  """T, the tokens a re-prefill feeds per row for sequences holding at most `held` tokens: the power of two >=
  held - 1 (its last token is fed by the next decode step), capped at N - 1, so a few shapes compile."""
  return min(1 << max(held - 2, 0).bit_length(), max_new_tokens - 1)


@functools.partial(jax.jit, static_argnames=("graphdef", "fed"))
def resume_slots(graphdef, params, state: Slots, outputs: Outputs, prefix: Prefix, requests: Requests, resume_S,
                 own_SxM=None, *, fed: int) -> Slots:
  """Slots with resume_S >= 0 take that request, which holds count tokens in `outputs` (carried over from an
  earlier call, or preempted), re-prefilled under `params`: its prompt's prefix, then its first count - 1 tokens
  (count - 1 <= fed) written at slots P..P + fed - 1 (the last one chosen is fed by the next decode step). The
  other slots are untouched. The cache must hold P + fed slots: a paged one through own pages `own_SxM`.
  (`aot` compiles it: program `reprefill`.)"""
  model = nnx.merge(graphdef, params)
  s, p = resume_S.shape[0], prefix.valid_QxP.shape[1]
  resumed_S = resume_S >= 0
  request_S = jnp.maximum(resume_S, 0)
  prompt_S, count_S = requests.prompt_R[request_S], outputs.lengths_R[request_S]
  length_S = prefix.length_Q[prompt_S]
  cache = _with_prefix(state.cache, prefix, jnp.where(resumed_S, jnp.arange(s), s), prompt_S)
  if own_SxM is not None:  # the other rows' writes go to the trash page
    cache = cache._replace(table_BxM=jnp.where(resumed_S[:, None], _table(cache, prefix, prompt_S, own_SxM),
                                               cache.trash))
  fed_SxT = outputs.tokens_RxN[request_S, :fed]
  fed_valid_SxT = jnp.arange(fed)[None, :] < (count_S - 1)[:, None]
  kv_valid_SxL = jnp.concatenate([prefix.valid_QxP[prompt_S], fed_valid_SxT,
                                  jnp.zeros((s, cache.length - p - fed), bool)], axis=1)
  positions_SxT = length_S[:, None] + jnp.arange(fed)[None, :]
  _, written, _ = model.forward(fed_SxT, positions_SxT, cache_mask(kv_valid_SxL, p, fed), cache, p)
  if own_SxM is None:
    written = jax.tree.map(lambda new, old: jnp.where(resumed_S.reshape((s,) + (1,) * (new.ndim - 1)), new, old),
                           written, cache)
  last_S = jnp.take_along_axis(outputs.tokens_RxN[request_S], jnp.maximum(count_S - 1, 0)[:, None], axis=1)[:, 0]
  return Slots(written, jnp.where(resumed_S, resume_S, state.request_S),
                jnp.where(resumed_S, last_S, state.token_S), jnp.where(resumed_S, count_S, state.count_S),
                jnp.where(resumed_S, length_S + count_S - 1, state.position_S),
                jnp.where(resumed_S, p - length_S, state.start_S), state.live_S | resumed_S)


def decode_token(model, slots: Slots, uid_S, key, *, p: int, sampling: Strategy, backend: str):
  """The engine's work per token: the model's cached one-token step over each live slot's span (a finished or free
  slot writes the cache's idle slot and reads nothing), then the token choice by `sampling`, each row's key folded
  from its request's `uid_S` and its count. `p`: the cache's prompt slots; `backend`: resolved. Returns (cache,
  token_S, logp_S, experts_Sx1xLxK). `decode_chunk` runs it per token and `aot.decode_roofline` compiles it alone."""
  slot_S = jnp.where(slots.live_S, p + slots.count_S - 1, slots.cache.idle_slot)
  span = DecodeSpan(slots.start_S, jnp.where(slots.live_S, slot_S + 1, 0))
  logits_Sx1xV, cache, experts_Sx1xLxK = model.step(slots.token_S[:, None], slots.position_S[:, None], span,
                                                    slots.cache, slot_S, decode_backend=backend)
  token_S, logp_S = choose(logits_Sx1xV[:, 0], _row_keys(key, uid_S, slots.count_S), sampling)
  return cache, token_S, logp_S, experts_Sx1xLxK


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "eos_id", "sampling", "attention_backend"),
                   donate_argnums=(2, 3))
def decode_chunk(graphdef, params, state: Slots, outputs: Outputs, prefix: Prefix, requests: Requests, admit_S, key,
                 own_SxM=None, *, steps: int, eos_id: int, sampling: Strategy, attention_backend: str):
  """Admits `admit_S` (a paged cache's slots then hold own pages `own_SxM`), then runs up to `steps` decode steps
  of the live slots, choosing tokens by `sampling` (`attention_backend` as `EngineSettings`'). Returns (state,
  outputs, steps run, tokens decoded), the last two int32 scalars. The program the host runs per chunk
  (`aot` compiles it: programs `decode` and `eval`)."""
  model = nnx.merge(graphdef, params)
  backend = resolved_backend(attention_backend)
  state, outputs = jax.lax.cond(
      jnp.any(admit_S != -1), functools.partial(_admit, eos_id=eos_id, sampling=sampling),
      lambda state, outputs, *_: (state, outputs), state, outputs, prefix, requests, admit_S, key)
  p, r = prefix.valid_QxP.shape[1], requests.budget_R.shape[0]
  if own_SxM is not None:
    table_SxM = _table(state.cache, prefix, requests.prompt_R[jnp.minimum(state.request_S, r - 1)], own_SxM)
    state = state._replace(cache=state.cache._replace(table_BxM=table_SxM))

  def step(carry):
    i, decoded, c, out = carry
    request_S = jnp.minimum(c.request_S, r - 1)
    cache, token_S, logp_S, experts_Sx1xLxK = decode_token(model, c, requests.uid_R[request_S], key, p=p,
                                                           sampling=sampling, backend=backend)
    written_S = jnp.where(c.live_S, c.request_S, r)
    count_S = c.count_S + c.live_S
    ended_S = c.live_S & ((token_S == eos_id) | (count_S >= requests.budget_R[request_S]))
    out = Outputs(out.tokens_RxN.at[written_S, c.count_S].set(token_S, mode="drop"),
                  out.logprobs_RxN.at[written_S, c.count_S].set(logp_S, mode="drop"),
                  out.lengths_R.at[written_S].set(count_S, mode="drop"),
                  out.eos_R.at[written_S].set(token_S == eos_id, mode="drop"),
                  None if experts_Sx1xLxK is None else
                  out.experts_RxNxLxK.at[written_S, c.count_S - 1].set(experts_Sx1xLxK[:, 0], mode="drop"))
    decoded = decoded + c.live_S.sum(dtype=jnp.int32)
    c = Slots(cache, c.request_S, token_S, count_S, c.position_S + c.live_S, c.start_S, c.live_S & ~ended_S)
    return i + 1, decoded, c, out

  zero = jnp.array(0, jnp.int32)
  i, decoded, state, outputs = jax.lax.while_loop(lambda carry: (carry[0] < steps) & jnp.any(carry[2].live_S),
                                                  step, (zero, zero, state, outputs))
  return state, outputs, i, decoded


@functools.partial(jax.jit, static_argnames=("pad_id",))
def to_rollout(outputs: Outputs, prompt_experts_RxPxLxK=None, prompt_valid_RxP=None, *, pad_id: int) -> Rollout:
  """The outputs as a right-padded `Rollout` (truncated: no EOS); for an MoE model, with the experts of each
  request's prompt tokens (int16 (R, P, L, K)) and its prompt mask, the rollout's `experts_BxTxLxK`."""
  mask_RxN = jnp.arange(outputs.tokens_RxN.shape[1])[None, :] < outputs.lengths_R[:, None]
  experts = None
  if outputs.experts_RxNxLxK is not None:
    experts = recorded_experts(prompt_experts_RxPxLxK, prompt_valid_RxP, outputs.experts_RxNxLxK, outputs.lengths_R)
  return Rollout(jnp.where(mask_RxN, outputs.tokens_RxN, pad_id), jnp.where(mask_RxN, outputs.logprobs_RxN, 0.0),
                 mask_RxN, outputs.lengths_R, ~outputs.eos_R, experts)


@dataclasses.dataclass
class Decoded:
  """What `decode` leaves: the outputs (device) and, on the host, which requests ended (`ended_R`, by EOS or
  budget), how many tokens each request in flight at the stop holds (`held_R`: 0 for the others; an ended
  request's length is in the outputs) and the figures; for an MoE model, the experts of the Q prompts' tokens
  (device int16 (Q, P', L, K), P' >= P: a paged cache pads prompts on the left; None for a dense model); and the
  slots at the stop, `kept` (`KeptSlots`: its slot_R names the slot of each of this call's requests in flight), for
  a next call that keeps them (slot cache only; None with a paged cache)."""
  outputs: Outputs
  ended_R: np.ndarray
  held_R: np.ndarray
  stats: EngineStats
  prompt_experts_QxPxLxK: jax.Array | None = None
  kept: KeptSlots | None = None


@functools.partial(jax.jit, static_argnames=("pad",))
def _left_padded(prompt_QxP, valid_QxP, *, pad: int):
  """The prompts with `pad` more padding slots on the left (masked: the same prompts)."""
  return (jnp.pad(prompt_QxP, ((0, 0), (pad, 0))), jnp.pad(valid_QxP.astype(bool), ((0, 0), (pad, 0))))


def _width(needed: int, full: int, backend: str) -> int:
  """Own pages per table row: xla reads every page a row names, so the power of two >= `needed` (capped at
  `full`); pallas reads only the span, so `full`."""
  return full if backend == "pallas" else min(1 << max(needed - 1, 0).bit_length(), full)


def _page_table(engine: EngineSettings, slots: int, prompts: int, prompt_len: int, max_new_tokens: int
                ) -> PageTable:
  """The own pages of a paged cache's slots: sampling.pages (0 = every slot at the longest length) after the
  prompts' pages. Raises ValueError if the pool cannot hold one sequence."""
  c, n = engine.page_size, max_new_tokens
  own_full = -(-(n - 1) // c)  # own pages of a sequence at the longest length
  pool = engine.pages or slots * own_full
  if pool < own_full:
    raise ValueError(f"sampling.pages={pool} cannot hold one sequence: {n - 1} tokens take {own_full} pages of "
                     f"{c} slots. Raise sampling.pages to at least {own_full}.")
  return PageTable(slots=slots, first=prompts * (prompt_len // c), pages=pool, page_size=c)


@functools.partial(jax.jit, static_argnames=("r",), donate_argnums=(0,))
def _renamed(state: Slots, request_S, r: int) -> Slots:
  """Kept slots under this call's request rows `request_S` (r: none, the slot is free and stops)."""
  return state._replace(request_S=request_S, live_S=state.live_S & (request_S < r))


class _Run:
  """The device side of one `decode` call: what every chunk reads (weights, the prompts' prefix, the requests, the
  key), the arrays the chunks pass on (slots, outputs) and the figures of the chunks run. With a paged cache,
  `pages` is the page table the scheduler fills and each chunk lays out. With `kept` slots, their state goes on
  (its request rows renamed to this call's by the first chunk's upload) and only the outputs are new."""

  def __init__(self, graphdef, params, prompt_QxP, prompt_valid_QxP, requests: Requests, rng, *, eos_id: int,
               sampling: Strategy, engine: EngineSettings, slots: int, row_sharding, kept: KeptSlots | None):
    self.graphdef, self.params, self.requests, self.rng = graphdef, params, requests, rng
    self.eos_id, self.sampling, self.engine, self.n = eos_id, sampling, engine, requests.tokens_RxN.shape[1]
    self.chunks = self.slot_steps = self.decoded = self.reprefilled = 0
    self.reprefill_s = 0.0
    self.renamed_S = None  # host int32 (S,): the kept slots' request rows in this call, until the first chunk
    c = engine.page_size
    if kept is not None and c:
      raise ValueError("Kept slots (rollout.carry_kv=True) need the slot cache: a paged cache's prompt pages are "
                       "rebuilt by every call. Set rollout.carry_kv=False (carried sequences re-prefilled) or "
                       "sampling.page_size=0.")
    if c:
      if row_sharding is not None and len(row_sharding(1).device_set) > 1:
        raise ValueError("sampling.page_size > 0 (a paged KV cache) runs on one device per rollout for now: shard "
                         "the rollout over one device (sampling.page_size = 0 keeps the slot cache, which shards).")
      prompt_QxP, prompt_valid_QxP = _left_padded(prompt_QxP, prompt_valid_QxP, pad=-prompt_QxP.shape[1] % c)
    self.p = prompt_QxP.shape[1]
    self.prefix = prefill_prompts(graphdef, params, prompt_QxP, prompt_valid_QxP)
    layers, moe = len(self.prefix.cache.k_layers), self.prefix.experts_QxPxLxK is not None
    if c:
      self.pages = _page_table(engine, slots, prompt_QxP.shape[0], self.p, self.n)
      self.state, self.outputs = slots_starter(slots, 0, layers, None, self.pages.pages, c, moe)(self.prefix, requests)
      self.prefix = self.prefix._replace(cache=None)
    elif kept is not None:
      if kept.p != self.p or kept.state.live_S.shape[0] != slots:
        raise ValueError(f"Kept slots of a call with {kept.p} prompt slots and {kept.state.live_S.shape[0]} slots "
                         f"cannot go on in one with {self.p} and {slots}.")
      self.pages, self.buckets = None, cache_buckets(self.p, self.n, engine.backend)
      self.state, self.outputs = kept.state, _outputs_starter(row_sharding, moe)(self.prefix, requests)
      r = requests.budget_R.shape[0]
      self.renamed_S = np.full(slots, r, np.int32)
      held = np.flatnonzero(np.asarray(kept.slot_R) >= 0)
      self.renamed_S[np.asarray(kept.slot_R)[held]] = held
    else:
      self.pages, self.buckets = None, cache_buckets(self.p, self.n, engine.backend)
      heads = self.prefix.cache.k_layers[0].shape[1]
      start = slots_starter(slots, self.buckets[0], layers, row_sharding, moe=moe, heads=heads)
      self.state, self.outputs = start(self.prefix, requests)

  def _laid_out(self, plan: Plan, fed: int):
    """The chunk's own pages, int32 (S, M), with a paged cache; else None, the slot cache sized to the bucket of
    the longest sequence by the chunk's end."""
    if self.pages is not None:
      full = -(-(self.n - 1) // self.pages.page_size)
      return self.pages.rows(_width(max(self.pages.widest, -(-fed // self.pages.page_size)), full,
                                    self.engine.backend))
    needed = min(max(self.p + plan.longest + self.engine.chunk - 1, self.p + fed), self.buckets[-1])
    size = next(size for size in self.buckets if size >= needed)
    if size != self.state.cache.length:
      self.state = self.state._replace(cache=_resized(self.state.cache, size))
    return None

  def chunk(self, plan: Plan) -> tuple[np.ndarray, int]:
    """Carries `plan` out: one upload (the "admit" crossing), the re-prefills, up to sampling.chunk decode steps
    and one download (the "slots" crossing). Returns the host bool (S,) slots still live and the steps run."""
    fed = fed_bucket(plan.resumed_longest, self.n) if plan.resuming else 0
    own_SxM = self._laid_out(plan, fed)
    admit_S, resume_S, own_SxM, renamed_S = transfer.to_device(
        "admit", (plan.admit_S, plan.resume_S, own_SxM, self.renamed_S), self.state.live_S.sharding)
    if renamed_S is not None:  # kept slots: the same sequences, under this call's request rows
      self.state, self.renamed_S = _renamed(self.state, renamed_S, self.requests.budget_R.shape[0]), None
    if plan.resuming:
      t0 = time.perf_counter()
      self.state = jax.block_until_ready(resume_slots(self.graphdef, self.params, self.state, self.outputs,
                                                      self.prefix, self.requests, resume_S, own_SxM, fed=fed))
      self.reprefill_s += time.perf_counter() - t0
      self.reprefilled += int((plan.resume_S >= 0).sum())
    self.state, self.outputs, steps, tokens = decode_chunk(
        self.graphdef, self.params, self.state, self.outputs, self.prefix, self.requests, admit_S, self.rng, own_SxM,
        steps=self.engine.chunk, eos_id=self.eos_id, sampling=self.sampling,
        attention_backend=self.engine.attention_backend)
    live_S, steps, tokens = transfer.to_host("slots", (self.state.live_S, steps, tokens))
    self.chunks, self.decoded = self.chunks + 1, self.decoded + int(tokens)
    self.slot_steps += len(plan.admit_S) * int(steps)
    return np.array(live_S), int(steps)


def decode(graphdef, params, prompt_QxP, prompt_valid_QxP, requests: Requests, held_R, order, rng, *, eos_id: int,
           sampling: Strategy, engine: EngineSettings, slots: int, stop=None, row_sharding=None,
           on_ended=None, kept: KeptSlots | None = None) -> Decoded:
  """Decodes `requests` (device) by `sampling` on `slots` slots, in chunks of `engine.chunk` decode steps,
  admitting them in `order` (host request indices). Requests with held_R > 0 (host int (R,), the lengths of
  `requests`) hold a partial sequence: they queue first and are re-prefilled under `params` as they take slots;
  the new ones take slots as slots free. Runs until every request in `order` ends, or until `stop(ended_R,
  decode_steps)` (a host predicate on the bool (R,) ended requests and the decode steps run so far, asked after
  each chunk) is true; requests then started keep their tokens so far.
  `on_ended(outputs, ended)`, if given, is called after each chunk in which requests ended, with the device outputs
  and their host indices (at most `slots`), before the next chunk is dispatched (e.g. to score them meanwhile).

  With sampling.page_size = C > 0 the cache is paged (`model.PagedKVCache`, one device): the prompts are
  left-padded to a multiple of C and prefilled into shared prompt pages, and each slot takes pages of a pool of
  sampling.pages (0 = enough for every slot at the longest length) a chunk ahead; when the pool runs short the
  scheduler preempts (`scheduler.Scheduler`).

  `kept` (`KeptSlots`, from an earlier call's `Decoded.kept`, with slot_R naming this call's rows): those slots
  keep their cache and continue their sequences without a re-prefill (the requests hold their tokens so far, held_R
  their counts); new requests take the free slots; the prefix need not hold their prompts. Slot cache only."""
  run = _Run(graphdef, params, prompt_QxP, prompt_valid_QxP, requests, rng, eos_id=eos_id, sampling=sampling,
             engine=engine, slots=slots, row_sharding=row_sharding, kept=kept)
  scheduler = Scheduler(slots=slots, order=order, held_R=held_R, chunk=engine.chunk, max_new_tokens=run.n,
                        pages=run.pages, slot_R=None if kept is None else kept.slot_R)
  while scheduler.pending:
    ended = scheduler.finish(*run.chunk(scheduler.plan()))
    if on_ended is not None and len(ended):
      on_ended(run.outputs, ended)
    if stop is not None and stop(scheduler.ended_R, run.slot_steps // slots):
      break
  stats = EngineStats(chunks=run.chunks, slot_steps=run.slot_steps, decoded=run.decoded, reprefill_s=run.reprefill_s,
                      preempted=scheduler.preempted, pages_peak=scheduler.pages_peak, reprefilled=run.reprefilled)
  slot_R = np.full(len(scheduler.ended_R), -1, np.int64)
  slot_R[scheduler.request_S[scheduler.live_S]] = np.flatnonzero(scheduler.live_S)
  kept_now = None if run.pages is not None else KeptSlots(run.state, slot_R, run.p)
  return Decoded(run.outputs, scheduler.ended_R, scheduler.held(), stats, run.prefix.experts_QxPxLxK, kept_now)


@functools.partial(jax.jit, static_argnames=("group_size",))
def group_prompts(prompt_BxP, prompt_valid_BxP, *, group_size: int):
  """One prompt row per group of `group_size` requests (rows 0, G, 2G, ...), batch-sharded rows kept split over the
  chips, so that each prefills its share (the compile-only check lays out the prefill's prompts through it)."""
  return prompt_BxP[::group_size], prompt_valid_BxP[::group_size]


def generate_continuous(graphdef, params, prompt_BxP, prompt_valid_BxP, rng, *, max_new_tokens: int, eos_id: int,
                        pad_id: int, sampling: Strategy, engine: EngineSettings, group_size: int = 1,
                        slots: int = 0, budget_B=None, row_sharding=None, on_ended=None
                        ) -> tuple[Rollout, EngineStats]:
  """`generate`'s rollout of the B left-padded requests (groups of `group_size` rows sharing a prompt, prefilled
  once), decoded on `slots` slots (0 = B) in chunks of `engine.chunk` steps; see the module docstring.

  budget_B: optional int (B,) device array, each request's token budget (<= max_new_tokens; default max_new_tokens).
  row_sharding: optional hashable function ndim -> sharding of the slot and request arrays along their leading
    axis (e.g. a mesh's batch sharding); None leaves them where jit puts them.
  Returns (the Rollout in request order, EngineStats).
  """
  b, n, g = prompt_BxP.shape[0], max_new_tokens, group_size
  if n < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {n}.")
  if g < 1 or b % g:
    raise ValueError(f"group_size={g} must divide the batch of {b} prompts.")
  requests = new_requests(b, group_size=g, max_new_tokens=n, pad_id=pad_id, budget_B=budget_B,
                          row_sharding=row_sharding)
  prompts = group_prompts(prompt_BxP, prompt_valid_BxP, group_size=g) if g > 1 else (prompt_BxP, prompt_valid_BxP)
  out = decode(graphdef, params, *prompts, requests, np.zeros(b, np.int64), range(b),
               rng, eos_id=eos_id, sampling=sampling, engine=engine, slots=slots or b, row_sharding=row_sharding,
               on_ended=on_ended)
  prompt_experts = out.prompt_experts_QxPxLxK
  if prompt_experts is not None:  # request r's prompt is r // g; a paged cache's padding is on the left
    prompt_experts = _request_prompt_experts(prompt_experts, p=prompt_BxP.shape[1], group_size=g)
  return to_rollout(out.outputs, prompt_experts, prompt_valid_BxP, pad_id=pad_id), out.stats


@functools.partial(jax.jit, static_argnames=("p", "group_size"))
def _request_prompt_experts(experts_QxPxLxK, *, p: int, group_size: int):
  """The experts of each request's prompt tokens, (Q x group_size, p, L, K), from the prefix's."""
  return jnp.repeat(experts_QxPxLxK[:, -p:], group_size, axis=0)
