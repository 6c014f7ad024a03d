"""The continuous engine against the static one: greedy tokens and log-probs equal under refills at different times
(per-request budgets), sampled tokens independent of the slot count and the chunk, the cache sized to the longest
live sequence (grown and shrunk), per-request budgets, one upload and one download per chunk, no recompiles, the
Pallas backend, and the same rollout on a mesh of 8 fake devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.model import Transformer
from jaxrl_batch.runtime import sharding, transfer
from jaxrl_batch.sampling import (EngineSettings, Strategy, continuous, generate, generate_continuous, rollout,
                                  static_stats)
from tests.helpers import assert_same_rollout, one_device_model, tiny_config

V, EOS, PAD, N = 24, 2, 0, 12
CFG = tiny_config(vocab_size=V)
GREEDY, SAMPLED = Strategy(temperature=0.0), Strategy(temperature=1.0)


@pytest.fixture(scope="module")
def tiny():
  return one_device_model(CFG, seed=3)


def _requests(seed, prompts=4, group=2, width=5):
  """`prompts` random left-padded prompts of 1..width tokens (no EOS or PAD), each repeated `group` times, and a
  per-request token budget in [1, N]."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, width + 1, prompts)
  valid = np.arange(width)[None, :] >= width - lengths[:, None]
  prompt = np.where(valid, rng.integers(3, V, (prompts, width)), PAD)
  budget = rng.integers(1, N + 1, prompts * group)
  return (jnp.repeat(jnp.asarray(prompt, jnp.int32), group, axis=0), jnp.repeat(jnp.asarray(valid), group, axis=0),
          jnp.asarray(budget, jnp.int32))


def _static(tiny, prompt, valid, budget, sampling, group=2):
  return generate(*tiny, prompt, valid, jax.random.key(0), max_new_tokens=N, eos_id=EOS, pad_id=PAD,
                  sampling=sampling, group_size=group, budget_B=budget, attention_backend="xla")


def _engine(chunk, backend="xla", page_size=0, pages=0):
  return EngineSettings(engine="continuous", chunk=chunk, attention_backend=backend, page_size=page_size, pages=pages)


def _continuous(tiny, prompt, valid, budget, sampling, engine, slots, group=2):
  return generate_continuous(*tiny, prompt, valid, jax.random.key(0), max_new_tokens=N, eos_id=EOS, pad_id=PAD,
                             sampling=sampling, engine=engine, group_size=group, slots=slots, budget_B=budget)


@pytest.mark.parametrize("slots,chunk", [(1, 16), (3, 2), (5, 1), (8, 4)])
@pytest.mark.slow
def test_greedy_tokens_equal_the_static_engine_whatever_slots_and_chunk(tiny, slots, chunk):
  prompt, valid, budget = _requests(0)
  expected = _static(tiny, prompt, valid, budget, GREEDY)
  assert len(set(np.asarray(expected.lengths_B).tolist())) > 3  # slots end, and are refilled, at different times
  got, stats = _continuous(tiny, prompt, valid, budget, GREEDY, _engine(chunk), slots)
  assert_same_rollout(got, expected)
  lengths = np.asarray(expected.lengths_B)
  assert stats.decoded == (lengths - 1).sum() and stats.slot_steps >= stats.decoded
  assert np.all(lengths <= np.asarray(budget))


@pytest.mark.slow
def test_sampled_tokens_do_not_depend_on_slots_or_chunk(tiny):
  prompt, valid, budget = _requests(1)
  # 3 slots, chunks of 2: the programs the sampled test_sequences_stopped_and_resumed_continue_as_if_never_stopped
  # compiles too (compiled once in this module).
  runs = [_continuous(tiny, prompt, valid, budget, SAMPLED, _engine(chunk), slots)[0]
          for slots, chunk in ((8, 16), (3, 2), (1, 1))]
  for other in runs[1:]:
    assert_same_rollout(other, runs[0])
  # EOS ends sequences before their budget in some rows: the engine stops a row at EOS, and marks it untruncated.
  truncated, lengths = np.asarray(runs[0].truncated_B), np.asarray(runs[0].lengths_B)
  np.testing.assert_array_equal(truncated, np.asarray(runs[0].tokens_BxN)[np.arange(8), lengths - 1] != EOS)


@pytest.mark.slow
def test_pallas_backend_gives_the_xla_tokens(tiny):
  # 3 slots, chunks of 2: the xla run's programs are those of
  # test_greedy_tokens_equal_the_static_engine_whatever_slots_and_chunk[3-2].
  prompt, valid, budget = _requests(2)
  runs = [_continuous(tiny, prompt, valid, budget, GREEDY, _engine(2, backend), 3)[0]
          for backend in ("xla", "pallas")]
  assert_same_rollout(runs[1], runs[0], rtol=2e-5)


@pytest.mark.slow
def test_the_cache_follows_the_longest_live_sequence(tiny, monkeypatch):
  # The cache grows to the long request's bucket, then shrinks back once only short requests remain.
  sizes = []
  chunk = continuous.decode_chunk

  def logged(graphdef, params, state, *args, **kwargs):
    sizes.append(state.cache.length)
    return chunk(graphdef, params, state, *args, **kwargs)

  monkeypatch.setattr(continuous, "decode_chunk", logged)
  # One long request (budget N) then 15 short ones (budget 2: one decode step each), 2 slots, chunk 1.
  prompt, valid, _ = _requests(3, prompts=16, group=1, width=5)
  budget = jnp.asarray([N] + [2] * 15, jnp.int32)
  _continuous(tiny, prompt, valid, budget, GREEDY, _engine(1), 2, group=1)
  p = prompt.shape[1]
  assert sizes[0] == 8 and max(sizes) == p + N - 1  # cache_buckets(5, 12): (8, 16)
  assert set(sizes) <= {8, p + N - 1}
  assert sizes[-1] == 8 and sizes.index(p + N - 1) > 0  # grown for the long request, shrunk after it


@pytest.mark.slow
def test_one_upload_and_one_download_per_chunk_and_no_recompiles(tiny):
  prompt, valid, budget = _requests(4)
  _continuous(tiny, prompt, valid, budget, SAMPLED, _engine(3), 3)
  compiled = continuous.decode_chunk._cache_size()
  transfer.reset()
  prompt, valid, budget = _requests(5)
  _, stats = _continuous(tiny, prompt, valid, budget, SAMPLED, _engine(3), 3)
  assert transfer.counts() == {"admit": stats.chunks, "slots": stats.chunks}
  assert continuous.decode_chunk._cache_size() == compiled


@pytest.mark.slow
def test_static_blocks_and_their_figures(tiny):
  prompt, valid, budget = _requests(6)
  static = EngineSettings(attention_backend="xla")
  whole = _static(tiny, prompt, valid, budget, GREEDY)
  blocks, stats = rollout(*tiny, prompt, valid, jax.random.key(0), max_new_tokens=N, eos_id=EOS, pad_id=PAD,
                          sampling=GREEDY, engine=static, group_size=2, slots=4, budget_B=budget)
  assert stats is None
  assert_same_rollout(blocks, whole)
  lengths = np.asarray(whole.lengths_B)
  figures = static_stats(lengths, 4)
  assert figures.slot_steps == 4 * (lengths[:4].max() - 1) + 4 * (lengths[4:].max() - 1)
  assert figures.decoded == (lengths - 1).sum()
  with pytest.raises(ValueError, match="multiple of group_size"):
    rollout(*tiny, prompt, valid, jax.random.key(0), max_new_tokens=N, eos_id=EOS, pad_id=PAD, sampling=GREEDY,
            engine=static, group_size=2, slots=3)


@pytest.mark.slow
def test_a_mesh_of_8_devices_gives_the_single_device_rollout(tiny):
  prompt, valid, budget = _requests(7, prompts=8, group=2)
  expected, _ = _continuous(tiny, prompt, valid, budget, SAMPLED, _engine(4), 8)
  mesh = sharding.make_mesh(8, 1, 1)
  graphdef, params = sharding.create_sharded(lambda: Transformer(CFG, nnx.Rngs(3)), mesh, sharding.DEFAULT_RULES)
  rows = sharding.batch_sharding(mesh, 2)
  with jax.set_mesh(mesh):
    got, _ = generate_continuous(graphdef, params, jax.device_put(prompt, rows), jax.device_put(valid, rows),
                                 jax.random.key(0), max_new_tokens=N, eos_id=EOS, pad_id=PAD, sampling=SAMPLED,
                                 engine=_engine(4), group_size=2, slots=8, budget_B=budget,
                                 row_sharding=lambda ndim: sharding.batch_sharding(mesh, ndim))
  assert not got.tokens_BxN.sharding.is_fully_replicated  # the requests stay split over the 8 devices
  assert_same_rollout(got, expected, rtol=2e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow
def test_sequences_stopped_and_resumed_continue_as_if_never_stopped(tiny, temperature):
  # Stop after two chunks, then decode again with the partial sequences carried over (re-prefilled from their
  # prompt and tokens): the same tokens as one uninterrupted call, the carried ones first into the slots.
  prompt, valid, budget = _requests(8)
  sampling, engine = Strategy(temperature=temperature), _engine(2)
  requests = continuous.new_requests(8, group_size=2, max_new_tokens=N, pad_id=PAD, budget_B=budget)
  expected, _ = _continuous(tiny, prompt, valid, budget, sampling, engine, 3)
  args = (*tiny, prompt[::2], valid[::2])
  chunks = []
  first = continuous.decode(*args, requests, np.zeros(8), range(8), jax.random.key(0), eos_id=EOS, sampling=sampling,
                            engine=engine, slots=3, stop=lambda ended, steps: chunks.append(steps) or len(chunks) == 2)
  held = first.held_R
  assert 0 < (held > 0).sum() <= 3 and not first.ended_R.all()
  out = first.outputs
  lengths = jnp.where(jnp.asarray(held > 0), jnp.asarray(held, jnp.int32), 0)
  carried = requests._replace(tokens_RxN=out.tokens_RxN, logprobs_RxN=out.logprobs_RxN, lengths_R=lengths)
  rest = [i for i in range(8) if not first.ended_R[i]]
  second = continuous.decode(*args, carried, held, rest, jax.random.key(0), eos_id=EOS, sampling=sampling,
                             engine=engine, slots=3)
  assert second.ended_R[rest].all()
  merged = jax.tree.map(lambda a, b: jnp.where(jnp.asarray(first.ended_R).reshape((8,) + (1,) * (a.ndim - 1)), a, b),
                        out, second.outputs)
  assert_same_rollout(continuous.to_rollout(merged, pad_id=PAD), expected, rtol=2e-5)


@pytest.mark.parametrize("page_size,slots", [(2, 3), (4, 5), (16, 8)])
@pytest.mark.slow
def test_a_paged_cache_gives_the_static_engine_tokens(tiny, page_size, slots):
  # Prompts of 5 slots are left-padded to a multiple of the page; the samples of a prompt share its pages.
  prompt, valid, budget = _requests(9)
  expected = _static(tiny, prompt, valid, budget, GREEDY)
  got, stats = _continuous(tiny, prompt, valid, budget, GREEDY, _engine(2, page_size=page_size), slots)
  assert_same_rollout(got, expected, rtol=2e-5)
  assert stats.preempted == 0 and 0 < stats.pages_peak <= slots * -(-(N - 1) // page_size)


@pytest.mark.slow
def test_a_short_pool_preempts_and_re_prefills_to_the_same_tokens(tiny):
  # 10 pages of 2 slots hold two sequences at the longest length (11 tokens): 4 slots cannot all grow, so the latest
  # started sequences give their pages back and resume later from their tokens and keys while other slots decode.
  prompt, valid, _ = _requests(10)
  budget = jnp.full((8,), N, jnp.int32)
  ample, _ = _continuous(tiny, prompt, valid, budget, SAMPLED, _engine(2, page_size=2), 4)
  short, stats = _continuous(tiny, prompt, valid, budget, SAMPLED, _engine(2, page_size=2, pages=10), 4)
  assert stats.preempted > 0 and stats.pages_peak <= 10 and stats.reprefill_s > 0
  assert_same_rollout(short, ample, rtol=2e-5)
  with pytest.raises(ValueError, match="cannot hold one sequence"):
    _continuous(tiny, prompt, valid, budget, GREEDY, _engine(2, page_size=2, pages=5), 4)


@pytest.mark.slow
def test_the_paged_pallas_kernel_gives_the_xla_tokens(tiny):
  # 5 slots, chunks of 2, pages of 4: the xla run's programs are test_a_paged_cache_gives_the_static_engine_tokens'.
  prompt, valid, budget = _requests(11)
  runs = [_continuous(tiny, prompt, valid, budget, GREEDY, _engine(2, backend, page_size=4), 5)[0]
          for backend in ("xla", "pallas")]
  assert_same_rollout(runs[1], runs[0], rtol=2e-5)


@pytest.mark.slow
def test_paged_sequences_stopped_and_resumed_continue_as_if_never_stopped(tiny):
  # 4 slots, chunks of 2, pages of 2: the expected run's programs are those of the ample pool of
  # test_a_short_pool_preempts_and_re_prefills_to_the_same_tokens.
  prompt, valid, budget = _requests(12)
  engine = _engine(2, page_size=2)
  requests = continuous.new_requests(8, group_size=2, max_new_tokens=N, pad_id=PAD, budget_B=budget)
  expected, _ = _continuous(tiny, prompt, valid, budget, SAMPLED, engine, 4)
  args = (*tiny, prompt[::2], valid[::2])
  first = continuous.decode(*args, requests, np.zeros(8), range(8), jax.random.key(0), eos_id=EOS, sampling=SAMPLED,
                            engine=engine, slots=4, stop=lambda ended, steps: steps >= 4)
  held = first.held_R
  assert 0 < (held > 0).sum() and not first.ended_R.all()
  out = first.outputs
  carried = requests._replace(tokens_RxN=out.tokens_RxN, logprobs_RxN=out.logprobs_RxN,
                              lengths_R=jnp.asarray(held, jnp.int32))
  rest = [i for i in range(8) if not first.ended_R[i]]
  second = continuous.decode(*args, carried, held, rest, jax.random.key(0), eos_id=EOS, sampling=SAMPLED,
                             engine=engine, slots=4)
  merged = jax.tree.map(lambda a, b: jnp.where(jnp.asarray(first.ended_R).reshape((8,) + (1,) * (a.ndim - 1)), a, b),
                        out, second.outputs)
  assert_same_rollout(continuous.to_rollout(merged, pad_id=PAD), expected, rtol=2e-5)


def test_a_paged_cache_refuses_what_it_cannot_do(tiny):
  with pytest.raises(ValueError, match="engine='continuous'"):
    EngineSettings(page_size=4)
  with pytest.raises(ValueError, match=">= 0"):
    EngineSettings(engine="continuous", page_size=4, pages=-1)
  prompt, valid, budget = _requests(13, prompts=8)
  mesh = sharding.make_mesh(8, 1, 1)
  with pytest.raises(ValueError, match="one device"):
    generate_continuous(*tiny, prompt, valid, jax.random.key(0), max_new_tokens=N, eos_id=EOS, pad_id=PAD,
                        sampling=GREEDY, engine=_engine(2, page_size=4), group_size=2, slots=8, budget_B=budget,
                        row_sharding=lambda ndim: sharding.batch_sharding(mesh, ndim))
