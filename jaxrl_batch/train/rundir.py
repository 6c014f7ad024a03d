"""The run directory: the one module that knows its files and their formats.

  config.json     {"config": the run's ConfigDict as JSON, "derived": the member's derived values (`Member.to_json`),
                   num_params, trainable_params, base_policy[, "branched_from": source workdir, step, samples, changed fields
                   (`train.branch`)]}; written whole, then renamed, when a run starts from step 0.
  metrics.jsonl   one JSON object per line, appended as the run goes (training rows and evaluation rows, which hold
                   `eval_accuracy`), trimmed on resume to the restored step; non-finite floats are written as null.
  samples.jsonl   a few rollouts as text every `log_samples_every_steps` steps (`train.samples_log`), trimmed on
                   resume like metrics.jsonl.
  checkpoints/    orbax checkpoints (`runtime.checkpointing`); checkpoints_unusable/ holds any set aside on resume.
  lock            the advisory lock of the process running in it (`train.workdir_lock`): pid, host, start time.
  tb/             TensorBoard event files, rebuilt from metrics.jsonl when a run starts (`train.writers`).
  wandb/          W&B's local files, unless WANDB_DIR is set (`train.writers`).

In a multi-process run only process 0 writes; every process may read. A write the disk has no room for raises
`disk_space.DiskFull` naming the file and leaves it as it was: a row is appended whole or not at all, a file
rewritten whole keeps its old content.
"""
import json
import logging
import math
import os
from collections.abc import Iterator

import numpy as np

from jaxrl_batch.config import migrate
from jaxrl_batch.runtime import disk_space
from jaxrl_batch.runtime.distributed import is_main_process

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LOCK = "lock"
TB = "tb"

# Config fields (dotted names) that may change when a run resumes; any other difference from config.json is refused.
RESUMABLE_FIELDS = ("log_every_steps", "log_samples_every_steps", "log_samples_count", "log_samples_max_chars",
                    "eval_every_samples", "checkpoint_every_samples", "sft", "eval",
                    "task.reward_timeout_s", "task.reward_workers", "task.stream_rewards",
                    "task.max_failed_reward_steps", "writers", "wandb", "stop_at_accuracy")


def config_path(run_dir: str) -> str:
  return os.path.join(run_dir, CONFIG)


def metrics_path(run_dir: str) -> str:
  return os.path.join(run_dir, METRICS)


def checkpoints_dir(run_dir: str) -> str:
  return os.path.join(run_dir, CHECKPOINTS)


def lock_path(run_dir: str) -> str:
  return os.path.join(run_dir, LOCK)


def tb_dir(run_dir: str) -> str:
  return os.path.join(run_dir, TB)


def read_config(run_dir: str) -> dict | None:
  """config.json's content, or None when the run has none yet; a config written before fields the recipe has now
  comes back with them filled in as its run did (`config.migrate`), so readers need no fallbacks. ValueError naming
  the file and the fix when it is not a JSON object (damaged outside the run: it is only ever written whole)."""
  path = config_path(run_dir)
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    data = f.read()
  try:
    content = json.loads(data)
    problem = None if isinstance(content, dict) else f"holds a JSON {type(content).__name__}, not an object"
  except ValueError as e:  # json.JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8.
    problem = f"is not valid JSON ({e})"
  if problem:
    raise ValueError(
        f"{path} {problem}. The run writes it whole, then renames it into place, so it was damaged or edited outside "
        "the run; nothing was changed. Restore it from a backup, or move this run directory aside and start the run "
        "again in a new --workdir.")
  return dict(content, config=migrate.complete(content["config"], path)) if "config" in content else content


def _raise_if_full(error: OSError, what: str, path: str, text: str) -> None:
  """Raises `disk_space.DiskFull` from `error` when it is a full disk's (writing `text` to `path`)."""
  if error.errno in disk_space.FULL_ERRNOS:
    raise disk_space.DiskFull(what, path, len(text.encode()), disk_space.free_bytes(path)) from error


def _replace(path: str, text: str, what: str) -> None:
  """Writes `text` to `path` whole: to a temporary file, then renamed over it (removed if it does not fit)."""
  tmp = path + ".tmp"
  try:
    with open(tmp, "wb") as f:
      f.write(text.encode())
  except OSError as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    _raise_if_full(e, what, path, text)
    raise
  os.replace(tmp, path)


def _append(path: str, text: str, what: str) -> None:
  """Appends `text` whole or not at all: what a failed write (a full disk) left of it is cut off again."""
  data = memoryview(text.encode())
  with open(path, "ab", buffering=0) as f:
    start = f.tell()
    try:
      while data:
        data = data[f.write(data):]
    except OSError as e:
      f.truncate(start)
      _raise_if_full(e, what, path, text)
      raise


def write_config(run_dir: str, content: dict) -> None:
  """Writes config.json whole, then renames it into place: other processes may be reading it."""
  if is_main_process():
    _replace(config_path(run_dir), json.dumps(content, indent=2), "writing")


def config_diff(saved: dict, new: dict, prefix: str = "") -> list[str]:
  """Dotted names of fields whose values differ between two config dicts, ignoring RESUMABLE_FIELDS (`saved` as
  `read_config` returns it: completed with the fields added since it was written)."""
  diffs = []
  for key in sorted(set(saved) | set(new)):
    name = prefix + key
    if name in RESUMABLE_FIELDS:
      continue
    a, b = saved.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      diffs += config_diff(a, b, name + ".")
    elif json.dumps(a) != json.dumps(b):
      diffs.append(f"{name}: {a!r} -> {b!r}")
  return diffs


def iter_metrics(path: str) -> Iterator[tuple[int, dict]]:
  """(line number, row) of every non-empty line of a metrics.jsonl; ValueError naming the line if one is not JSON.

  A last line without its newline that is not JSON is a row torn by a crash (rows are written whole, newline last):
  it is skipped with a warning. A resumed run drops it; it redoes the row's step when it is after the checkpoint it
  resumes from, else the evaluation of that checkpoint's step, and names the rows it cannot redo (`train.trainer`).
  """
  with open(path) as f:
    lines = f.readlines()
  for line_no, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      yield line_no, json.loads(line)
    except json.JSONDecodeError as e:
      if line_no == len(lines) and not line.endswith("\n"):
        logging.warning("%s:%d is a torn last row (%d bytes, no newline): skipped.", path, line_no, len(line))
        return
      raise ValueError(f"{path}:{line_no} is not a JSON metrics row ({e}). Fix or delete that line.") from e


def read_metrics(run_dir: str) -> list[dict]:
  """Every row of the run's metrics.jsonl ([] if it has none)."""
  path = metrics_path(run_dir)
  return [row for _, row in iter_metrics(path)] if os.path.exists(path) else []


def finished_samples(run_dir: str) -> int:
  """Cumulative samples of a run's last training row (0 if it has none)."""
  return max((r["samples"] for r in read_metrics(run_dir) if "reward_mean" in r), default=0)


def reached_accuracy(accuracy: float | None, stop_at: float) -> bool:
  """Whether a held-out accuracy ends a run early: `config.stop_at_accuracy` > 0 and accuracy >= it."""
  return stop_at > 0 and accuracy is not None and accuracy >= stop_at


def is_finished(run_dir: str, config) -> bool:
  """Whether the run in `run_dir` is complete under `config` (its member's): trained to config.sample_budget, or
  stopped by an evaluation that reached config.stop_at_accuracy."""
  rows = read_metrics(run_dir)
  trained = max((r["samples"] for r in rows if "reward_mean" in r), default=0)
  last_eval = next((r["eval_accuracy"] for r in reversed(rows) if "eval_accuracy" in r), None)
  return trained >= config["sample_budget"] or reached_accuracy(last_eval, config["stop_at_accuracy"])


# Fields of a metrics row that the config and seed determine (timings excluded): a resumed run must reproduce them.
REPRODUCIBLE_FIELDS = ("step", "samples", "samples_generated", "reward_mean", "response_len_mean", "grad_norm", "loss",
                       "kl_coef", "value_loss", "eval_accuracy")


def rows_mismatch(a: list[dict], b: list[dict], fields=REPRODUCIBLE_FIELDS, rtol: float = 1e-5) -> str | None:
  """The first difference between two runs' rows (their sequence of steps, then each of `fields` to `rtol`; a field
  absent or null counts as -1), or None when they match."""
  if [r["step"] for r in a] != [r["step"] for r in b]:
    return f"steps differ: {[r['step'] for r in a]} vs {[r['step'] for r in b]}"
  for key in fields:
    x, y = ([-1.0 if r.get(key) is None else r[key] for r in rows] for rows in (a, b))
    if not np.allclose(x, y, rtol=rtol):
      return f"{key} differs: {x} vs {y}"
  return None


def check_resumable(run_dir: str) -> None:
  """Refuses a run directory whose metrics.jsonl holds rows while its checkpoints/ is gone: with nothing to resume
  from, the run would start over and erase that log. (An empty checkpoints/ is an attempt that died before its
  first checkpoint: its rows are redone identically.)"""
  rows = read_metrics(run_dir) if os.path.exists(metrics_path(run_dir)) else []
  if rows and not os.path.isdir(checkpoints_dir(run_dir)):
    last = rows[-1]
    raise FileNotFoundError(
        f"{metrics_path(run_dir)} holds {len(rows)} rows (to step {last.get('step')}, {last.get('samples')} "
        f"samples) but {checkpoints_dir(run_dir)} is gone, so there is nothing to resume from and starting over "
        "would erase that log. Nothing was changed. To start over here, move metrics.jsonl and config.json out of "
        "the directory; to keep both runs, use another --workdir.")


def _plain(value):
  value = value.item() if isinstance(value, np.generic | np.ndarray) else value
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class MetricsLog:
  """Appends rows to a run's metrics.jsonl; each row is written at once so a killed run loses nothing it logged."""

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self.path = metrics_path(run_dir)

  def write(self, row: dict) -> None:
    if is_main_process():
      line = json.dumps({k: _plain(v) for k, v in row.items()}) + "\n"
      _append(self.path, line, f"the row of step {row.get('step')} in")

  def read(self) -> list[dict]:
    return read_metrics(self.run_dir)

  def truncate_after(self, step: int) -> None:
    """Drops rows logged after `step` (work a resumed run will redo); atomic replace."""
    if not is_main_process():
      return
    rows = [r for r in self.read() if r.get("step", 0) <= step]
    _replace(self.path, "".join(json.dumps(r) + "\n" for r in rows), "writing")
