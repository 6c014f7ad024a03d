"""Reads a study directory: one run per subdirectory `<rule>_b<batch>[_k<staleness>]_s<seed>/` written by
`launch.train`.

Batch, rule, staleness (`rl.max_staleness`, 0 when absent) and seed come from each run's `config.json` (the
directory name is only a label); both files are read through `train.rundir`. Subdirectories without `config.json` or
`metrics.jsonl`, or whose log has fewer than 2 training rows or no evaluation row yet, are skipped and listed with the
reason; anything malformed is an error naming the file (and line). Evaluation rows (those holding `eval_accuracy`)
give the curve of one metric: `eval_accuracy` by default, or another evaluation field such as `eval_pass_at_k`
(`load_study(metric=...)`); a row without it is an error.
"""
import dataclasses
import os

import numpy as np

from jaxrl_batch.analysis import clock
from jaxrl_batch.train import rundir

PHASES = ("rollout_s", "reward_s", "update_s")  # Per-step phase seconds of a training row.
SAMPLED_METRICS = ("eval_pass1", "eval_pass_at_k", "eval_maj_at_k")  # Evaluation fields of `config.eval` samples.


def phase_seconds(row: dict) -> list[float]:
  """The seconds a training row puts on the training clock, as (rollout, reward, update). An asynchronous row
  (`rollout_wait_s` present: generation and scoring ran on another thread, overlapping earlier updates) counts only
  what the learner waited for its rollouts, then its update: the step's critical path."""
  if "rollout_wait_s" in row:
    return [float(row["rollout_wait_s"]), 0.0, float(row["update_s"])]
  return [float(row[p]) for p in PHASES]


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run.

  Attributes:
    name: the run's directory name.
    rule: learning-rate rule of its family (`config.optim.lr_rule`).
    batch: rollouts per update (`config.batch_size`).
    seed: `config.seed`.
    sample_budget: samples the run was configured to train on.
    eval_samples: (E,) cumulative samples at each evaluation, increasing.
    eval_accuracy: (E,) the analysed evaluation metric at those samples (0..1; `metric` of `load_study`, by default
      `eval_accuracy`, the greedy held-out accuracy).
    train_samples: (N,) cumulative samples after each training step, increasing; N >= 2.
    phase_s: (N, 3) seconds of each step in rollout / reward / update.
    cold: (N,) bool, rows that include compilation (first of a run or of a resumed session).
    staleness: `config.rl.max_staleness` (steps generation ran ahead of the learner; 0 = synchronous).
    stopped_early: the run ended before its budget at an evaluation that reached `config.stop_at_accuracy`.
  """
  name: str
  rule: str
  batch: int
  seed: int
  sample_budget: int
  eval_samples: np.ndarray
  eval_accuracy: np.ndarray
  train_samples: np.ndarray
  phase_s: np.ndarray
  cold: np.ndarray
  staleness: int = 0
  stopped_early: bool = False

  @property
  def member(self) -> str:
    return f"{self.rule}_b{self.batch}" + (f"_k{self.staleness}" if self.staleness else "")

  @property
  def finished(self) -> bool:
    return bool(self.train_samples[-1] >= self.sample_budget) or self.stopped_early


def _read_config(run_dir: str) -> tuple[dict, str, int, int, int, int]:
  """(config.json's config, completed by `rundir.read_config`; lr rule, batch, seed, sample budget, staleness)."""
  try:
    config = rundir.read_config(run_dir)["config"]
    return (config, config["optim"]["lr_rule"], int(config["batch_size"]), int(config["seed"]),
            int(config["sample_budget"]), int(config["rl"]["max_staleness"]))
  except (ValueError, KeyError, TypeError) as e:  # ValueError: config.json unreadable (`rundir.read_config`).
    raise ValueError(f"{rundir.config_path(run_dir)} is not a launch.train config.json (needs config.batch_size, "
                     f"config.seed, config.sample_budget, config.optim.lr_rule): {e!r}. Remove the run or rewrite "
                     "it.") from e


def _missing_metric(path: str, line_no: int, row: dict, metric: str) -> ValueError:
  """The error for an evaluation row without the analysed `metric`: what the row has, and how to log it."""
  fields = ", ".join(sorted(key for key in row if key.startswith("eval_")))
  hint = (" eval_pass1, eval_pass_at_k and eval_maj_at_k are logged only with eval.num_samples > 0 (eval_maj_at_k "
          "only for tasks with extract_answer)." if metric in SAMPLED_METRICS else "")
  return ValueError(f"{path}:{line_no}: runs have no {metric}: this evaluation row holds {fields}.{hint} Choose a "
                    "metric every run logs.")


def _read_rows(path: str, metric: str) -> tuple[list[dict], list[dict]]:
  """(training rows, evaluation rows as {samples, accuracy: the row's `metric`}) of a metrics.jsonl."""
  train, evals = [], []
  for line_no, row in rundir.iter_metrics(path):
    if "eval_accuracy" in row and metric not in row:
      raise _missing_metric(path, line_no, row, metric)
    try:
      if "eval_accuracy" in row:
        evals.append(dict(samples=float(row["samples"]), accuracy=float(row[metric])))
      else:
        train.append(dict(samples=float(row["samples"]), phases=phase_seconds(row),
                          cold=bool(row.get("cold", False))))
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"{path}:{line_no} is not a metrics row (training rows need samples, "
                       f"{', '.join(PHASES)}; evaluation rows samples, {metric}): {e!r}. "
                       "Fix or delete that line.") from e
  return train, evals


def _increasing(values: np.ndarray, path: str, what: str) -> None:
  if np.any(np.diff(values) <= 0):
    raise ValueError(f"{path}: {what} samples are not strictly increasing; the log mixes two runs. "
                     "Rerun the member in a fresh directory.")


def read_run(run_dir: str, name: str, metric: str = "eval_accuracy") -> Run | str:
  """The run in `run_dir`, its curve of the evaluation field `metric`, or the reason it is skipped."""
  metrics_path = rundir.metrics_path(run_dir)
  missing = [os.path.basename(p) for p in (rundir.config_path(run_dir), metrics_path) if not os.path.isfile(p)]
  if missing:
    return f"no {' or '.join(missing)}"
  config, rule, batch, seed, budget, staleness = _read_config(run_dir)
  train, evals = _read_rows(metrics_path, metric)
  if len(train) < 2:
    return f"{len(train)} training rows (needs 2: the first is excluded as compile time)"
  if not evals:
    return "no evaluation rows"
  run = Run(name=name, rule=rule, batch=batch, seed=seed, sample_budget=budget,
            eval_samples=np.array([r["samples"] for r in evals]),
            eval_accuracy=np.array([r["accuracy"] for r in evals]),
            train_samples=np.array([r["samples"] for r in train]),
            phase_s=np.array([r["phases"] for r in train]),
            cold=np.array([r["cold"] for r in train]) | clock.first_row_cold(len(train)), staleness=staleness,
            stopped_early=(train[-1]["samples"] < budget
                           and rundir.is_finished(run_dir, config)))
  _increasing(run.eval_samples, metrics_path, "evaluation")
  _increasing(run.train_samples, metrics_path, "training")
  if np.any(run.phase_s < 0) or run.phase_s[~run.cold].sum() <= 0:
    raise ValueError(f"{metrics_path}: phase seconds must be >= 0 and sum to > 0 over the warm (not first, not "
                     "cold) training rows.")
  return run


def load_study(study_dir: str, metric: str = "eval_accuracy") -> tuple[list[Run], list[dict]]:
  """(runs sorted by rule, batch, seed, with curves of the evaluation field `metric`; skipped subdirectories as
  {dir, reason})."""
  if not os.path.isdir(study_dir):
    raise ValueError(f"Study directory {study_dir!r} does not exist; pass the directory holding the run "
                     "subdirectories (<rule>_b<batch>_s<seed>/).")
  runs, skipped, seen = [], [], {}
  for name in sorted(os.listdir(study_dir)):
    run_dir = os.path.join(study_dir, name)
    if not os.path.isdir(run_dir):
      continue
    run = read_run(run_dir, name, metric)
    if isinstance(run, str):
      skipped.append(dict(dir=name, reason=run))
      continue
    key = (run.rule, run.batch, run.staleness, run.seed)
    if key in seen:
      raise ValueError(f"{seen[key]} and {name} in {study_dir} are the same run (rule {run.rule}, batch {run.batch}, "
                       f"staleness {run.staleness}, seed {run.seed}); remove one or give them different seeds.")
    seen[key] = name
    runs.append(run)
  if not runs:
    raise ValueError(f"No runs in {study_dir}: expected subdirectories <rule>_b<batch>_s<seed>/ holding config.json "
                     f"and metrics.jsonl (launch.train --workdir=...); skipped: {skipped or 'nothing found'}.")
  return sorted(runs, key=lambda r: (r.rule, r.batch, r.staleness, r.seed)), skipped
