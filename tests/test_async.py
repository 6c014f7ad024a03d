"""Asynchronous RL (`rl.max_staleness`): generation ahead of the learner, the policy lag it costs, and exact resume
with rollouts in flight."""
import os
import threading
import time

import jax
import pytest

from jaxrl_batch.runtime import streams
from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer
from tests.helpers import ONE_DEVICE, debug_config, straight_and_resumed

K = 2
STALE = {"rl.max_staleness": K, "rl.old_logp": "trainer", "rl.tis_cap": 2.0}  # the decoupled objective, truncated
# 4 steps of 32 rollouts (checkpoints at steps 2 and 4): the first K sample with the base policy, the last two lag by
# K, and the kill at step 3 leaves steps 3 and 4 in flight; 6 steps checked nothing more.
IN_FLIGHT = dict(STALE, sample_budget=128)


@pytest.mark.slow
def test_rollouts_come_from_the_policy_k_steps_before_resume_in_flight_and_do_not_depend_on_placement(
    tmp_path, base_cache, monkeypatch):
  # The uninterrupted run generates on a device of its own (the policy resharded onto it, the rollouts copied back):
  # the runs below, colocated on one device, give its rows.
  split = str(tmp_path / "disaggregated")
  Trainer(debug_config(base_cache, **IN_FLIGHT, **{"rollout_mesh.devices": 1}), split,
          devices=jax.devices()[:2]).run()
  a, b = straight_and_resumed(tmp_path, monkeypatch, lambda: debug_config(base_cache, **IN_FLIGHT), straight=split)
  train = [r for r in a if "reward_mean" in r]
  lags = [min(s, K) for s in range(4)]  # the first K steps sample with the base policy
  assert [r["policy_lag_max"] for r in train] == lags
  assert [r["policy_version"] for r in train] == [s - lag for s, lag in zip(range(4), lags)]
  assert [r["policy_lag_samples_mean"] for r in train] == [32.0 * lag for lag in lags]
  assert all(r["reward_mean"] > 0 and r["grad_norm"] > 0 for r in train)
  assert all(0.0 <= r["overlap_frac"] <= 1.0 and r["rollout_wait_s"] >= 0 and r["update_wait_s"] >= 0 for r in train)
  # Behaviour and proximal policies differ once the sampler lags behind a moved policy, so the importance weights
  # are not all 1 (the first update has lr 0 under warmup: steps 1 and 2 train the base policy).
  gaps = [r["logp_gap_mean"] for r in train]
  assert train[0]["lr"] == 0 and max(gaps[:2]) < 1e-5 < min(gaps[2:])
  # Killed after step 3 (checkpoint at step 2, steps 3 and 4 in flight), rerun on one device: the same rollouts and
  # rows.
  compared = rundir.REPRODUCIBLE_FIELDS + ("policy_lag_max", "policy_version")
  assert rundir.rows_mismatch(a, b, compared) is None
  # Generation in a child process on core 0 (the weights shipped to it, the rollouts back): the same rows, and
  # this process gets all its cores back.
  cores, remote = os.sched_getaffinity(0), str(tmp_path / "process")
  if not cores - {0}:  # e.g. under `taskset -c 0`
    pytest.skip("the rest passed; generation on core 0 needs another core for the learner, and there is none")
  Trainer(debug_config(base_cache, **IN_FLIGHT, **{"rollout_mesh.process_cores": "0"}), remote,
          devices=ONE_DEVICE).run()
  assert rundir.rows_mismatch(a, rundir.read_metrics(remote), compared) is None
  assert os.sched_getaffinity(0) == cores


def test_generation_on_its_own_devices_needs_staleness(tmp_path, base_cache):
  with pytest.raises(ValueError, match="set rl.max_staleness >= 1"):
    Trainer(debug_config(base_cache, **{"rollout_mesh.devices": 1}), str(tmp_path / "run"), devices=jax.devices()[:2])


def test_partial_rollouts_with_staleness_are_refused(tmp_path, base_cache):
  config = debug_config(base_cache, **{"rl.max_staleness": 1, "rollout.partial": True,
                                       "sampling.engine": "continuous"})
  with pytest.raises(ValueError, match="rollout.partial with rl.max_staleness > 0"):
    Trainer(config, str(tmp_path / "run"), devices=ONE_DEVICE)


STREAMED = {"sampling.engine": "continuous", "sampling.slots": 4, "eval_every_samples": 0}
# Under `-n 2` the tests that decode on the streamed engine run in one worker, which compiles its programs once
# (`--dist=loadgroup`).
ON_STREAMED_WORKER = pytest.mark.xdist_group("streamed")


@ON_STREAMED_WORKER
def test_streamed_rewards_are_the_rewards_of_the_rollout(tmp_path, base_cache):
  trainer = Trainer(debug_config(base_cache, **STREAMED), str(tmp_path / "run"), devices=ONE_DEVICE)
  state, _ = trainer.start()
  try:
    exp = trainer.exp
    out = trainer.collector._round(trainer.graphdef, state["params"], 0, 0)
    tokens_BxN, mask_BxN = out["device"].tokens_BxN, out["device"].mask_BxN
    problems = exp.task.train_problems(streams.rl_prompt_seed(exp.member.seed, 0), 0, exp.member.num_prompts)
    problems_B = [p for p in problems for _ in range(exp.member.group_size)]
    after = exp.scorer.score(exp.decode_responses(*jax.device_get((tokens_BxN, mask_BxN))), problems_B)
    assert out["task_rewards_B"].tolist() == after.rewards_B.tolist() and after.rewards_B.any()
  finally:
    trainer.checkpointer.close()
    trainer.exp.scorer.close()


def test_a_reward_that_hangs_for_good_stops_the_run_with_an_error_and_a_rerun_resumes(tmp_path, base_cache):
  """Past scorer.max_hung abandoned threads still running, the run stops with the error (here in step 2, whose
  rewards hang), and a rerun with a reward that returns resumes the run directory."""
  workdir = str(tmp_path / "run")
  config = lambda: debug_config(base_cache, sample_budget=64, **{"task.reward_timeout_s": 0.05})
  trainer = Trainer(config(), workdir, devices=ONE_DEVICE)
  original, release = trainer.exp.task.reward, threading.Event()
  held_out = {id(p) for p in trainer.exp.task.eval_problems()}

  def hanging(completion, problem):
    if id(problem) not in held_out:
      release.wait()
    return original(completion, problem)
  trainer.exp.task.reward = hanging
  trainer.exp.scorer.max_hung = 40  # The first step's 32 hung threads pass; the second step's do not.
  try:
    with pytest.raises(RuntimeError, match=r"reward threads are still running past task.reward_timeout_s=0.05 s "
                                           r"\(at most 40 are tolerated\): the reward function hangs"):
      trainer.run()
  finally:
    release.set()
  # Step 1's row, fetched one step late, is written when step 2 fails. No checkpoint was due yet: a rerun with a
  # reward that returns starts over (the rows of the attempt give way to its own).
  assert [r["step"] for r in rundir.read_metrics(workdir)] == [0, 1]
  Trainer(config(), workdir, devices=ONE_DEVICE).run()
  assert [r["step"] for r in rundir.read_metrics(workdir) if "reward_mean" in r] == [1, 2]


HANG_S = 600


@ON_STREAMED_WORKER
def test_a_reward_past_its_timeout_scores_0_is_counted_and_does_not_stall_the_run(tmp_path, base_cache):
  workdir = str(tmp_path / "run")
  trainer = Trainer(debug_config(base_cache, sample_budget=64, **STREAMED, **{"task.reward_timeout_s": 0.2}), workdir,
                    devices=ONE_DEVICE)
  original, release, hung = trainer.exp.task.reward, threading.Event(), []
  held_out = {id(p) for p in trainer.exp.task.eval_problems()}

  def hanging(completion, problem):  # for 10 minutes: a run that waited on one would take at least that long
    if problem.prompt.startswith("8"):
      hung.append(id(problem) not in held_out)
      release.wait(HANG_S)
    return original(completion, problem)
  trainer.exp.task.reward = hanging
  start = time.monotonic()
  try:
    trainer.run()
  finally:
    release.set()
  rows = [r for r in rundir.read_metrics(workdir) if "reward_mean" in r]
  evals = [r for r in rundir.read_metrics(workdir) if "eval_accuracy" in r]  # at 0 and at the end
  assert len(rows) == 2 and sum(r["reward_timeouts"] for r in rows) == sum(hung) > 0
  assert [r["eval_reward_errors"] for r in evals] == [1, 1]  # one held-out problem starts with 8
  assert all(r["reward_errors"] == 0 and r["reward_mean"] > 0 for r in rows)
  assert time.monotonic() - start < HANG_S
