"""Packed micro-batches (`rl.packing`): the plan is first-fit decreasing and round-trips, attention stays within a
sequence, and the update, the trainer's log-probs, the reference, the critic and the warm start are those of the
padded batch, on one device and on eight."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.base import algo_config
from jaxrl_batch.model import sequence_logits
from jaxrl_batch.rl.forward import logprobs_and_values, reference_cfg
from jaxrl_batch.rl.packing import Packing, first_fit_decreasing, pack, plan, unpack
from jaxrl_batch.runtime import sharding
from jaxrl_batch.train.sft import sft_step
from tests.close import assert_close, assert_trees_close
from tests.helpers import (B, N, ONE_DEVICE, P, PPO, assert_metrics_close, debug_config, loss_scale, make_batch,
                           one_step, setup)

T = P + N
PACKED = Packing(rows=2, length=2 * T)  # rows of two padded rows' length: most hold two or three sequences


def test_first_fit_decreasing_places_the_longest_first_into_the_first_row_with_room():
  bins, offsets = first_fit_decreasing(jnp.array([3, 9, 5, 5, 2, 6, 4, 1]), 10)
  # Longest first: 9 -> row 0; 6 -> row 1; 5 -> row 2; 5 -> row 2 (5+5); 4 -> row 1 (6+4); 3 -> row 3; 2 -> row 3
  # (3+2); 1 -> row 0 (9+1).
  assert bins.tolist() == [3, 0, 2, 2, 3, 1, 1, 0]
  assert offsets.tolist() == [0, 0, 0, 5, 3, 0, 6, 9]


def test_packing_round_trips_and_counts_the_micro_batches_it_fills():
  batch = make_batch()
  valid = np.asarray(batch.valid_BxT)
  the_plan = plan(batch.valid_BxT, packing=PACKED)
  x = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T) + 1
  packed = pack(the_plan, x)
  assert packed.shape == (B // PACKED.rows, PACKED.rows, PACKED.length)
  np.testing.assert_array_equal(unpack(the_plan, packed), np.where(valid, x, 0))
  assert int((packed > 0).sum()) == valid.sum()  # every token once
  rows_used = int((np.asarray(packed) > 0).any(-1).sum())
  assert int(the_plan.num_micro) == -(-rows_used // PACKED.rows) and rows_used <= B // 2
  segment_ids, positions = the_plan.segment_ids_MxRxL, the_plan.positions_MxRxL
  for row_ids, row_pos in zip(*(np.asarray(x).reshape(-1, PACKED.length) for x in (segment_ids, positions))):
    for s in set(row_ids) - {0}:  # each sequence is contiguous, its positions 0..n-1
      cols = np.flatnonzero(row_ids == s)
      assert (np.diff(cols) == 1).all() and row_pos[cols].tolist() == list(range(len(cols)))


@pytest.mark.slow
def test_attention_stays_within_each_packed_sequence():
  """Logits of the packed rows equal those of each sequence alone (padded)."""
  batch = make_batch(2)
  models, state = setup(sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE), algo_config())
  padded = sequence_logits(models.graphdef, state["params"], batch.tokens_BxT, batch.valid_BxT)
  the_plan = plan(batch.valid_BxT, packing=PACKED)
  segment_ids, positions = the_plan.segment_ids_MxRxL, the_plan.positions_MxRxL
  tokens = pack(the_plan, batch.tokens_BxT)
  packed = jax.vmap(lambda t, s, p: sequence_logits(models.graphdef, state["params"], t, s > 0, s, p))(
      tokens, segment_ids, positions)
  valid = np.asarray(batch.valid_BxT)
  assert_close(np.asarray(unpack(the_plan, packed))[valid], np.asarray(padded)[valid], 1e-5)


AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"]


@pytest.mark.parametrize("cfg", [
    *(algo_config(loss_agg=agg, loss_agg_constant=9.0 if agg == "constant" else 0.0, entropy_coef=0.01)
      for agg in AGGREGATIONS),
    algo_config(old_logp="trainer", tis_cap=1.5, ratio_level="sequence", loss_agg="seq_mean_token_mean"),
    dataclasses.replace(PPO, loss_agg="seq_mean_token_mean"),
    dataclasses.replace(PPO, share_backbone=True, vf_coef=0.5),
], ids=[*AGGREGATIONS, "grpo_tis_gspo", "ppo_separate", "ppo_shared"])
@pytest.mark.slow
def test_packed_update_equals_the_padded_one_on_one_device_and_eight(cfg, request):
  """Every config on one device; on eight (data, fsdp, tensor = 2, 2, 2) too for two of them (the packing does not
  depend on the loss)."""
  eight = request.node.callspec.id in ("seq_mean_token_mean", "ppo_separate")
  batch = make_batch(4)
  rng = np.random.default_rng(3)
  batch = batch._replace(sampler_logp_BxT=batch.old_logp_BxT + jnp.asarray(rng.normal(0, 0.2, (B, T)), jnp.float32)
                         * batch.loss_mask_BxT)
  one = sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE)
  models, before, want, want_metrics = one_step(one, 2, batch, cfg)
  scales = loss_scale(models, before["params"], batch, cfg, want_metrics)
  skipped = eight and jax.device_count() < 8
  for mesh in (one, sharding.make_mesh(2, 2, 2)) if eight and not skipped else (one,):
    _, _, got, metrics = one_step(mesh, 2, batch, cfg, packing=PACKED)
    assert_trees_close(got, want, 5e-6)
    assert_metrics_close(metrics, want_metrics, scales)
  assert want_metrics["grad_norm"] > 0
  if skipped:
    pytest.skip("the one-device part passed; the eight-device part needs 8 devices (tests/conftest.py fakes them)")


@pytest.mark.parametrize("cfg", [algo_config(old_logp="trainer"), PPO, dataclasses.replace(PPO, share_backbone=True)],
                         ids=["trainer_logp", "critic_separate", "critic_shared"])
@pytest.mark.slow
def test_trainer_logprobs_values_and_reference_over_packed_rows_equal_the_padded_ones(cfg):
  batch = make_batch(5)
  mesh = sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE)
  models, state = setup(mesh, cfg)
  args = (state["params"], state.get("critic"), batch.tokens_BxT, batch.valid_BxT, batch.loss_mask_BxT)
  with jax.set_mesh(mesh):
    padded = logprobs_and_values(*args, models=models, cfg=cfg, need_policy=True)
    packed = logprobs_and_values(*args, models=models, cfg=cfg, need_policy=True, packing=PACKED)
    ref_cfg = dataclasses.replace(reference_cfg(cfg), temperature=0.7)
    ref = [logprobs_and_values(state["params"], None, *args[2:], models=models, cfg=ref_cfg, packing=p)[0]
           for p in (None, PACKED)]
  assert_trees_close(packed, padded, 5e-6)
  assert_close(ref[0], ref[1], 5e-6)
  assert np.abs(np.asarray(packed[0])).sum() > 0 and (packed[1] is None) == (not cfg.critic)


@pytest.mark.slow
def test_packed_warm_start_step_equals_the_padded_one():
  batch = make_batch(6)
  mesh = sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE)
  tx = optax.adam(1e-2)
  outs = []
  for packing in (None, PACKED):
    models, state = setup(mesh, algo_config())
    with jax.set_mesh(mesh):
      outs.append(sft_step(state["params"], tx.init(state["params"]), batch.tokens_BxT, batch.valid_BxT,
                           batch.loss_mask_BxT, graphdef=models.graphdef, tx=tx, packing=packing))
  assert_trees_close(outs[0], outs[1], 1e-5)
  assert float(outs[0][2]) > 0


def test_a_run_with_packed_micro_batches_gives_the_padded_run_rows(tmp_path, base_cache):
  from jaxrl_batch.train import rundir
  from jaxrl_batch.train.trainer import Trainer
  runs = []
  for name, overrides in (("padded", {}), ("packed", {"micro_batch_tokens": 96})):
    trainer = Trainer(debug_config(base_cache, sample_budget=64, **overrides), str(tmp_path / name), devices=ONE_DEVICE)
    assert (trainer.exp.packing is None) == (name == "padded")
    trainer.run()
    assert trainer.learner.packing == trainer.exp.packing
    runs.append(rundir.read_metrics(str(tmp_path / name)))
  # Every field to 1e-4 of itself; the loss, a sum of terms about 1 in size (unit-std advantages, token weights summing
  # to 1) that can cancel to near 0, with a floor of 1e-5 too, far above float32 rounding at that size.
  assert rundir.rows_mismatch(*runs, [f for f in rundir.REPRODUCIBLE_FIELDS if f != "loss"], rtol=1e-4) is None
  loss = [[np.nan if r.get("loss") is None else r["loss"] for r in rows] for rows in runs]
  assert_close(loss[1], loss[0], 2e-4)
  assert all(r["grad_norm"] > 0 for r in runs[1] if "grad_norm" in r)
  with pytest.raises(ValueError, match=r"micro_batch_tokens=8 packs rows of 12 tokens"):
    Trainer(debug_config(base_cache, micro_batch_tokens=8), str(tmp_path / "small"), devices=ONE_DEVICE)
