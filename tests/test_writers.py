"""Metric writers: TensorBoard event files and a W&B offline run read back, resume without a step twice, refused
configs."""
import collections
import glob
import json
import os
import struct
import sys
import time

import jax
import numpy as np
import pytest
import wandb
from tensorboardX.proto import event_pb2
from wandb.proto import wandb_internal_pb2

from configs import grpo_arith
from jaxrl_batch.config import family
from jaxrl_batch.train import rundir, writers
from jaxrl_batch.train.trainer import Trainer

MEMBER = family.member(grpo_arith.get_config("debug"))


def config(**fields):
  c = grpo_arith.get_config("debug")
  c.update(fields)
  return c


def train_row(step, reward, **extra):
  return dict(step=step, samples=32 * step, wall_s=float(step), reward_mean=reward, **extra)


def eval_row(step, accuracy):
  return dict(step=step, samples=32 * step, wall_s=step + 0.5, eval_accuracy=accuracy, eval_reward_errors=0)


def read_events(directory) -> list:
  """The events of every event file in `directory` (TFRecord framing: length u64, crc u32, event, crc u32)."""
  events = []
  for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
      pos += 16 + length
  return events


def tb_scalars(directory) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value)]} in the order written."""
  out = collections.defaultdict(list)
  for event in read_events(directory):
    for value in event.summary.value:
      out[value.tag].append((event.step, value.simple_value))
  return dict(out)


def test_tensorboard_logs_numeric_fields_against_samples(tmp_path):
  run_dir = str(tmp_path)
  with writers.open_writers(config(writers=("jsonl", "tensorboard")), run_dir, MEMBER) as w:
    w.truncate_after(-1)
    w.write(eval_row(0, 0.25))
    w.write(train_row(1, np.float32(0.5), noise_scale=None, loss=float("nan"), note="text", lens=[1, 2],
                      cold=True))
    w.write(train_row(2, 0.75, noise_scale=3.0, loss=0.1, cold=False))
    w.write(eval_row(2, 0.5))
  tags = tb_scalars(rundir.tb_dir(run_dir))
  assert tags["reward_mean"] == [(32, 0.5), (64, 0.75)]
  assert tags["eval_accuracy"] == [(0, 0.25), (64, 0.5)]
  assert tags["noise_scale"] == [(64, 3.0)] and tags["loss"] == [(64, pytest.approx(0.1))]
  assert tags["cold"] == [(32, 1.0), (64, 0.0)]
  assert tags["step"] == [(0, 0.0), (32, 1.0), (64, 2.0)]
  # The evaluation row at sample 64 follows its training row: its wall_s is not a second point there.
  assert tags["wall_s"] == [(0, 0.5), (32, 1.0), (64, 2.0)]
  assert not {"samples", "note", "lens"} & set(tags)
  assert [r["step"] for r in rundir.read_metrics(run_dir)] == [0, 1, 2, 2]  # metrics.jsonl as before


def test_tensorboard_resume_rebuilds_without_a_step_twice(tmp_path):
  run_dir = str(tmp_path)
  cfg = config(writers=("jsonl", "tensorboard"))
  with pytest.raises(KeyboardInterrupt), writers.open_writers(cfg, run_dir, MEMBER) as w:  # killed after step 5
    w.truncate_after(-1)
    for step in range(1, 6):
      w.write(train_row(step, 0.1 * step))
    raise KeyboardInterrupt
  with writers.open_writers(cfg, run_dir, MEMBER) as w:  # resumed from the checkpoint at step 3
    w.truncate_after(3)
    for step in range(4, 7):
      w.write(train_row(step, 1.0 + step))
  directory = rundir.tb_dir(run_dir)
  assert len(glob.glob(os.path.join(directory, "events.out.tfevents.*"))) == 1
  purges = [e.step for e in read_events(directory) if e.session_log.status == event_pb2.SessionLog.START]
  assert purges == [0]  # A TensorBoard that read the old file drops it.
  steps, values = zip(*tb_scalars(directory)["reward_mean"])
  assert steps == (32, 64, 96, 128, 160, 192)
  assert values == pytest.approx((0.1, 0.2, 0.3, 5.0, 6.0, 7.0))


def test_tensorboard_added_on_resume_holds_the_whole_history(tmp_path):
  run_dir = str(tmp_path)
  with writers.open_writers(config(), run_dir, MEMBER) as w:
    w.truncate_after(-1)
    for step in range(1, 4):
      w.write(train_row(step, 0.1 * step))
  assert not os.path.exists(rundir.tb_dir(run_dir))
  with writers.open_writers(config(writers=("jsonl", "tensorboard")), run_dir, MEMBER) as w:
    w.truncate_after(2)
    w.write(train_row(3, 0.9))
  assert [s for s, _ in tb_scalars(rundir.tb_dir(run_dir))["reward_mean"]] == [32, 64, 96]


def read_wandb_records(run_file_glob: str) -> list:
  """The records of W&B's offline run file (LevelDB log framing after a 7-byte header: blocks of 32 KiB, each
  chunk with crc u32, length u16, type u8; type 1 = whole record, 2/3/4 = first/middle/last piece), once it ends
  with its exit record: W&B's service may still be writing it when `finish()` returns."""
  deadline, records = time.time() + 20, []
  while not records or records[-1].WhichOneof("record_type") != "exit":
    assert time.time() < deadline, f"no exit record in {run_file_glob} after 20 s: {records[-1:]}"
    time.sleep(0.05)
    (path,) = glob.glob(run_file_glob)
    with open(path, "rb") as f:
      data = f.read()
    block, pos, pieces, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
      if block - pos % block < 7:
        pos += block - pos % block
        continue
      _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
      if pos + 7 + length > len(data):
        break
      pieces += data[pos + 7:pos + 7 + length]
      pos += 7 + length
      if kind in (1, 4):
        records.append(wandb_internal_pb2.Record.FromString(pieces))
        pieces = b""
  return records


def test_wandb_offline_run_is_sample_indexed(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  run_dir = str(tmp_path / "study" / MEMBER.name)
  cfg = config(writers=("jsonl", "wandb"))
  cfg.wandb.mode = "offline"
  os.makedirs(run_dir)
  with writers.open_writers(cfg, run_dir, MEMBER) as w:
    w.truncate_after(-1)
    w.write(eval_row(0, 0.25))
    w.write(train_row(1, 0.5, loss=float("nan"), note="text"))
    w.write(train_row(2, 0.75))
    w.write(eval_row(2, 0.5))
  run_id = writers.wandb_id(run_dir)
  records = read_wandb_records(str(tmp_path / "wandb_dir" / "wandb" / f"offline-run-*-{run_id}" / "*.wandb"))
  (run,) = [r.run for r in records if r.HasField("run")]
  assert (run.run_id, run.project, run.display_name, run.run_group) == (run_id, "jaxrl_batch", MEMBER.name, "study")
  metrics = [r.metric for r in records if r.HasField("metric")]
  assert any(m.glob_name == "*" and m.step_metric == "samples" for m in metrics)
  history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
             for r in records if r.HasField("history")]
  assert [(h["_step"], h["samples"], h.get("reward_mean"), h.get("eval_accuracy")) for h in history] == [
      (0, 0, None, 0.25), (1, 32, 0.5, None), (2, 64, 0.75, 0.5)]
  assert not {"loss", "note", "step"} & set(history[1])


class FakeRun:
  """A W&B run that already holds steps below `step`."""

  def __init__(self, step):
    self.step, self.logged, self.exit_code = step, [], None

  def define_metric(self, *args, **kwargs):
    pass

  def log(self, data, step):
    self.logged.append((step, data["reward_mean"]))

  def finish(self, exit_code):
    self.exit_code = exit_code


@pytest.mark.parametrize("wandb_step, logged", [(0, [1, 2, 3, 4, 5]), (5, [5])])
def test_wandb_resume_logs_only_steps_wandb_lacks(tmp_path, monkeypatch, wandb_step, logged):
  run_dir, cfg = str(tmp_path), config(writers=("jsonl", "wandb"))
  with writers.open_writers(config(), run_dir, MEMBER) as w:  # metrics.jsonl of a first attempt, to step 4
    for step in range(1, 5):
      w.write(train_row(step, step))
  calls, run = [], FakeRun(wandb_step)
  monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or run)
  with pytest.raises(RuntimeError), writers.open_writers(cfg, run_dir, MEMBER) as w:  # resumed at step 3
    w.truncate_after(3)
    w.write(train_row(4, 4))
    w.write(train_row(5, 5))
    raise RuntimeError("crash")
  assert [step for step, _ in run.logged] == logged
  assert run.exit_code == 1  # marked failed
  (kwargs,) = calls
  assert (kwargs["id"], kwargs["resume"]) == (writers.wandb_id(run_dir), "allow")
  assert kwargs["group"] == f"arithmetic_grpo_{MEMBER.rule}" and kwargs["name"] == os.path.basename(run_dir)


def test_trainer_writes_to_the_configured_writers_and_closes_them(tmp_path, monkeypatch):
  run = FakeRun(0)
  monkeypatch.setattr(wandb, "init", lambda **kwargs: run)

  def start_then_fail(self, *args):
    self.metrics.truncate_after(-1)
    self.metrics.write(train_row(1, 0.5))
    raise RuntimeError("crash")

  monkeypatch.setattr(Trainer, "start", start_then_fail)
  cfg = config(writers=("jsonl", "wandb"))
  cfg.mesh.data = 1
  os.makedirs(tmp_path / "run")
  with pytest.raises(RuntimeError, match="crash"):
    Trainer(cfg, str(tmp_path / "run"), devices=jax.devices()[:1]).run()
  assert (run.logged, run.exit_code) == ([(1, 0.5)], 1)


def test_config_writers_are_checked():
  assert writers.writer_names(config(writers=("jsonl,tensorboard",))) == ("jsonl", "tensorboard")
  with pytest.raises(ValueError, match=r"config.writers.*jsonl is missing.*'jsonl', 'tensorboard', 'wandb'"):
    writers.writer_names(config(writers=("tensorboard",)))
  with pytest.raises(ValueError, match=r"config.writers.*unknown \['mlflow'\]"):
    writers.writer_names(config(writers=("jsonl", "mlflow")))
  bad_mode = config()
  bad_mode.wandb.mode = "cloud"
  with pytest.raises(ValueError, match="config.wandb.mode='cloud'"):
    writers.writer_names(bad_mode)


def test_writers_and_wandb_may_change_on_resume():
  new = config(writers=("jsonl", "wandb"))
  new.wandb.update(project="other", mode="offline")
  saved, new = json.loads(config().to_json()), json.loads(new.to_json())
  assert rundir.config_diff(saved, new) == []
  before_writers = {k: v for k, v in saved.items() if k not in ("writers", "wandb")}  # a run from before them
  assert rundir.config_diff(before_writers, new) == []


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)
  with pytest.raises(ImportError, match=r"pip install -e '\.\[tensorboard\]'"):
    writers.open_writers(config(writers=("jsonl", "tensorboard")), str(tmp_path), MEMBER)


def test_only_process_zero_writes(tmp_path, monkeypatch):
  monkeypatch.setattr(writers, "is_main_process", lambda: False)
  monkeypatch.setattr(rundir, "is_main_process", lambda: False)
  with writers.open_writers(config(writers=("jsonl", "tensorboard", "wandb")), str(tmp_path), MEMBER) as w:
    w.truncate_after(-1)
    w.write(train_row(1, 0.5))
  assert os.listdir(tmp_path) == []
