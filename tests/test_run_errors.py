"""A run's inputs that are wrong say what is wrong and how to fix it, and change nothing: a damaged config.json, a
reward function that raises, an oversized prompt in a data file, a full disk; and SIGTERM in the warm start is
honoured."""
import errno
import io
import json
import logging
import os
import re
import signal

import jax.numpy as jnp
import pytest

from configs import grpo_gsm8k_qwen
from jaxrl_batch.config import migrate
from jaxrl_batch.runtime import disk_space
from jaxrl_batch.runtime.checkpointing import Checkpointer, saved_steps
from jaxrl_batch.runtime.disk_space import DiskFull
from jaxrl_batch.runtime.preemption import Stopped
from jaxrl_batch.tasks import gsm8k, make_task
from jaxrl_batch.tasks.jsonl_task import DEFAULT_CONTEXT, SAMPLES_DIR
from jaxrl_batch.tasks.sample_tokenizer import PATH as SAMPLE_TOKENIZER
from jaxrl_batch.text.loading import load_tokenizer
from jaxrl_batch.train import rundir
from jaxrl_batch.train.setup import Experiment
from jaxrl_batch.train.trainer import Trainer
from launch import runtime
from tests.helpers import ONE_DEVICE, debug_config


@pytest.mark.parametrize("content", [b"garbage{{", b'{"config": ', b"[1, 2]", b"\xff\xfe{"])
def test_damaged_config_json_is_named_with_the_fix_and_left_as_is(tmp_path, content):
  path = tmp_path / rundir.CONFIG
  path.write_bytes(content)
  (tmp_path / rundir.METRICS).write_text('{"step": 0, "samples": 0, "eval_accuracy": 0.5}\n')
  before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
  with pytest.raises(ValueError, match=rf"{path} (is not valid JSON|holds a JSON list).*Restore it from a backup"):
    rundir.read_config(str(tmp_path))
  assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_a_reward_that_always_raises_stops_the_run_naming_it(base_cache, tmp_path, caplog):
  """A reward that raises on every sample: each step's warning names the metrics row (`step`) that counts the
  errors, and task.max_failed_reward_steps such steps in a row stop the run with an error naming the reward, after
  writing the rows of the steps that ran."""
  config = debug_config(base_cache, sample_budget=96, **{"task.max_failed_reward_steps": 2})
  trainer = Trainer(config, str(tmp_path / "run"), devices=ONE_DEVICE)

  def broken(completion, problem):
    raise ZeroDivisionError("a broken verifier")
  trainer.exp.task.reward = broken
  with caplog.at_level(logging.WARNING), pytest.raises(
      RuntimeError, match=r"reward function (tests\.)?test_run_errors\..*broken failed on every sample of 2 consecutive "
      r"steps.*step 2: 32 of 32 raised.*task.max_failed_reward_steps=2\. .*Fix the reward function, then rerun"):
    trainer.run()
  rows = [r for r in rundir.read_metrics(trainer.workdir) if "reward_errors" in r]
  warned = [int(m) for m in re.findall(r"Step (\d+): the reward function raised on 32 of 32", caplog.text)]
  assert warned == [r["step"] for r in rows if r["reward_errors"] == 32] == [1, 2]


def _gsm8k_file(tmp_path, long_question: str, at_line: int = 3) -> str:
  """The bundled GSM8K sample with `long_question` as the question of line `at_line`."""
  lines = open(os.path.join(SAMPLES_DIR, gsm8k.Gsm8kTask.sample_file)).read().splitlines()
  row = json.loads(lines[at_line - 1])
  lines[at_line - 1] = json.dumps(dict(row, question=long_question))
  path = tmp_path / "train.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_an_oversized_prompt_is_skipped_naming_its_file_line_and_length(tmp_path, caplog):
  """A 200 kB question is skipped (the default cap: the model's context less the response budget), not sized into
  every step's prompt buffer and KV cache."""
  config = grpo_gsm8k_qwen.get_config("model=tiny_random")
  config.task.path = _gsm8k_file(tmp_path, "How many? " * 20_000)
  config.mesh.data = 1
  with caplog.at_level(logging.WARNING):
    exp = Experiment.create(config, devices=ONE_DEVICE)
  assert exp.prompt_len < 200
  assert re.search(rf"Skipped 1 rows whose prompt is longer than \d+ tokens \(the model's context of {DEFAULT_CONTEXT} "
                   rf"tokens less the response budget .*\): {config.task.path}, line 3: \d{{5,}} tokens\.", caplog.text)


def test_max_prompt_tokens_skips_longer_rows_and_refuses_to_skip_them_all(tmp_path, caplog):
  tokenizer = load_tokenizer(SAMPLE_TOKENIZER)
  longest = make_task("gsm8k", {}).max_prompt_len(tokenizer)  # Of the bundled sample.
  path = _gsm8k_file(tmp_path, "How many apples are there? " * 100)
  task = make_task("gsm8k", {"path": path, "max_prompt_tokens": longest})
  rows = len(task._train) + len(task._eval)
  with caplog.at_level(logging.WARNING):
    task.skip_long_prompts(tokenizer, context=None)
  assert len(task._train) + len(task._eval) == rows - 1 and task.max_prompt_len(tokenizer) <= longest
  assert re.search(rf"Skipped 1 rows .* than {longest} tokens \(task.max_prompt_tokens={longest}\): {path}, line 3: "
                   r"\d+ tokens\.", caplog.text)
  with pytest.raises(ValueError, match=rf"Every training row of {path} has a prompt longer than 1 tokens .*raise "
                     "task.max_prompt_tokens"):
    make_task("gsm8k", {"path": path, "max_prompt_tokens": 1}).skip_long_prompts(tokenizer, context=None)


def test_a_gsm8k_config_json_from_before_max_prompt_tokens_still_resumes():
  new = json.loads(grpo_gsm8k_qwen.get_config("model=tiny_random").to_json())
  old = json.loads(json.dumps(new))
  del old["task"]["max_prompt_tokens"]
  assert rundir.config_diff(migrate.complete(old), new) == []


def test_sigterm_in_the_warm_start_stops_it_at_the_next_sft_step(base_cache, tmp_path, monkeypatch):
  """SIGTERM before the first SFT step (as it would come during any): the run stops there, exit code 128 + 15 from
  `launch.train`, with nothing cached or written, instead of finishing the warm start and an RL step first."""
  cache = tmp_path / "base"
  trainer = Trainer(debug_config(str(cache)), str(tmp_path / "run"), devices=ONE_DEVICE)
  check_workdir = Trainer.check_workdir

  def check_then_signal(self):
    check_workdir(self)
    signal.raise_signal(signal.SIGTERM)
  monkeypatch.setattr(Trainer, "check_workdir", check_then_signal)
  with pytest.raises(Stopped, match=r"Stopped on SIGTERM at SFT step 0 of 1000, before the warm start finished.*"
                     "Rerun the same command") as stopped:
    trainer.run()
  assert stopped.value.signum == signal.SIGTERM
  assert not any(name.isdigit() for _, _, names in os.walk(cache) for name in names)
  assert sorted(os.listdir(trainer.workdir)) == [rundir.LOCK]


# -- a full disk -----------------------------------------------------------------------------------------------------

def test_a_checkpoint_the_disk_has_no_room_for_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  directory = str(tmp_path / "checkpoints")
  ckpt = Checkpointer(directory)
  ckpt.save(1, {"w": jnp.arange(4096.0)}, dict(step=1))
  ckpt.wait_until_finished()
  monkeypatch.setattr(disk_space, "free_bytes", lambda path: 1000)
  needed = disk_space.size(disk_space.used_bytes(os.path.join(directory, "1")))  # The latest checkpoint's size.
  with pytest.raises(DiskFull, match=rf"for the checkpoint of step 2 in {directory}: it needs about {needed}, and "
                     r"1.0 kB are free .*Nothing already saved was lost.* then rerun the same command"):
    ckpt.save(2, {"w": jnp.arange(4096.0)}, dict(step=2))
  assert sorted(os.listdir(directory)) == ["1"]
  # A save that fails for want of space all the same (orbax raises tensorstore's error) is a DiskFull too.
  monkeypatch.setattr(disk_space, "free_bytes", lambda path: 10**12)
  def no_room(*args, **kwargs):
    raise ValueError("RESOURCE_EXHAUSTED: Error writing ... Failed to write 9800 bytes to file 5: No space left on "
                     "device [os_error_code='28']")
  monkeypatch.setattr(ckpt._manager, "save", no_room)
  with pytest.raises(DiskFull, match=rf"for the checkpoint of step 3 in {directory}: it needs about {needed}"):
    ckpt.save(3, {"w": jnp.arange(4096.0)}, dict(step=3))
  ckpt.close()
  assert saved_steps(directory) == [1]


class _FullDisk(io.FileIO):
  """A file on a disk with room for 10 more bytes."""

  def write(self, data):
    if self.tell() >= _FullDisk.end:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return super().write(bytes(data[:_FullDisk.end - self.tell()]))


def test_metrics_rows_the_disk_has_no_room_for_leave_metrics_jsonl_as_it_was(tmp_path, monkeypatch):
  log = rundir.MetricsLog(str(tmp_path))
  log.write(dict(step=1, samples=32, reward_mean=0.5))
  before = open(log.path, "rb").read()
  _FullDisk.end = len(before) + 10
  def full_open(path, mode="r", buffering=-1):
    if "r" in mode:
      return open(path, mode)
    raw = _FullDisk(path, mode.replace("b", ""))
    return raw if buffering == 0 else io.BufferedWriter(raw)
  monkeypatch.setattr(rundir, "open", full_open, raising=False)
  with pytest.raises(DiskFull, match=rf"for the row of step 2 in {log.path}: it needs about \d+ bytes, and .* free"):
    log.write(dict(step=2, samples=64, reward_mean=0.25))
  assert open(log.path, "rb").read() == before  # Not a torn row: the 10 bytes written are cut off again.
  _FullDisk.end = 10
  with pytest.raises(DiskFull, match=rf"for writing {log.path}: "):
    log.truncate_after(1)  # Rewritten whole (to a temporary file): the old content stays.
  assert os.listdir(tmp_path) == [rundir.METRICS] and open(log.path, "rb").read() == before


def test_a_full_disk_stops_the_run_with_one_error_saying_where_a_rerun_resumes(base_cache, tmp_path, monkeypatch,
                                                                               caplog):
  """A write that finds no room (here one the run directory module does not make, so the error is the OS's): the
  run stops with DiskFull naming the file, the space free and the checkpoint a rerun resumes from; `launch.train`
  logs it alone and exits with 1. (A checkpoint with no room is refused by the checkpointer, tested above.)"""
  trainer = Trainer(debug_config(base_cache), str(tmp_path / "run"), devices=ONE_DEVICE)
  path = os.path.join(trainer.workdir, "samples.jsonl")

  def start(self, signals):
    os.makedirs(os.path.join(rundir.checkpoints_dir(self.workdir), "4"))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
  monkeypatch.setattr(Trainer, "start", start)
  monkeypatch.setattr(disk_space, "free_bytes", lambda path: 2048)
  with pytest.raises(DiskFull) as full:
    trainer.run()
  assert re.fullmatch(rf"No space left on device for a write to {path}: 2.0 kB are free on that filesystem\. Nothing "
                      r"already saved was lost or changed\. Free space there .*, then rerun the same command: the run "
                      r"resumes from its checkpoint of step 4\.", str(full.value))
  with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
    runtime.run_to_exit(lambda: (_ for _ in ()).throw(full.value))
  assert exit_.value.code == 1 and caplog.messages == [str(full.value)]
