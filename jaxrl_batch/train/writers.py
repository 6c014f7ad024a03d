"""Metric writers: every metrics row goes to metrics.jsonl (`rundir.MetricsLog`, the record) and to the sinks that
`config.writers` names besides it.

  jsonl        metrics.jsonl, always.
  tensorboard  event files in `<workdir>/tb/` (tensorboardX): each field a scalar against `samples`.
  wandb        a Weights & Biases run (`config.wandb`): logged at the row's `step`, charted against `samples`.

The sinks get a row's numeric fields (values that metrics.jsonl writes as null, strings and lists are left out). When
a run starts (`truncate_after`), each sink is handed the rows metrics.jsonl keeps, so that a resumed run continues
the same curves with no step twice:
  tensorboard  rebuilds tb/ from them: earlier event files are removed, and the new one opens with a purge from
               sample 0, so that a TensorBoard already watching drops what it had read.
  wandb        resumes the W&B run of the same id (a hash of the workdir's absolute path) and logs only the steps
               W&B does not have: the steps a resumed run redoes keep the values logged first, which it reproduces.
               Offline, W&B knows no earlier attempt, so each attempt's offline run holds the whole history (sync
               the latest one). A run started over in the same directory continues the same W&B run.
An evaluation row shares its step (and sample count) with the step's training row: in TensorBoard a field already
logged at a sample count is not logged again there (the evaluation row's `wall_s`); in W&B both rows make one step.
Only process 0 writes.
"""
import hashlib
import importlib
import json
import math
import os

import ml_collections
import numpy as np

from jaxrl_batch.config.family import Member
from jaxrl_batch.runtime.distributed import is_main_process
from jaxrl_batch.train import rundir

WRITERS = ("jsonl", "tensorboard", "wandb")
WANDB_MODES = ("", "online", "offline", "disabled")


def writer_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """`config.writers`, checked (`--config.writers=jsonl,tensorboard` gives one comma-separated name: split)."""
  names = tuple(name.strip() for item in config.writers for name in item.split(","))
  unknown = [name for name in names if name not in WRITERS]
  if unknown or "jsonl" not in names:
    raise ValueError(f"config.writers={names}: {f'unknown {unknown}' if unknown else 'jsonl is missing'}. Name "
                     f"writers from {WRITERS}, always with 'jsonl' (metrics.jsonl is the run's record).")
  mode = config.wandb.mode
  if mode not in WANDB_MODES:
    raise ValueError(f"config.wandb.mode={mode!r}: use one of {WANDB_MODES} ('' = W&B's default).")
  return names


def scalars(row: dict) -> dict[str, float]:
  """The row's finite numbers (bools as 0/1)."""
  out = {}
  for key, value in row.items():
    if isinstance(value, np.generic | np.ndarray) and np.ndim(value) == 0:
      value = value.item()
    if isinstance(value, int | float) and math.isfinite(value):
      out[key] = float(value)
  return out


def _require(module: str, extra: str):
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f"config.writers names {extra!r}, which needs the {module} package: "
                      f"pip install -e '.[{extra}]'") from e


def wandb_id(run_dir: str) -> str:
  """The W&B run id of a run directory: every attempt of a run (and every host) resumes the same W&B run."""
  return hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]


def default_group(config: ml_collections.ConfigDict, run_dir: str, member: Member) -> str:
  """The study's directory name for a study member (`study.runner` names its runs `<study>/<member.name>`), else
  the family: '<task>_<algo>_<lr rule>'."""
  run_dir = os.path.abspath(run_dir)
  if os.path.basename(run_dir) == member.name:
    return os.path.basename(os.path.dirname(run_dir))
  return f"{config.task.name}_{config.algo}_{member.rule}"


class TensorBoardWriter:
  """Scalars in `<run_dir>/tb/` against `samples`."""

  def __init__(self, run_dir: str):
    self._summary_writer = _require("tensorboardX", "tensorboard").SummaryWriter
    self.directory = rundir.tb_dir(run_dir)
    self._writer, self._last = None, {}  # {tag: the last sample count logged}

  def start(self, rows: list[dict]) -> None:
    """Rebuilds tb/ from `rows`."""
    self.close()
    if os.path.isdir(self.directory):
      for name in os.listdir(self.directory):
        if name.startswith("events.out.tfevents."):
          os.remove(os.path.join(self.directory, name))
    self._writer = self._summary_writer(self.directory, purge_step=0)
    for row in rows:
      self.write(row)

  def write(self, row: dict) -> None:
    if self._writer is None:
      self._writer = self._summary_writer(self.directory)
    samples = int(row["samples"])
    for tag, value in scalars(row).items():
      if tag != "samples" and samples > self._last.get(tag, -1):
        self._writer.add_scalar(tag, value, global_step=samples)
        self._last[tag] = samples
    self._writer.flush()

  def close(self, failed: bool = False) -> None:
    del failed
    if self._writer is not None:
      self._writer.close()
    self._writer, self._last = None, {}


class WandbWriter:
  """A W&B run (`config.wandb`), resumed by every attempt of the run."""

  def __init__(self, config: ml_collections.ConfigDict, run_dir: str, group: str):
    self._wandb = _require("wandb", "wandb")
    settings = config.wandb
    self._init = dict(project=settings.project, name=settings.name or os.path.basename(os.path.abspath(run_dir)),
                      group=settings.group or group, mode=settings.mode or None, id=wandb_id(run_dir),
                      resume="allow", dir=os.environ.get("WANDB_DIR", run_dir), config=json.loads(config.to_json()))
    self._run, self._next_step = None, 0  # The first step W&B does not have.

  def _open(self) -> None:
    os.makedirs(self._init["dir"], exist_ok=True)
    self._run = self._wandb.init(**self._init)
    self._run.define_metric("samples")
    self._run.define_metric("*", step_metric="samples")
    self._next_step = self._run.step

  def start(self, rows: list[dict]) -> None:
    """Logs the steps of `rows` that W&B does not have (none when it resumes a run that logged them)."""
    self.close()
    for row in rows:
      self.write(row)

  def write(self, row: dict) -> None:
    if self._run is None:
      self._open()
    step = int(row["step"])
    if step < self._next_step:
      return
    self._run.log({k: v for k, v in scalars(row).items() if k != "step"}, step=step)
    self._next_step = step  # Later rows of this step join its W&B row.

  def close(self, failed: bool = False) -> None:
    if self._run is not None:
      self._run.finish(exit_code=int(failed))
    self._run = None


class MetricWriters:
  """What a run writes its rows to: metrics.jsonl, then each sink (on process 0). A context manager that closes the
  sinks on exit (a W&B run that exits with an exception is marked failed)."""

  def __init__(self, run_dir: str, sinks=()):
    self.log = rundir.MetricsLog(run_dir)
    self.sinks = list(sinks) if is_main_process() else []

  def write(self, row: dict) -> None:
    self.log.write(row)
    for sink in self.sinks:
      sink.write(row)

  def read(self) -> list[dict]:
    return self.log.read()

  def truncate_after(self, step: int) -> None:
    """Drops the rows logged after `step` (`MetricsLog.truncate_after`); each sink starts from the rows kept."""
    self.log.truncate_after(step)
    rows = self.log.read() if self.sinks else []
    for sink in self.sinks:
      sink.start(rows)

  def close(self, failed: bool = False) -> None:
    for sink in self.sinks:
      sink.close(failed)

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    self.close(failed=exc_type is not None)


def open_writers(config: ml_collections.ConfigDict, run_dir: str, member: Member) -> MetricWriters:
  """The writers `config.writers` names for `run_dir` (their packages imported now; a W&B run opens at the first
  row or at `truncate_after`)."""
  names = writer_names(config)
  sinks = [TensorBoardWriter(run_dir)] if "tensorboard" in names else []
  if "wandb" in names:
    sinks.append(WandbWriter(config, run_dir, default_group(config, run_dir, member)))
  return MetricWriters(run_dir, sinks)
