"""Asynchronous RL (`rl.max_staleness`): generation ahead of the learner, the policy lag it costs, and exact resume
with rollouts in flight."""
import jax
import pytest

from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer
from tests.test_trainer import _straight_and_resumed, debug_config

ONE_DEVICE = jax.devices()[:1]
K = 2
STALE = {"rl.max_staleness": K, "rl.old_logp": "trainer", "rl.tis_cap": 2.0}  # the decoupled objective, truncated


def test_rollouts_come_from_the_policy_k_steps_before_resume_in_flight_and_do_not_depend_on_placement(
    tmp_path, base_cache, monkeypatch):
  a, b = _straight_and_resumed(tmp_path, monkeypatch, lambda: debug_config(base_cache, **STALE))
  train = [r for r in a if "reward_mean" in r]
  lags = [min(s, K) for s in range(6)]  # the first K steps sample with the base policy
  assert [r["policy_lag_max"] for r in train] == lags
  assert [r["policy_version"] for r in train] == [s - lag for s, lag in zip(range(6), lags)]
  assert [r["policy_lag_samples_mean"] for r in train] == [32.0 * lag for lag in lags]
  assert all(r["reward_mean"] > 0 and r["grad_norm"] > 0 for r in train)
  assert all(0.0 <= r["overlap_frac"] <= 1.0 and r["rollout_wait_s"] >= 0 and r["update_wait_s"] >= 0 for r in train)
  # Behaviour and proximal policies differ once the sampler lags behind a moved policy, so the importance weights
  # are not all 1 (the first update has lr 0 under warmup: steps 1 and 2 train the base policy).
  gaps = [r["logp_gap_mean"] for r in train]
  assert train[0]["lr"] == 0 and max(gaps[:2]) < 1e-5 < min(gaps[2:])
  # Killed after step 3 (checkpoint at step 2, steps 3 and 4 in flight), rerun: the same rollouts and rows.
  compared = rundir.REPRODUCIBLE_FIELDS + ("policy_lag_max", "policy_version")
  assert rundir.rows_mismatch(a, b, compared) is None
  # Generation on a device of its own (the policy resharded onto it, the rollouts copied back): the same rows.
  split = str(tmp_path / "disaggregated")
  Trainer(debug_config(base_cache, **STALE, **{"rollout_mesh.devices": 1}), split, devices=jax.devices()[:2]).run()
  assert rundir.rows_mismatch(a, rundir.read_metrics(split), compared) is None


def test_generation_on_its_own_devices_needs_staleness(tmp_path, base_cache):
  with pytest.raises(ValueError, match="set rl.max_staleness >= 1"):
    Trainer(debug_config(base_cache, **{"rollout_mesh.devices": 1}), str(tmp_path / "run"), devices=jax.devices()[:2])


def test_partial_rollouts_with_staleness_are_refused(tmp_path, base_cache):
  config = debug_config(base_cache, **{"rl.max_staleness": 1, "rollout.partial": True,
                                       "sampling.engine": "continuous"})
  with pytest.raises(ValueError, match="rollout.partial with rl.max_staleness > 0"):
    Trainer(config, str(tmp_path / "run"), devices=ONE_DEVICE)
