"""The training loop end to end on the debug config: metrics contract, exact resume, and refused bad input."""
import contextlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs import grpo_arith, ppo_arith
from jaxrl_batch.analysis import runs
from jaxrl_batch.runtime import transfer
from jaxrl_batch.runtime.checkpointing import Checkpointer
from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer
from tests.helpers import ONE_DEVICE, debug_config, launch_train, straight_and_resumed

TRAIN_FIELDS = {"step", "samples", "samples_generated", "wall_s", "rollout_s", "update_s", "lr", "reward_mean",
                "response_len_mean", "response_len_max", "response_lens", "kl", "clip_frac", "clip_frac_low",
                "clip_frac_high", "entropy", "grad_norm",
                "noise_scale", "zero_std_group_frac", "logp_gap_mean", "returns_mean", "kl_coef", "compile_s"}
PPO_FIELDS = TRAIN_FIELDS | {"value_loss", "vf_explained_var", "critic_grad_norm"}
EVAL_FIELDS = {"step", "samples", "wall_s", "eval_accuracy", "eval_reward_errors"}


# Under `-n 2` the tests that read a shared run run in one worker, which trains it once (`--dist=loadgroup`); a test
# that trains the same member runs there too, on the programs compiled for it. The debug member's run (`debug_run`,
# tests/conftest.py) is tests/test_run_safety.py's too: its tests are in the same group.
ON_DEBUG_RUNS_WORKER = pytest.mark.xdist_group("debug_run")
ON_PPO_RUNS_WORKER = pytest.mark.xdist_group("ppo_run")
PPO_KNOBS = {"rl.kl_coef": 0.05, "rl.kl_target": 0.001, "rl.dynamic_sampling": True}


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, base_cache):
  """The directory of one uninterrupted run of the PPO debug member with an adaptive KL penalty and dynamic
  sampling, shared by the tests that only read it."""
  workdir = str(tmp_path_factory.mktemp("ppo_run"))
  Trainer(debug_config(base_cache, ppo_arith, **PPO_KNOBS), workdir, devices=ONE_DEVICE).run()
  return workdir


@ON_DEBUG_RUNS_WORKER
def test_run_writes_the_metrics_contract(debug_run):
  workdir = debug_run
  rows = rundir.read_metrics(workdir)
  train = [r for r in rows if "reward_mean" in r]
  evals = [r for r in rows if "eval_accuracy" in r]
  assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
  assert [r["samples"] for r in train] == [32 * s for s in range(1, 7)]
  assert all(TRAIN_FIELDS <= set(r) for r in train)
  assert all(0.0 <= r["compile_s"] < r["wall_s"] for r in train)
  for r in train:  # the step's lengths, in batch order, agree with its summary fields
    assert len(r["response_lens"]) == 32 and max(r["response_lens"]) == r["response_len_max"]
    assert np.mean(r["response_lens"]) == pytest.approx(r["response_len_mean"])
  assert [r["samples"] for r in evals] == [0, 64, 128, 192]  # eval_every_samples=64, plus the base at 0
  assert all(set(r) == EVAL_FIELDS and 0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
  walls = [r["wall_s"] for r in rows]
  assert walls == sorted(walls)
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  # Debug batch 32 with the sqrt rule around B0=128: lr = 2e-3 * sqrt(32 / 128).
  assert saved["derived"]["lr"] == pytest.approx(1e-3)
  assert "sqrt rule" in saved["derived"]["lr_derivation"]
  assert saved["config"]["batch_size"] == 32
  assert Checkpointer(os.path.join(workdir, "checkpoints")).latest_step() == 6


@ON_DEBUG_RUNS_WORKER
def test_a_run_stops_at_the_accuracy_it_reaches_and_stays_finished(tmp_path, base_cache, debug_run):
  """stop_at_accuracy at the debug member's third evaluation (the first above the base's): the run ends there with a
  checkpoint and the rows of the full run so far; a rerun trains nothing; the study and the analysis count it
  finished; a bar lifted to 0 resumes it to the budget."""
  full = debug_run
  accuracies = [r["eval_accuracy"] for r in rundir.read_metrics(full) if "eval_accuracy" in r]
  assert accuracies[2] > max(accuracies[:2]), accuracies  # The member learns by 128 samples (its 4th step).
  stopped = str(tmp_path / "stopped")
  config = debug_config(base_cache, stop_at_accuracy=accuracies[2], checkpoint_every_samples=96)
  Trainer(config, stopped, devices=ONE_DEVICE).run()
  rows = rundir.read_metrics(stopped)
  assert [r["samples"] for r in rows] == [0, 32, 64, 64, 96, 128, 128] and rows[-1]["eval_accuracy"] == accuracies[2]
  assert rundir.rows_mismatch(rows, rundir.read_metrics(full)[:len(rows)]) is None
  assert Checkpointer(os.path.join(stopped, "checkpoints")).latest_step() == 4
  Trainer(config, stopped, devices=ONE_DEVICE).run()
  assert len(rundir.read_metrics(stopped)) == len(rows)
  assert rundir.is_finished(stopped, config) and not rundir.is_finished(stopped, debug_config(base_cache))
  run = runs.read_run(stopped, "stopped")
  assert run.finished and run.stopped_early and not runs.read_run(full, "full").stopped_early
  Trainer(debug_config(base_cache, stop_at_accuracy=0.0), stopped, devices=ONE_DEVICE).run()
  assert [r["samples"] for r in rundir.read_metrics(stopped) if "eval_accuracy" in r] == [0, 64, 128, 192]


@pytest.mark.parametrize("module, overrides, straight", [
    pytest.param(grpo_arith, {}, "debug_run", marks=ON_DEBUG_RUNS_WORKER, id="grpo"),
    pytest.param(ppo_arith, PPO_KNOBS, "ppo_run", marks=ON_PPO_RUNS_WORKER, id="ppo_adaptive_kl_dynamic_sampling"),
])
def test_interrupted_run_resumes_to_the_same_result(tmp_path, base_cache, monkeypatch, request, module, overrides,
                                                    straight):
  straight = request.getfixturevalue(straight)  # the uninterrupted run of the member, shared
  a, b = straight_and_resumed(tmp_path, monkeypatch, lambda: debug_config(base_cache, module, **overrides), straight)
  train = [r for r in a if "reward_mean" in r]
  assert all(r["reward_mean"] > 0 for r in train)  # it learns: a resume that lost run state would change the rows
  # The first training row of each session includes compilation; the analysis leaves its seconds out.
  assert [r["cold"] for r in a if "reward_mean" in r] == [True] + [False] * 5
  assert [r["cold"] for r in b if "reward_mean" in r] == [True, False, True, False, False, False]
  assert rundir.rows_mismatch(a, b) is None


PARTIAL = {"sampling.engine": "continuous", "sampling.slots": 4, "sampling.chunk": 2, "rollout.partial": True}
# Growable pages of 2 tokens, 3 of them for 4 slots: a debug response of 3+ tokens (answer, EOS) outgrows its first
# page while the others hold the rest, so some sequences get preempted.
PAGED_SHORT = {"sampling.page_size": 2, "sampling.pages": 3, "rollout.carry_kv": False}  # paged: re-prefilled


def test_partial_rollouts_carried_across_a_kill_resume_to_the_same_result(tmp_path, base_cache, monkeypatch):
  # Rewards that spread within groups (the debug policy earns 0 on the task), so the policy moves between steps
  # and the carried sequences continue under new weights.
  from jaxrl_batch.tasks.arithmetic import ArithmeticTask
  monkeypatch.setattr(ArithmeticTask, "reward", lambda self, completion, problem: len(completion) % 3 / 2)
  # Re-prefilled carried sequences resume exactly (kept caches are re-prefilled once: tests/test_partial_carry_kv.py).
  config = lambda: debug_config(base_cache, **PARTIAL, **{"rollout.carry_kv": False})
  a, b = straight_and_resumed(tmp_path, monkeypatch, config)
  train = [r for r in a if "reward_mean" in r]
  assert [r["samples"] for r in train] == [32 * s for s in range(1, 7)]  # B rollouts trained per step
  assert train[1]["carried_over"] > 0  # the checkpoint at step 2 holds sequences in flight
  assert max(r["policy_lag_max"] for r in train) >= 1 and max(r["partial_frac"] for r in train) > 0
  assert all(r["grad_norm"] > 0 for r in train)
  partial = ("policy_lag_mean", "policy_lag_max", "partial_frac", "carried_over", "useful_token_frac")
  assert rundir.rows_mismatch(a, b, rundir.REPRODUCIBLE_FIELDS + partial) is None


@ON_DEBUG_RUNS_WORKER
def test_incompatible_workdir_is_refused_without_changes(tmp_path, base_cache, debug_run):
  workdir = str(tmp_path / "run")
  shutil.copytree(debug_run, workdir)  # a run of debug_config(base_cache)
  before = open(os.path.join(workdir, "metrics.jsonl")).read()
  with pytest.raises(ValueError, match=r"different config \(optim.base_lr: 0.002 -> 0.001"):
    Trainer(debug_config(base_cache, **{"optim.base_lr": 1e-3}), workdir, devices=ONE_DEVICE).run()
  assert open(os.path.join(workdir, "metrics.jsonl")).read() == before


@ON_DEBUG_RUNS_WORKER
def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(tmp_path, base_cache, poison_update):
  poison_update(4, lambda state, metrics: (state, dict(metrics, loss=np.float32("nan"))))
  workdir = str(tmp_path / "run")
  with pytest.raises(FloatingPointError, match=r"at step 4\. Stopped before saving: .*\(step 2\) holds finite state"):
    Trainer(debug_config(base_cache), workdir, devices=ONE_DEVICE).run()
  assert max(r["step"] for r in rundir.read_metrics(workdir)) == 3  # The poisoned update 4 is never logged.
  assert Checkpointer(os.path.join(workdir, "checkpoints")).latest_step() == 2


@pytest.mark.parametrize("overrides, message", [
    ({"batch_size": 30}, "batch_size=30 must be a positive multiple of group_size=4"),
    ({"group_size": 1, "batch_size": 32}, "needs group_size >= 2"),
    ({"rl.estimator": "gae"}, "needs a critic, which only algo='ppo' trains"),
    ({"rl.mini_batches": 3}, "divisible by rl.mini_batches=3"),
    ({"rl.tis_cap": 2.0}, "needs rl.old_logp='trainer'"),
    ({"rl.kl_in": "reward", "rl.kl_coef": 0.1}, "set rl.kl_estimator='k1'"),
    ({"rl.loss_agg": "seq_mean"}, "rl.loss_agg='seq_mean'"),
    ({"rl.clip_ratio": 0.2}, "Unknown config.rl keys \\['clip_ratio'\\]"),
    ({"micro_batch_size": 12}, "micro_batch_size=12 must divide the mini-batch"),
    ({"model.vocab_size": 8}, "has 18 ids .* but the model's embedding has only 8 rows"),
    ({"model.num_kv_heads": 3}, "multiple of model.num_kv_heads=3"),
    ({"optim.lr_rule": "cubic"}, "cubic"),
    ({"eval_every_samples": -64}, r"eval_every_samples=-64 must be >= 0"),
    ({"checkpoint_every_samples": -1}, r"checkpoint_every_samples=-1 must be >= 0"),
    ({"log_every_steps": 0}, r"log_every_steps=0 must be >= 1"),
    ({"stop_at_accuracy": 1.5}, r"stop_at_accuracy=1.5: the held-out accuracy"),
    ({"stop_at_accuracy": 0.5, "eval_every_samples": 0}, r"so eval_every_samples must be > 0"),
    ({"tokenizer_path": "/nonexistent/x.model"}, "x.model"),
    ({"rollout.partial": True}, "set sampling.engine='continuous'"),
    ({"sampling.engine": "paged"}, "sampling.engine must be one of"),
    ({**PARTIAL, "rl.dynamic_sampling": True}, "does not combine with rl.dynamic_sampling"),
])
def test_bad_config_is_refused_before_anything_is_written(tmp_path, base_cache, overrides, message):
  workdir = tmp_path / "run"
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    Trainer(debug_config(base_cache, **overrides), str(workdir), devices=ONE_DEVICE)
  assert not workdir.exists()


def test_a_rollout_cache_that_cannot_fit_is_refused_with_its_size(tmp_path, base_cache, monkeypatch):
  from jaxrl_batch.runtime import memory
  monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 20)  # 1 MiB free
  workdir = tmp_path / "run"
  config = debug_config(base_cache, **{"sampling.engine": "continuous", "sampling.slots": 4096})
  with pytest.raises(ValueError, match=r"needs \d+\.\d+ GiB per device \(4096 sequences x .* 0\.00 GiB free\. Lower "
                                       "sampling.slots"):
    Trainer(config, str(workdir), devices=ONE_DEVICE)
  assert not workdir.exists()
  Trainer(debug_config(base_cache, **{"sampling.engine": "continuous", "sampling.slots": 4}), str(workdir),
          devices=ONE_DEVICE)  # 4 slots fit in 1 MiB
  paged = {"sampling.engine": "continuous", "sampling.slots": 4096, "sampling.page_size": 4}
  with pytest.raises(ValueError, match=r"needs \d+\.\d+ GiB per device \(\d+ prompt pages \+ 100000 pages for 4096 "
                                       r"slots.* Lower sampling.pages or sampling.slots"):
    Trainer(debug_config(base_cache, **paged, **{"sampling.pages": 100_000}), str(workdir), devices=ONE_DEVICE)
  Trainer(debug_config(base_cache, **paged, **{"sampling.pages": 64}), str(workdir),
          devices=ONE_DEVICE)  # 4096 slots on a pool of 64 pages fit in 1 MiB


def test_a_paged_cache_on_a_sharded_batch_is_refused(tmp_path, base_cache):
  config = debug_config(base_cache, **{"sampling.engine": "continuous", "sampling.page_size": 4})
  config.mesh.data = -1
  with pytest.raises(ValueError, match="paged KV cache.*shards the batch over 8: set sampling.page_size=0"):
    Trainer(config, str(tmp_path / "run"))


def test_batch_must_split_over_data_parallel_devices(tmp_path, base_cache):
  config = debug_config(base_cache, batch_size=36)
  config.mesh.data = -1
  with pytest.raises(ValueError, match="divisible by the data-parallel device count 8"):
    Trainer(config, str(tmp_path / "run"))


@pytest.mark.slow
def test_cli_rejects_unknown_keys_and_wrong_types(tmp_path, base_cache):
  for flag, message in (("--config.optim.lrr=1", "optim has no field 'lrr'; did you mean lr, lr_rule?"),
                        ("--config.batch_size=abc", "--config.batch_size=abc: invalid literal for int()")):
    proc = launch_train(tmp_path / "run", base_cache, flag)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and message in out and "Traceback" not in out, out[-2000:]
  assert not (tmp_path / "run").exists()


@ON_PPO_RUNS_WORKER
def test_ppo_trains_actor_and_critic(ppo_run):
  workdir = ppo_run
  train = [r for r in rundir.read_metrics(workdir) if "reward_mean" in r]
  assert "grad_norm" not in train[0] and train[0]["value_loss"] >= 0  # Critic warm-up: the actor is frozen.
  assert all(PPO_FIELDS <= set(r) for r in train[1:])
  assert all(r["updates"] == 4 for r in train)  # 2 epochs x 2 mini-batches.
  saved = json.load(open(os.path.join(workdir, "config.json")))["derived"]
  assert saved["critic_lr"] > 0 and "sqrt" in saved["critic_lr_derivation"]


def test_dynamic_sampling_overlong_and_adaptive_kl_in_the_reward(tmp_path, base_cache):
  workdir = str(tmp_path / "knobs")
  overrides = {"rl.dynamic_sampling": True, "rl.max_sampling_rounds": 2, "rl.overlong": "mask",
               "rl.kl_coef": 0.05, "rl.kl_in": "reward", "rl.kl_estimator": "k1", "rl.kl_target": 0.01,
               "rl.old_logp": "trainer", "rl.tis_cap": 2.0, "rl.estimator": "rloo", "rl.loss_agg": "constant"}
  Trainer(debug_config(base_cache, **overrides), workdir, devices=ONE_DEVICE).run()
  train = [r for r in rundir.read_metrics(workdir) if "reward_mean" in r]
  for r in train:
    assert r["samples_generated"] >= r["samples"]
    assert r["sampling_rounds"] in (1, 2)
  # Trained rows per step: informative groups, less truncated responses; generated: 32 per round.
  assert train[-1]["samples"] >= 192 and train[-1]["samples_generated"] == 32 * sum(r["sampling_rounds"] for r in train)
  coefs = [r["kl_coef"] for r in train]
  assert coefs[0] == 0.05 and len(set(coefs)) > 1  # The controller moves the coefficient.


@contextlib.contextmanager
def named_transfers_only():
  """Transfers outside a named crossing (`runtime.transfer`) raise: host-to-device ones by the transfer guard,
  device-to-host reads (which the guard does not see on CPU) by a check on every array read."""
  from jax._src import array as jax_array  # pylint: disable=import-outside-toplevel
  value = jax_array.ArrayImpl._value

  def guarded(self):
    if transfer.current() is None:
      raise RuntimeError("a device-to-host read outside a named transfer")
    return value.fget(self)

  jax_array.ArrayImpl._value = property(guarded)
  try:
    with jax.transfer_guard("disallow_explicit"):
      yield
  finally:
    jax_array.ArrayImpl._value = value


@pytest.mark.parametrize("module, overrides", [
    pytest.param(grpo_arith, {}, marks=ON_DEBUG_RUNS_WORKER),  # the debug member's programs
    (ppo_arith, {}),  # 2 epochs x 2 mini-batches; the first step trains the critic only.
    (grpo_arith, {"rl.dynamic_sampling": True, "rl.kl_coef": 0.05, "rl.kl_target": 0.01, "rl.mini_batches": 2}),
    (grpo_arith, {"sampling.engine": "continuous", "sampling.slots": 4}),
    (grpo_arith, PARTIAL),
    (grpo_arith, {**PARTIAL, **PAGED_SHORT}),
], ids=["grpo", "ppo", "grpo_dynamic_adaptive_kl", "grpo_continuous", "grpo_partial", "grpo_partial_paged_short"])
def test_steps_cross_only_the_named_transfers(tmp_path, base_cache, module, overrides):
  config = debug_config(base_cache, module, sample_budget=128, eval_every_samples=0, checkpoint_every_samples=0,
                        **overrides)
  trainer = Trainer(config, str(tmp_path / "run"), devices=ONE_DEVICE)
  trainer.exp.task.reward = lambda completion, problem: len(completion) % 3 / 2  # Spread for the advantages.
  state, progress = trainer.start()
  transfer.reset()
  try:
    with named_transfers_only():
      trainer.loop(state, progress)
  finally:
    trainer.checkpointer.close()
  counts = transfer.counts()
  rows = [r for r in rundir.read_metrics(str(tmp_path / "run")) if "reward_mean" in r]
  steps, rounds = len(rows), sum(r["sampling_rounds"] for r in rows)
  assert steps == 4 and all(r["reward_std"] > 0 for r in rows)
  # Per sampling round: prompts up, tokens down; per step: rewards up, the KL coefficient and mini-batch orders up,
  # metrics down; evaluation at 0 and at the end.
  expected = dict(prompts=rounds, tokens=rounds, rewards=steps, kl_orders=steps, metrics=steps, eval=2, checkpoint=1)
  if "sampling.engine" in overrides:  # one small upload (admissions, re-prefills) and download per chunk
    chunks = sum(r["rollout_chunks"] for r in rows)
    expected.update(admit=chunks, slots=chunks)
    if "rollout.partial" not in overrides:  # streamed rewards: after a chunk where rows end, their ids up, rows down
      ended = counts.get("ended", 0)
      assert rounds < ended <= chunks  # some round scored in parts, while decoding went on
      expected.update(ended=ended, responses=ended, lengths=expected.pop("tokens"))
    if "rollout.partial" in overrides:
      assert sum(r["carried_over"] > 0 for r in rows[:-1]) > 0
    if "sampling.pages" in overrides:
      assert sum(r["preempted"] for r in rows) > 0
  assert counts == expected


def test_a_policy_collapsed_to_uniform_is_warned_about(tmp_path, base_cache, caplog):
  Trainer(debug_config(base_cache, sample_budget=96, **{"optim.lr": 1e6}), str(tmp_path / "run"),
          devices=ONE_DEVICE).run()
  warnings = [r.message for r in caplog.records if "entropy of a uniform policy" in r.message]
  assert len(warnings) == 1 and "lower optim.base_lr" in warnings[0]
