"""Nothing a run directory holds is lost: the workdir lock, checkpoint integrity and fallback, the metrics log's torn
tail and missing checkpoints, and SIGTERM saving a real `launch.train` process."""
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import grpo_arith, ppo_arith
from jaxrl_batch.config import migrate
from jaxrl_batch.config.args import apply_overrides
from jaxrl_batch.runtime.checkpointing import Checkpointer, NoUsableCheckpoint, all_finite
from jaxrl_batch.study.runner import run_study
from jaxrl_batch.train import rundir
from jaxrl_batch.train.branch import Origin
from jaxrl_batch.train.trainer import Trainer
from jaxrl_batch.train.workdir_lock import WorkdirBusy, WorkdirLock
from tests.helpers import ROOT, launch_train

ONE = jax.devices()[:1]
# Under -n 2 the tests that train the debug member run in one worker: the finished run is trained once (for
# tests/test_trainer.py's tests of the same group too: `debug_run`, tests/conftest.py), and the programs of the member
# are compiled once.
ON_DEBUG_MEMBERS_WORKER = pytest.mark.xdist_group("debug_run")
ONE_DEVICE = ("mesh.data=1",)


def config(base_cache, sample_budget=192, overrides=(), family=grpo_arith):
  """6 steps of 32 rollouts by default; checkpoints at steps 2, 4, 6 (the last two kept)."""
  c = family.get_config("debug")
  apply_overrides(c, [*ONE_DEVICE, f"sft.cache_dir={base_cache}", f"sample_budget={sample_budget}", *overrides])
  return c


@pytest.fixture(scope="module")
def finished_run(debug_run):
  """A finished debug run's directory (copy it before changing anything): `config(base_cache)`'s, which is
  `helpers.debug_config(base_cache)`, trained once for this module and tests/test_trainer.py (tests/conftest.py)."""
  return debug_run


def copy_of(run_dir, tmp_path):
  target = str(tmp_path / "run")
  shutil.copytree(run_dir, target)
  return target


def snapshot(run_dir):
  """{relative path: bytes} of every file under `run_dir` except the lock."""
  out = {}
  for root, _, files in os.walk(run_dir):
    for name in files:
      path = os.path.join(root, name)
      if name != rundir.LOCK:
        out[os.path.relpath(path, run_dir)] = open(path, "rb").read()
  return out


# -- the workdir lock ------------------------------------------------------------------------------------------------

def test_a_second_holder_is_refused_naming_the_first(tmp_path):
  with WorkdirLock(str(tmp_path)):
    with pytest.raises(WorkdirBusy, match=rf"in use by pid {os.getpid()} on host .* \(alive, since"):
      WorkdirLock(str(tmp_path)).acquire()
  with WorkdirLock(str(tmp_path)):  # released on exit: free again
    pass


@pytest.mark.slow
def test_a_killed_holders_lock_is_free_at_once(tmp_path):
  holder = subprocess.Popen([sys.executable, "-c", (
      "import sys, time; from jaxrl_batch.train.workdir_lock import WorkdirLock; "
      f"WorkdirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)")],
      cwd=ROOT, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "held"
  with pytest.raises(WorkdirBusy, match=f"pid {holder.pid}"):
    WorkdirLock(str(tmp_path)).acquire()
  holder.kill()
  holder.wait()
  with WorkdirLock(str(tmp_path)):  # the lock file names a dead pid; the kernel released its lock
    pass


@ON_DEBUG_MEMBERS_WORKER
def test_trainer_and_study_skip_a_held_workdir_without_touching_it(finished_run, base_cache, tmp_path):
  workdir = copy_of(finished_run, tmp_path)
  before = snapshot(workdir)
  with WorkdirLock(workdir):
    with pytest.raises(WorkdirBusy, match="use another --workdir"):
      Trainer(config(base_cache), workdir, devices=ONE).run()
  assert snapshot(workdir) == before
  study = tmp_path / "study"
  member = study / "sqrt_b32_s0"
  os.makedirs(member)
  with WorkdirLock(str(member)):
    run_study("configs/grpo_arith.py:debug", str(study), [32], ["sqrt"], 1,
              [*ONE_DEVICE, f"sft.cache_dir={base_cache}", "sample_budget=64"], devices=ONE)
  assert os.listdir(member) == [rundir.LOCK]  # skipped: nothing written


# -- checkpoints -----------------------------------------------------------------------------------------------------

def test_restore_falls_back_from_unusable_checkpoints_and_sets_them_aside(tmp_path):
  directory = str(tmp_path / "checkpoints")
  ckpt = Checkpointer(directory, max_to_keep=3)
  good = {"w": jnp.arange(4.0)}
  ckpt.save(1, good, dict(step=1))
  ckpt.save(2, {"w": jnp.array([0.0, jnp.nan, 1.0, 2.0])}, dict(step=2))
  ckpt.save(3, good, dict(step=3))
  ckpt.close()
  with open(os.path.join(directory, "3", "meta", "metadata"), "w") as f:
    f.write("{torn")  # step 3's JSON record is damaged
  check = lambda state: None if bool(all_finite(state)) else "non-finite parameters"
  abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
  ckpt = Checkpointer(directory, max_to_keep=3)
  state, meta = ckpt.restore_usable(abstract, check)
  assert meta == dict(step=1) and np.array_equal(state["w"], good["w"])
  assert ckpt.latest_step() == 1
  aside = sorted(os.listdir(directory + "_unusable"))
  assert [name.split("-")[0] for name in aside] == ["2", "3"]  # kept, not deleted
  ckpt.save(2, good, dict(step=2))  # the freed step numbers can be saved again
  ckpt.close()


def test_no_usable_checkpoint_is_an_error_naming_each_and_moves_nothing(tmp_path):
  directory = str(tmp_path / "checkpoints")
  ckpt = Checkpointer(directory)
  ckpt.save(1, {"w": jnp.full(3, jnp.inf)}, dict(step=1))
  ckpt.close()
  before = snapshot(str(tmp_path))
  check = lambda state: None if bool(all_finite(state)) else "non-finite parameters"
  with pytest.raises(NoUsableCheckpoint, match=rf"{directory}/1: non-finite parameters.*Nothing was changed"):
    Checkpointer(directory).restore_usable({"w": jax.ShapeDtypeStruct((3,), jnp.float32)}, check)
  assert snapshot(str(tmp_path)) == before


@ON_DEBUG_MEMBERS_WORKER
def test_a_corrupt_latest_checkpoint_resumes_from_the_previous_to_the_same_rows(finished_run, base_cache, tmp_path):
  workdir = copy_of(finished_run, tmp_path)
  latest = os.path.join(workdir, "checkpoints", "6")
  for root, _, files in os.walk(os.path.join(latest, "state")):
    for name in files:
      if not name.endswith(".json") and os.path.getsize(os.path.join(root, name)) > 0:
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(7)  # array data cut short
  Trainer(config(base_cache), workdir, devices=ONE).run()
  # Steps 5 and 6 are redone.
  assert rundir.rows_mismatch(rundir.read_metrics(workdir), rundir.read_metrics(finished_run)) is None
  assert os.listdir(os.path.join(workdir, "checkpoints_unusable"))[0].startswith("6-")


@ON_DEBUG_MEMBERS_WORKER
def test_non_finite_state_is_never_saved(base_cache, tmp_path, poison_update):
  # Update 2 is a checkpoint step's: its loss and gradient are finite, the parameters it returns are not.
  poison_update(2, lambda state, metrics: (dict(state, params=jax.tree.map(lambda x: x * jnp.nan, state["params"])),
                                           metrics))
  workdir = str(tmp_path / "run")
  with pytest.raises(FloatingPointError, match=r"non-finite at step 2\. Stopped before saving.*new --workdir"):
    Trainer(config(base_cache), workdir, devices=ONE).run()
  assert Checkpointer(rundir.checkpoints_dir(workdir)).latest_step() is None


@ON_DEBUG_MEMBERS_WORKER
def test_the_non_finite_advice_is_a_branch_that_trains_on(base_cache, tmp_path, poison_update):
  poison_update(3, lambda state, metrics: (dict(state, params=jax.tree.map(lambda x: x * jnp.nan, state["params"])),
                                           metrics))
  workdir, branch = str(tmp_path / "run"), str(tmp_path / "branch")
  with pytest.raises(FloatingPointError, match=rf"checkpoint in {workdir}/checkpoints \(step 2\) holds finite state.*"
                                               rf"--workdir=<new dir> --branch_from={workdir} --config.optim.base_lr="):
    Trainer(config(base_cache), workdir, devices=ONE).run()
  Trainer(config(base_cache, overrides=("optim.base_lr=0.001",)), branch, devices=ONE,
          branch_from=Origin(workdir)).run()
  rows = rundir.read_metrics(branch)
  assert rows[-1]["step"] == 6 and all(r["loss"] is not None for r in rows if "loss" in r)


# -- the metrics log -------------------------------------------------------------------------------------------------

@ON_DEBUG_MEMBERS_WORKER
def test_a_torn_last_row_is_dropped_on_resume(finished_run, base_cache, tmp_path):
  workdir = copy_of(finished_run, tmp_path)
  with open(rundir.metrics_path(workdir), "a") as f:
    f.write('{"step": 7, "samp')
  assert rundir.read_metrics(workdir) == rundir.read_metrics(finished_run)  # readers skip it with a warning
  Trainer(config(base_cache), workdir, devices=ONE).run()
  assert open(rundir.metrics_path(workdir)).read() == open(rundir.metrics_path(finished_run)).read()
  with open(rundir.metrics_path(workdir), "a") as f:
    f.write('{"step": 7, "samp\n{"step": 8}\n')  # not the last line: an error naming it
  with pytest.raises(ValueError, match=r"metrics.jsonl:\d+ is not a JSON metrics row"):
    rundir.read_metrics(workdir)


@ON_DEBUG_MEMBERS_WORKER
def test_lost_rows_at_the_latest_checkpoint_are_redone_or_named(finished_run, base_cache, tmp_path, caplog):
  """A torn final evaluation row (at the checkpoint of step 6) is redone from the restored state, the state it
  evaluated: the run reports that accuracy again, not step 4's (without the redo, step 6 would have no evaluation
  row). A lost training row of step 6 cannot be redone: a warning names it and why."""
  workdir = copy_of(finished_run, tmp_path)
  expected = rundir.read_metrics(finished_run)
  lines = open(rundir.metrics_path(finished_run)).read().splitlines(keepends=True)
  assert expected[-1]["step"] == 6 and "eval_accuracy" in expected[-1]

  def resume_with_the_last_line_torn(kept):
    with open(rundir.metrics_path(workdir), "w") as f:
      f.writelines(kept[:-1] + [kept[-1][:20]])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      return Trainer(config(base_cache), workdir, devices=ONE).run()

  result = resume_with_the_last_line_torn(lines)
  assert rundir.rows_mismatch(rundir.read_metrics(workdir), expected) is None
  assert result["eval_accuracy"] == expected[-1]["eval_accuracy"]
  assert "lacks the evaluation row of step 6 (torn, or the file was cut short): evaluating the restored state" in (
      caplog.text)
  resume_with_the_last_line_torn(lines[:-1])  # The training row of step 6 torn, the evaluation row lost.
  assert rundir.rows_mismatch(rundir.read_metrics(workdir), expected[:-2] + expected[-1:]) is None
  assert re.search(r"lacks the training rows of step 6 \(torn, .*\)\. They cannot be redone: the checkpoint of step 6 "
                   r".* holds the state after them, and a step's rollouts are not saved", caplog.text)
  assert "lacks the evaluation row of step 6" in caplog.text


@ON_DEBUG_MEMBERS_WORKER
def test_a_log_whose_checkpoints_are_gone_is_refused_without_changes(finished_run, base_cache, tmp_path):
  workdir = copy_of(finished_run, tmp_path)
  shutil.rmtree(rundir.checkpoints_dir(workdir))
  before = snapshot(workdir)
  with pytest.raises(FileNotFoundError, match=r"holds \d+ rows \(to step 6, 192 samples\) but .*checkpoints is gone"):
    Trainer(config(base_cache), workdir, devices=ONE).run()
  assert snapshot(workdir) == before


def test_a_workdir_that_is_a_file_is_named(base_cache, tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  with pytest.raises(FileExistsError, match="is a file, not a directory"):
    Trainer(config(base_cache), str(path), devices=ONE).run()


@ON_DEBUG_MEMBERS_WORKER
def test_evaluation_counts_and_logs_reward_errors(base_cache, tmp_path, monkeypatch, caplog):
  from jaxrl_batch.tasks.arithmetic import ArithmeticTask
  original = ArithmeticTask.reward
  def flaky(self, completion, problem):
    if problem.prompt.startswith("1"):
      raise RuntimeError("parser exploded")
    return original(self, completion, problem)
  monkeypatch.setattr(ArithmeticTask, "reward", flaky)
  workdir = str(tmp_path / "run")
  Trainer(config(base_cache, sample_budget=32), workdir, devices=ONE).run()
  evals = [r for r in rundir.read_metrics(workdir) if "eval_accuracy" in r]
  assert len(evals) == 2 and all(r["eval_reward_errors"] > 0 for r in evals)
  assert "Evaluation: the reward function raised on 1 of 16 samples (scored 0)" in caplog.text
  assert "parser exploded" in caplog.text


# -- branching ------------------------------------------------------------------------------------------------------

@ON_DEBUG_MEMBERS_WORKER
def test_a_branch_without_changes_replays_its_source_which_it_only_reads(finished_run, base_cache, tmp_path):
  before = snapshot(finished_run)
  workdir = str(tmp_path / "branch")
  Trainer(config(base_cache), workdir, devices=ONE, branch_from=Origin(finished_run, 4)).run()
  assert rundir.rows_mismatch(rundir.read_metrics(workdir), rundir.read_metrics(finished_run)) is None
  assert rundir.read_config(workdir)["branched_from"] == dict(workdir=finished_run, step=4, samples=128, changed=[])
  assert snapshot(finished_run) == before


@ON_DEBUG_MEMBERS_WORKER
def test_a_branch_trains_on_from_the_step_with_the_changes_it_records(finished_run, base_cache, tmp_path):
  workdir = str(tmp_path / "branch")
  # Two more steps from the source's last checkpoint (step 6), at 10x the lr and without the clip (its removal keeps
  # the optimizer state's shape); the rerun resumes the branch like any run.
  branch = lambda: Trainer(config(base_cache, 256, ("optim.base_lr=0.02", "optim.grad_clip=0.0")), workdir,
                           devices=ONE, branch_from=Origin(finished_run)).run()
  branch()
  rows = rundir.read_metrics(workdir)
  branch()
  assert rundir.read_metrics(workdir) == rows
  source = rundir.read_metrics(finished_run)
  assert rundir.rows_mismatch(rows[: len(source)], source) is None
  assert [r["step"] for r in rows[len(source):]] == [7, 8, 8]  # Two steps, then the final evaluation.
  assert rows[len(source)]["lr"] == pytest.approx(10 * source[-2]["lr"])
  assert rundir.read_config(workdir)["branched_from"]["changed"] == [
      "optim.base_lr: 0.002 -> 0.02", "optim.grad_clip: 1.0 -> 0.0", "sample_budget: 192 -> 256"]


@ON_DEBUG_MEMBERS_WORKER
def test_a_branch_that_cannot_start_names_why_and_writes_nothing(finished_run, base_cache, tmp_path):
  new = str(tmp_path / "new")
  cases = [
      (Origin(str(tmp_path / "nowhere")), (), FileNotFoundError, r"holds no run \(no config.json\)"),
      (Origin(finished_run, 3), (), FileNotFoundError, r"no checkpoint at step 3 \(it holds \[4, 6\]\)"),
      (Origin(finished_run), ("rl.max_staleness=1",), ValueError, r"lacks rollouts in flight"),
  ]
  for origin, overrides, error, message in cases:
    with pytest.raises(error, match=message):
      Trainer(config(base_cache, overrides=overrides), new, devices=ONE, branch_from=origin).run()
    assert snapshot(new) == {}
  with pytest.raises(ValueError, match=r"does not fit this config .*not what the state holds.*Nothing was changed"):
    Trainer(config(base_cache, family=ppo_arith), new, devices=ONE, branch_from=Origin(finished_run)).run()
  assert snapshot(new) == {}
  existing = copy_of(finished_run, tmp_path)
  before = snapshot(existing)
  with pytest.raises(ValueError, match=r"already holds a run: a branch from .* needs a new --workdir"):
    Trainer(config(base_cache), existing, devices=ONE, branch_from=Origin(finished_run)).run()
  assert snapshot(existing) == before


# -- signals and kills ----------------------------------------------------------------------------------------------

def _wait_for(proc, done, what):
  deadline = time.time() + 240
  while not done():
    assert time.time() < deadline and proc.poll() is None, f"no {what}: " + proc.stdout.read()[-3000:]
    time.sleep(0.1)


def _saved_steps(workdir):
  """Steps of the committed checkpoints (orbax renames a step's directory to its number when the save is done)."""
  return [int(d) for d in os.listdir(rundir.checkpoints_dir(str(workdir))) if d.isdigit()]


@pytest.mark.slow
@ON_DEBUG_MEMBERS_WORKER
def test_sigterm_then_kill_9_then_rerun_give_the_uninterrupted_rows(base_cache, tmp_path, caplog):
  straight = str(tmp_path / "straight")
  Trainer(config(base_cache, sample_budget=320), straight, devices=ONE).run()  # 10 steps, in this process
  train = [r for r in rundir.read_metrics(straight) if "reward_mean" in r]
  assert sum(r["grad_norm"] > 0 for r in train) >= len(train) // 2  # it learns: a lost restore would show
  workdir = tmp_path / "run"

  # SIGTERM: the step in progress ends, its checkpoint is saved, exit 128 + 15.
  proc = launch_train(workdir, base_cache, "--config.mesh.data=1", "--config.sample_budget=320", devices=1)
  _wait_for(proc, lambda: any(r.get("step", 0) >= 3 for r in rundir.read_metrics(str(workdir))), "step 3")
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
  stopped = max(r["step"] for r in rundir.read_metrics(str(workdir)))
  assert stopped < 10 and f"Stopped on SIGTERM after saving the checkpoint of step {stopped}" in out
  assert Checkpointer(rundir.checkpoints_dir(str(workdir))).latest_step() == stopped

  # The rerun resumes there; kill -9 once it has saved a later checkpoint.
  proc = launch_train(workdir, base_cache, "--config.mesh.data=1", "--config.sample_budget=320", devices=1)
  _wait_for(proc, lambda: max(_saved_steps(workdir)) > stopped, "later checkpoint")
  proc.send_signal(signal.SIGKILL)
  out, _ = proc.communicate(timeout=60)
  assert f"Resuming from step {stopped}" in out, out[-3000:]

  # The rerun reads only what the killed process left on disk: in this process, it is the same rerun.
  saved = max(_saved_steps(workdir))
  with caplog.at_level(logging.INFO):
    Trainer(config(base_cache, sample_budget=320), str(workdir), devices=ONE).run()
  assert f"Resuming from step {saved}" in caplog.text
  assert rundir.rows_mismatch(rundir.read_metrics(straight), rundir.read_metrics(str(workdir))) is None


def _rewrite_config(workdir, edit):
  """Applies `edit` to the "config" of workdir's config.json, as an older or foreign program would have written it."""
  path = rundir.config_path(workdir)
  content = json.load(open(path))
  edit(content["config"])
  with open(path, "w") as f:
    json.dump(content, f)


def _drop_newer_fields(config):
  for name in migrate.ADDED:
    *groups, key = name.split(".")
    node = config
    for group in groups:
      node = node.get(group, {})
    node.pop(key, None)


@ON_DEBUG_MEMBERS_WORKER
def test_a_config_json_from_before_newer_fields_resumes_with_them_filled(finished_run, base_cache, tmp_path, caplog):
  workdir = copy_of(finished_run, tmp_path)
  _rewrite_config(workdir, _drop_newer_fields)
  assert "stop_at_accuracy" not in json.load(open(rundir.config_path(workdir)))["config"]
  caplog.set_level("INFO")
  saved = rundir.read_config(workdir)["config"]
  assert "predates fields of the recipe" in caplog.text and "rl.noise_split=False" in caplog.text
  assert rundir.config_diff(saved, json.loads(config(base_cache).to_json())) == []
  Trainer(config(base_cache), workdir, devices=ONE).run()  # Resumes (finished: nothing to redo).
  assert rundir.read_metrics(workdir) == rundir.read_metrics(finished_run)
  with pytest.raises(ValueError, match=r"different config \(rl.noise_split: False -> True\)"):  # Not as it ran.
    Trainer(config(base_cache, overrides=["rl.noise_split=True"]), workdir, devices=ONE).run()


@ON_DEBUG_MEMBERS_WORKER
def test_a_config_json_with_an_unknown_field_is_refused_on_resume(finished_run, base_cache, tmp_path):
  workdir = copy_of(finished_run, tmp_path)
  _rewrite_config(workdir, lambda c: c["rl"].update(future_knob=1.0))
  with pytest.raises(ValueError, match=r"different config \(rl.future_knob: 1.0 -> None\)"):
    Trainer(config(base_cache), workdir, devices=ONE).run()
