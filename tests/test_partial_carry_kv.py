"""Partial rollouts that keep their KV cache across calls (`rollout.carry_kv`, `continuous.KeptSlots`): with the same
weights a stopped and continued decode gives the uninterrupted call's tokens without re-prefilling anything (on one
device and split over 8); with new weights the kept sequences go on from the cache the old weights wrote; the
collector records every token's policy, and a restore re-prefills once; old configs and paged caches."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.config import migrate
from jaxrl_batch.model import Transformer
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling import EngineSettings, Strategy, continuous, generate_continuous
from jaxrl_batch.train.trainer import Trainer
from tests.close import assert_close
from tests.helpers import ONE_DEVICE, assert_same_rollout, debug_config, one_device_model, tiny_config

V, EOS, PAD, N, SLOTS = 24, 2, 0, 12, 3
CFG = tiny_config(vocab_size=V)
ENGINE = EngineSettings(engine="continuous", chunk=2, attention_backend="xla")


@pytest.fixture(scope="module")
def tiny():
  return one_device_model(CFG, seed=3)


def _requests(seed=8, prompts=4, group=2, width=5):
  """Left-padded prompts of 1..width tokens, each `group` times, token budgets in [N / 2, N] (sequences outlive a
  few chunks)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, width + 1, prompts)
  valid = np.arange(width)[None, :] >= width - lengths[:, None]
  prompt = np.where(valid, rng.integers(3, V, (prompts, width)), PAD)
  budget = rng.integers(N // 2, N + 1, prompts * group)
  return (jnp.repeat(jnp.asarray(prompt, jnp.int32), group, axis=0), jnp.repeat(jnp.asarray(valid), group, axis=0),
          jnp.asarray(budget, jnp.int32))


def _stopped_then_continued(tiny, second_params, sampling, keep: bool):
  """Decodes 8 requests on 3 slots, stops after two chunks, then decodes the rest with `second_params` from a
  request table in reverse order (the kept slots' rows renamed), the sequences in flight kept in their slots
  (`keep`) or re-prefilled. Returns (first, second) `Decoded`, the second's outputs and figures in the first's
  request order."""
  graphdef, params = tiny
  prompt, valid, budget = _requests()
  requests = continuous.new_requests(8, group_size=2, max_new_tokens=N, pad_id=PAD, budget_B=budget)
  chunks = []
  first = continuous.decode(graphdef, params, prompt[::2], valid[::2], requests, np.zeros(8), range(8),
                            jax.random.key(0), eos_id=EOS, sampling=sampling, engine=ENGINE, slots=SLOTS,
                            stop=lambda ended, steps: chunks.append(steps) or len(chunks) == 2)
  held, out = first.held_R, first.outputs
  assert 0 < (held > 0).sum() <= SLOTS and not first.ended_R.all()
  carried = requests._replace(tokens_RxN=out.tokens_RxN, logprobs_RxN=out.logprobs_RxN,
                              lengths_R=jnp.asarray(held, jnp.int32))
  order = np.arange(8)[::-1]  # row j of the second call is request order[j] (its own inverse)
  rest = [j for j in range(8) if not first.ended_R[order[j]]]
  kept = first.kept._replace(slot_R=first.kept.slot_R[order]) if keep else None
  second = continuous.decode(graphdef, second_params, prompt[::2], valid[::2],
                             jax.tree.map(lambda x: x[order], carried), held[order], rest, jax.random.key(0),
                             eos_id=EOS, sampling=sampling, engine=ENGINE, slots=SLOTS, kept=kept)
  assert second.ended_R[rest].all()
  return first, dataclasses.replace(second, outputs=jax.tree.map(lambda x: x[order], second.outputs))


def _merged(first, second):
  return jax.tree.map(lambda a, b: jnp.where(jnp.asarray(first.ended_R).reshape((8,) + (1,) * (a.ndim - 1)), a, b),
                      first.outputs, second.outputs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow
def test_kept_slots_with_the_same_weights_give_the_uninterrupted_tokens_without_re_prefill(tiny, temperature):
  sampling = Strategy(temperature=temperature)
  prompt, valid, budget = _requests()
  expected, _ = generate_continuous(*tiny, prompt, valid, jax.random.key(0), max_new_tokens=N, eos_id=EOS, pad_id=PAD,
                                    sampling=sampling, engine=ENGINE, group_size=2, slots=SLOTS, budget_B=budget)
  first, second = _stopped_then_continued(tiny, tiny[1], sampling, keep=True)
  assert (first.kept.slot_R >= 0).sum() == (first.held_R > 0).sum()  # every sequence in flight named with its slot
  assert second.stats.reprefilled == 0 and second.stats.reprefill_s == 0.0
  assert_same_rollout(continuous.to_rollout(_merged(first, second), pad_id=PAD), expected, rtol=5e-7)


@pytest.mark.slow
def test_kept_slots_split_over_a_mesh_of_8_devices_continue_as_if_never_stopped():
  mesh = sharding.make_mesh(8, 1, 1)
  graphdef, params = sharding.create_sharded(lambda: Transformer(CFG, nnx.Rngs(3)), mesh, sharding.DEFAULT_RULES)
  rows = lambda ndim: sharding.batch_sharding(mesh, ndim)
  prompt, valid, budget = _requests(prompts=8)
  sampling, key, chunks = Strategy(temperature=1.0), jax.random.key(0), []
  common = dict(eos_id=EOS, sampling=sampling, engine=ENGINE, slots=8, row_sharding=rows)
  with jax.set_mesh(mesh):
    expected, _ = generate_continuous(graphdef, params, jax.device_put(prompt, rows(2)), jax.device_put(valid, rows(2)),
                                      key, max_new_tokens=N, pad_id=PAD, group_size=2, budget_B=budget, **common)
    requests = continuous.new_requests(16, group_size=2, max_new_tokens=N, pad_id=PAD, budget_B=budget,
                                       row_sharding=rows)
    first = continuous.decode(graphdef, params, prompt[::2], valid[::2], requests, np.zeros(16), range(16), key,
                              stop=lambda ended, steps: chunks.append(steps) or len(chunks) == 2, **common)
    held, out = first.held_R, first.outputs
    carried = requests._replace(tokens_RxN=out.tokens_RxN, logprobs_RxN=out.logprobs_RxN,
                                lengths_R=jax.device_put(jnp.asarray(held, jnp.int32), rows(1)))
    rest = [i for i in range(16) if not first.ended_R[i]]
    second = continuous.decode(graphdef, params, prompt[::2], valid[::2], carried, held, rest, key, kept=first.kept,
                               **common)
  assert (held > 0).sum() > 0 and second.stats.reprefilled == 0
  assert not second.outputs.tokens_RxN.sharding.is_fully_replicated
  merged = jax.tree.map(lambda a, b: jnp.where(jnp.asarray(first.ended_R).reshape((16,) + (1,) * (a.ndim - 1)), a, b),
                        out, second.outputs)
  assert_same_rollout(continuous.to_rollout(merged, pad_id=PAD), expected, rtol=2e-5)


@pytest.mark.slow
def test_kept_slots_continue_on_the_old_weights_cache_under_new_weights(tiny):
  # New weights: a re-prefill recomputes the carried sequences' keys/values, a kept slot reuses the old ones, so the
  # first token decoded after the stop has another log-prob; the tokens before the stop are the same either way.
  graphdef, params = tiny
  new_params = jax.tree.map(lambda x: x * 1.5 if x.ndim == 2 else x, params)
  first, kept = _stopped_then_continued(tiny, new_params, Strategy(temperature=0.0), keep=True)
  _, refilled = _stopped_then_continued(tiny, new_params, Strategy(temperature=0.0), keep=False)
  assert kept.stats.reprefilled == 0 and refilled.stats.reprefilled > 0
  held = first.held_R
  rows = np.flatnonzero(held > 0)
  lp_kept, lp_refilled = (np.asarray(d.outputs.logprobs_RxN) for d in (kept, refilled))
  tokens_kept, tokens_first = np.asarray(kept.outputs.tokens_RxN), np.asarray(first.outputs.tokens_RxN)
  lengths_kept = np.asarray(kept.outputs.lengths_R)
  for i in rows:
    np.testing.assert_array_equal(tokens_kept[i, :held[i]], tokens_first[i, :held[i]])
    assert lengths_kept[i] > held[i]  # it went on decoding
  after = [lp_kept[i, held[i]] - lp_refilled[i, held[i]] for i in rows]
  assert max(abs(x) for x in after) > 1e-3, after


def test_kept_slots_need_the_slot_cache(tiny):
  prompt, valid, budget = _requests()
  requests = continuous.new_requests(8, group_size=2, max_new_tokens=N, pad_id=PAD, budget_B=budget)
  paged = EngineSettings(engine="continuous", chunk=2, attention_backend="xla", page_size=2)
  kept = continuous.KeptSlots(None, np.full(8, -1), 6)
  with pytest.raises(ValueError, match="Set rollout.carry_kv=False"):
    continuous.decode(*tiny, prompt[::2], valid[::2], requests, np.zeros(8), range(8), jax.random.key(0),
                      eos_id=EOS, sampling=Strategy(temperature=0.0), engine=paged, slots=SLOTS, kept=kept)


PARTIAL = {"sampling.engine": "continuous", "sampling.slots": 4, "sampling.chunk": 2, "rollout.partial": True,
           "rollout.carry_kv": True}


@pytest.mark.slow
def test_the_collector_keeps_caches_across_updates_and_a_restore_re_prefills_once(tmp_path, base_cache):
  trainer = Trainer(debug_config(base_cache, **PARTIAL), str(tmp_path / "run"), devices=ONE_DEVICE)
  state, _ = trainer.start()
  try:
    collector, graphdef = trainer.collector, trainer.graphdef
    params = [state["params"], jax.tree.map(lambda x: x * 1.01, state["params"])]  # a weight update between steps
    stats = [collector.collect(graphdef, params[step], step)[1] for step in range(2)]
    assert stats[0].carried_over > 0 and stats[1].reprefill_s == 0  # carried into step 1, kept, not re-prefilled
    assert stats[1].partial_frac > 0 and stats[1].policy_lag_max == 1  # sequences sampled by both policies
    saved = json.loads(json.dumps(collector.state_dict()))  # a checkpoint's run state: no cache
    assert saved["carried"]
    kept, kept_stats = collector.collect(graphdef, params[1], 2)
    collector.load_state_dict(saved)
    restored, restored_stats = collector.collect(graphdef, params[1], 2)
    # Under the weights that wrote the kept caches, the re-prefill on restore writes them again: the same rollouts.
    assert kept_stats.reprefill_s == 0 and restored_stats.reprefill_s > 0
    for name in ("tokens_BxN", "mask_BxN", "rewards_B"):
      np.testing.assert_array_equal(getattr(kept, name), getattr(restored, name))
    assert_close(kept.logprobs_BxN, restored.logprobs_BxN, 1e-5)
    assert restored_stats.policy_lag_mean == kept_stats.policy_lag_mean
  finally:
    trainer.checkpointer.close()


def test_kept_caches_with_a_paged_cache_are_refused_before_anything_is_written(tmp_path, base_cache):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match="Set rollout.carry_kv=False"):
    Trainer(debug_config(base_cache, **PARTIAL, **{"sampling.page_size": 2}), str(workdir), devices=ONE_DEVICE)
  assert not workdir.exists()


def test_a_config_json_from_before_carry_kv_reads_what_its_run_did():
  # Partial rollouts re-prefilled their carried sequences; without them the field does nothing: the default, so
  # such runs resume under the recipe's config.
  assert migrate.complete({"rollout": {"partial": True}})["rollout"]["carry_kv"] is False
  assert migrate.complete({"rollout": {"partial": False}})["rollout"]["carry_kv"] is True
  assert migrate.complete({})["rollout"]["carry_kv"] is True
