"""A rollout's schedule and time from its response lengths: the continuous and static engines on schedules computed
by hand, the static engine's own slot-step count, and the real continuous engine's chunks, slot-steps, tokens and
cache lengths on a tiny model whose lengths are forced by per-request budgets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.predict import engine_time
from jaxrl_batch.predict.engine_time import Segment
from jaxrl_batch.sampling import EngineSettings, Strategy, continuous, generate_continuous, static_stats
from tests.helpers import one_device_model, tiny_config

V, PAD, N, P = 24, 0, 6, 2  # prompts of P = 2 slots: cache buckets (4, 7) (`cache_buckets(2, 6, "xla")`)


def test_continuous_schedule_computed_by_hand():
  # 2 slots, chunks of 2, lengths 5, 2, 2, 3 (decode steps 4, 1, 1, 2: the first token comes from the prefill).
  # Chunk 1: requests 0, 1 take the slots; 2 steps (request 1 ends after one, its slot idles to the chunk's end);
  #   the longest holds 1 token, by the chunk's end 1 + 2 - 1 = 2 fed: slot 2 + 2 = 4 fits bucket 4.
  # Chunk 2: request 2 takes slot 1; request 0 (3 tokens) needs 2 + 3 + 1 = 6 slots: bucket 7; both end.
  # Chunk 3: request 3 takes slot 0 (free slots fill in order); 2 steps, bucket 4 again (the cache shrinks).
  got = engine_time.continuous([5, 2, 2, 3], slots=2, chunk=2, max_new_tokens=N, prompt_len=P, group_size=2)
  assert got.segments == (Segment(steps=2, rows=2, live=2, cache_length=4, admitted=2),
                          Segment(steps=2, rows=2, live=2, cache_length=7, admitted=1),
                          Segment(steps=2, rows=2, live=1, cache_length=4, admitted=1))
  assert (got.chunks, got.decode_steps, got.slot_steps, got.decoded, got.prefills) == (3, 6, 12, 8, (2,))
  time = got.time(lambda rows, length: 1e-3 * rows * length, lambda prompts: 0.5 * prompts)
  assert time.decode_s == pytest.approx(1e-3 * (2 * 2 * 4 + 2 * 2 * 7 + 2 * 2 * 4)) and time.prefill_s == 1.0
  assert time.seconds == pytest.approx(1.060)
  once = got.time(lambda rows, length: 1e-3 * rows * length, lambda prompts: 0.5 * prompts,
                  segment_seconds=lambda rows, length: 1e-3 * length)  # a setup per chunk: 3 chunks
  assert once.decode_s == pytest.approx(time.decode_s + 1e-3 * (4 + 7 + 4))


def test_a_request_of_one_token_takes_a_slot_for_a_chunk_of_no_steps():
  got = engine_time.continuous([1, 1, 3], slots=2, chunk=4, max_new_tokens=N, prompt_len=P)
  assert [(s.steps, s.live, s.admitted) for s in got.segments] == [(0, 0, 2), (2, 1, 1)]
  once = got.time(lambda rows, length: 0.0, lambda prompts: 0.0, segment_seconds=lambda rows, length: 1.0)
  assert once.decode_s == 1.0  # the chunk of no steps runs no decode loop

def test_a_carried_sequence_is_re_prefilled_first_and_its_tokens_widen_the_cache():
  # Request 0 holds 3 of its 5 tokens: it takes slot 0 first, re-prefilled with fed_bucket(3, 6) = 2 tokens a row;
  # the cache must hold P + 3 + 2 - 1 = 6 slots: bucket 7. Then request 2 takes the freed slot 0 for one step.
  got = engine_time.continuous([5, 2, 2], slots=2, chunk=2, max_new_tokens=N, prompt_len=P, held_R=[3, 0, 0])
  assert got.segments == (Segment(2, 2, 2, 7, admitted=1, resumed=1, fed=2), Segment(1, 2, 1, 4, admitted=1))
  assert (got.decoded, got.ended, got.held) == (4, (True,) * 3, (0, 0, 0))
  time = got.time(lambda rows, length: 1.0, lambda prompts: 0.0, lambda rows, fed, length: 10.0 * fed)
  assert (time.decode_s, time.reprefill_s) == (3.0, 20.0)
  with pytest.raises(ValueError, match="reprefill_seconds"):
    got.time(lambda rows, length: 1.0, lambda prompts: 0.0)


def test_static_schedule_computed_by_hand_and_its_slot_steps_as_the_engine_counts_them():
  # One block of 4 rows decodes to its longest (5 tokens: 4 steps): steps 1, 2 feed slots 2, 3 (bucket 4), steps
  # 3, 4 slots 4, 5 (bucket 7), where only the row of 5 tokens still decodes.
  got = engine_time.static([5, 2, 2, 3], max_new_tokens=N, prompt_len=P, group_size=2)
  assert got.segments == (Segment(2, 4, 4, 4, 4), Segment(2, 4, 1, 7, 0))
  assert (got.chunks, got.decode_steps, got.decoded, got.prefills) == (0, 4, 8, (2,))
  blocks = engine_time.static([5, 2, 2, 3], max_new_tokens=N, prompt_len=P, slots=2, group_size=2)
  assert blocks.segments == (Segment(2, 2, 2, 4, 2), Segment(2, 2, 1, 7, 0), Segment(2, 2, 2, 4, 2))
  assert blocks.prefills == (1, 1)
  lengths = np.random.default_rng(0).integers(1, N + 1, 24)
  for block in (4, 8, 24):
    assert engine_time.static(lengths, max_new_tokens=N, prompt_len=P, slots=block).slot_steps == \
        static_stats(lengths, block).slot_steps


def test_lengths_outside_the_budget_are_refused():
  with pytest.raises(ValueError, match="response lengths"):
    engine_time.continuous([0, 3], slots=2, chunk=2, max_new_tokens=N, prompt_len=P)


@pytest.fixture(scope="module")
def tiny():
  return one_device_model(tiny_config(vocab_size=V), seed=3)


@pytest.mark.parametrize("slots,chunk", [(3, 2), (2, 4)])
def test_continuous_schedule_equals_the_real_engines_figures(tiny, monkeypatch, slots, chunk):
  n = 12  # buckets (4, 8, 13)
  rng = np.random.default_rng(slots)
  budget = rng.integers(1, n + 1, 8)
  prompt = jnp.asarray(np.repeat(rng.integers(3, V, (4, P)), 2, axis=0), jnp.int32)
  lengths_chunks = []
  original = continuous.decode_chunk

  def spy(graphdef, params, state, *args, **kwargs):  # the cache each chunk's decode steps read
    lengths_chunks.append(state.cache.length)
    return original(graphdef, params, state, *args, **kwargs)

  monkeypatch.setattr(continuous, "decode_chunk", spy)
  engine = EngineSettings(engine="continuous", chunk=chunk, attention_backend="xla")
  rollout, stats = generate_continuous(*tiny, prompt, jnp.ones_like(prompt, bool), jax.random.key(0),
                                       max_new_tokens=n, eos_id=V, pad_id=PAD, sampling=Strategy(temperature=1.0),
                                       engine=engine, group_size=2, slots=slots, budget_B=jnp.asarray(budget))
  np.testing.assert_array_equal(rollout.lengths_B, budget)  # EOS out of the vocabulary: each ends at its budget
  got = engine_time.continuous(budget, slots=slots, chunk=chunk, max_new_tokens=n, prompt_len=P, group_size=2)
  assert (got.chunks, got.slot_steps, got.decoded) == (stats.chunks, stats.slot_steps, stats.decoded)
  assert [s.cache_length for s in got.segments] == lengths_chunks
  assert len(set(lengths_chunks)) > 1  # the cache grew or shrank between chunks


@pytest.mark.parametrize("carry_kv", [False, True])
def test_a_stopped_call_and_the_next_one_with_the_carried_sequences_equal_the_real_engines(tiny, monkeypatch,
                                                                                           carry_kv):
  # A partial rollout's two engine calls: the first stops after 4 decode steps, the second continues the sequences
  # still in flight (re-prefilled, or with carry_kv kept in their slots) and the requests not started.
  n, slots, chunk = 12, 3, 2
  budget = np.random.default_rng(5).integers(2, n + 1, 8)
  prompt = jnp.asarray(np.repeat(np.random.default_rng(5).integers(3, V, (4, P)), 2, axis=0), jnp.int32)
  lengths_chunks = []
  original = continuous.decode_chunk
  monkeypatch.setattr(continuous, "decode_chunk", lambda graphdef, params, state, *args, **kwargs: (
      lengths_chunks.append(state.cache.length) or original(graphdef, params, state, *args, **kwargs)))
  engine = EngineSettings(engine="continuous", chunk=chunk, attention_backend="xla")
  requests = continuous.new_requests(8, group_size=2, max_new_tokens=n, pad_id=PAD, budget_B=jnp.asarray(budget))
  kwargs = dict(eos_id=V, sampling=Strategy(temperature=1.0), engine=engine, slots=slots)
  args = (*tiny, prompt[::2], jnp.ones_like(prompt[::2], bool))
  stop = lambda ended_R, decode_steps: decode_steps >= 4
  first = continuous.decode(*args, requests, np.zeros(8), range(8), jax.random.key(0), stop=stop, **kwargs)
  predicted = engine_time.continuous(budget, slots=slots, chunk=chunk, max_new_tokens=n, prompt_len=P, group_size=2,
                                     stop=stop)
  held, rest = first.held_R, [i for i in range(8) if not first.ended_R[i]]
  assert (held > 0).any() and len(rest) > (held > 0).sum()  # sequences carried, and requests never started
  carried = requests._replace(tokens_RxN=first.outputs.tokens_RxN, logprobs_RxN=first.outputs.logprobs_RxN,
                              lengths_R=jnp.asarray(held, jnp.int32))
  kept = first.kept if carry_kv else None
  second = continuous.decode(*args, carried, held, rest, jax.random.key(0), kept=kept, **kwargs)
  predicted_next = engine_time.continuous(budget, slots=slots, chunk=chunk, max_new_tokens=n, prompt_len=P,
                                          group_size=2, held_R=held, order=rest,
                                          slot_R=None if kept is None else kept.slot_R)
  for got, real in ((predicted, first), (predicted_next, second)):
    assert (got.chunks, got.slot_steps, got.decoded) == (real.stats.chunks, real.stats.slot_steps, real.stats.decoded)
    assert sum(s.resumed for s in got.segments) == real.stats.reprefilled
    assert got.ended == tuple(real.ended_R.tolist()) and got.held == tuple(real.held_R.tolist())
  assert (second.stats.reprefilled > 0) != carry_kv and second.ended_R[rest].all()
  assert [s.cache_length for s in predicted.segments + predicted_next.segments] == lengths_chunks
