"""Equal-sample studies: every member of a batch family (rule x batch x seed) trained to the same sample budget.

A member is given by its fields in the vocabulary every family config accepts (`batch=` rollouts per step,
`lr_rule=`, `seed=`): its config is `get_config(base arg + those fields)`, `--set` overrides applied, and the
`family.Member` derived from it names its run directory `workdir/<rule>_b<batch>_s<seed>/` (its own config.json,
metrics.jsonl, checkpoints). Every member is built and validated before any trains. Finished members are skipped and
unfinished ones resume, so rerunning the study command continues where it stopped; a member another process is
running (its workdir lock is held) is skipped with a warning.
"""
import importlib.util
import logging
import math
import os
import time

import ml_collections
import numpy as np

from jaxrl_batch.analysis import clock, runs
from jaxrl_batch.config import family
from jaxrl_batch.config.args import apply_overrides
from jaxrl_batch.runtime import sharding
from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer
from jaxrl_batch.train.workdir_lock import WorkdirBusy


def load_config_module(path: str):
  """The config file at `path` as a module (it must define `get_config(arg)`)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"Config file {path!r} does not exist.")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"Config file {path!r} has no get_config(arg).")
  return module


def member_fields(module, batches: list[int], rules: list[str], num_seeds: int, staleness=(0,)) -> list[dict]:
  """dict(batch, lr_rule, seed[, staleness]) of every rule x batch x staleness x seed (staleness given when > 0);
  empty `batches`/`rules` take the values of the members listed by the config's `sweep()`."""
  if not batches or not rules:
    if not hasattr(module, "sweep"):
      raise ValueError("Give --batches and --rules: the config file has no sweep() to take them from.")
    swept = module.sweep()
    batches = batches or sorted({m["batch"] for m in swept})
    rules = rules or list(dict.fromkeys(m["lr_rule"] for m in swept))
  if num_seeds < 1:
    raise ValueError(f"--seeds={num_seeds}: run at least one seed.")
  if not staleness or any(k < 0 for k in staleness):
    raise ValueError(f"--staleness={list(staleness)}: give steps of staleness >= 0 (0 = synchronous).")
  return [dict(batch=b, lr_rule=r, seed=s, **(dict(staleness=k) if k else {}))
          for r in rules for b in batches for k in staleness for s in range(num_seeds)]


def config_arg(base_arg: str, fields: dict) -> str:
  """The config argument of a member: `base_arg`, then the member's batch, lr_rule and seed (later keys win)."""
  args = [f"{key}={value}" for key, value in fields.items() if key != "staleness"]
  return ",".join(filter(None, [base_arg, *args]))


def member_config(module, base_arg: str, fields: dict, overrides: list[str] = ()) -> ml_collections.ConfigDict:
  """The config of the member `fields` (e.g. dict(batch=256, lr_rule="sqrt", seed=0), and staleness=k for
  rl.max_staleness = k), with `overrides` applied."""
  config = module.get_config(config_arg(base_arg, fields))
  stale = [f"rl.max_staleness={fields['staleness']}"] if "staleness" in fields else []
  apply_overrides(config, [*stale, *overrides])
  return config


def derive(config: ml_collections.ConfigDict, fields: dict, devices=None) -> family.Member:
  """The member `config` describes, validated for the mesh it will run on; it must be the member `fields` asked for."""
  mesh = sharding.make_mesh(**config.mesh, devices=devices)
  member = family.member(config, sharding.data_parallel_size(mesh))
  got = dict(batch=member.batch_size, lr_rule=member.rule, seed=member.seed, staleness=member.algo.max_staleness)
  wrong = {key: got[key] for key, value in fields.items() if got[key] != value}
  if wrong:
    raise ValueError(f"Member {fields} built a config with {', '.join(f'{k}={v!r}' for k, v in wrong.items())}: the "
                     "config's get_config must honour batch=, lr_rule= and seed=, and --set must not override "
                     "batch_size, optim.lr_rule, seed or rl.max_staleness.")
  return member


def run_study(config_path: str, workdir: str, batches: list[int], rules: list[str], num_seeds: int,
              overrides: list[str] = (), devices=None, staleness: list[int] = (0,)) -> list[family.Member]:
  """Runs (or resumes) every member to the same sample budget; returns the members in run order.

  Args:
    config_path: 'configs/x.py' or 'configs/x.py:<base arg>' (e.g. 'configs/grpo_gsm8k_qwen.py:model=tiny_random').
    workdir: the study directory; one subdirectory per member.
    batches, rules: rollouts per step and lr rules of the members; empty: those of the config's `sweep()`.
    num_seeds: seeds 0 .. num_seeds - 1 of each (rule, batch).
    overrides: 'key=value' applied to every member's config.
    devices: devices of each run (default: all).
    staleness: rl.max_staleness of the members (asynchronous RL; 0 = synchronous), a further axis.
  """
  path, _, base_arg = config_path.partition(":")
  module = load_config_module(path)
  fields = member_fields(module, batches, rules, num_seeds, staleness)
  configs = [member_config(module, base_arg, f, overrides) for f in fields]
  todo = [(derive(c, f, devices), c) for c, f in zip(configs, fields)]  # Every member validates before any trains.
  budgets = {m.sample_budget for m, _ in todo}
  if len(budgets) != 1:
    raise ValueError(f"Members have different sample budgets {sorted(budgets)}; a study compares equal samples.")
  os.makedirs(workdir, exist_ok=True)
  start, done = time.time(), 0
  for i, (member, config) in enumerate(todo):
    run_dir = os.path.join(workdir, member.name)
    if rundir.is_finished(run_dir, config):
      logging.info("[%d/%d] %s: finished, skipped.", i + 1, len(todo), member.name)
      continue
    logging.info("[%d/%d] %s: running to %d samples.", i + 1, len(todo), member.name, member.sample_budget)
    try:
      Trainer(config, run_dir, devices=devices).run()
    except WorkdirBusy as e:
      logging.warning("[%d/%d] %s: skipped, another process holds it (%s)", i + 1, len(todo), member.name, e)
      continue
    done += 1
    remaining = sum(not rundir.is_finished(os.path.join(workdir, m.name), c) for m, c in todo)
    logging.info("Study: %d/%d members finished; about %.0f s left.", len(todo) - remaining, len(todo),
                 (time.time() - start) / done * remaining)
  return [m for m, _ in todo]


def sweep_steps(batch: int, steps: int, warmup: int, min_samples: int) -> int:
  """Training steps of a throughput-sweep run at `batch`: the compiling first step, `warmup` untimed steps, then
  max(steps - 1, ceil(min_samples / batch)) timed steps (warmup = min_samples = 0: `steps` steps, the first untimed)."""
  if batch < 1:
    raise ValueError(f"batch={batch}: a throughput sweep's batches are rollouts per step, integers >= 1.")
  if steps < 2 or warmup < 0 or min_samples < 0:
    raise ValueError(f"steps={steps}, warmup={warmup}, min_samples={min_samples}: the sweep needs >= 2 steps (the "
                     "first one compiles and is not timed), warmup >= 0 and min_samples >= 0.")
  return 1 + warmup + max(steps - 1, math.ceil(min_samples / batch))


def untimed_rows(cold: np.ndarray, warmup: int) -> np.ndarray:
  """(N,) bool: the training rows a sweep's R excludes, each cold row (compiling) and the `warmup` rows after it."""
  cold = np.asarray(cold, bool)
  return np.convolve(cold, np.ones(warmup + 1), "full")[:len(cold)] > 0


def _set_aside(run_dir: str, budget: int) -> str:
  """Renames an older sweep run to `run_dir.budget<budget>[.k]` (nothing a run directory holds is erased)."""
  kept, k = f"{run_dir}.budget{budget}", 1
  while os.path.exists(kept):
    kept, k = f"{run_dir}.budget{budget}.{k}", k + 1
  os.rename(run_dir, kept)
  return kept


def throughput_sweep(config_path: str, workdir: str, batches: list[int], rule: str, steps: int,
                     overrides: list[str] = (), devices=None, warmup: int = 0, min_samples: int = 0,
                     repeats: int = 1) -> dict[int, float]:
  """Measured samples/s at each batch from short training runs (no training to target); {batch: R}.

  Each batch is the member dict(batch=B, lr_rule=rule, seed=0) of a study (its engine, packing and lengths), run for
  `sweep_steps` steps in `workdir/b<B>/` with evaluation and checkpoints only at its ends. R is the analysis's
  (`clock.throughput`: rollout + reward + update seconds) over the timed rows: the first (compiling) step and the
  `warmup` steps after it, slower on XLA:CPU while the rarer shapes compile, are excluded. `repeats` > 1 runs the
  batches again, round after round (`b<B>.r<k>/`, the same tokens), and pools each batch's rounds (total samples
  over total seconds), so drift of a shared machine falls on every batch alike. A finished run of at least as many
  steps is reused; a shorter one (an older sweep) is moved to `b<B>.budget<N>` and rerun. `steps`, `warmup` and
  `min_samples` (samples) are those of `sweep_steps`; warmup = min_samples = 0 is the sweep of `steps` steps.
  """
  if repeats < 1:
    raise ValueError(f"repeats={repeats}: the sweep runs each batch at least once.")
  path, _, base_arg = config_path.partition(":")
  module = load_config_module(path)
  fields = [dict(batch=b, lr_rule=rule, seed=0) for b in batches]
  short = ["eval_every_samples=0", "stop_at_accuracy=0", "checkpoint_every_samples=0"]
  budgets = [sweep_steps(f["batch"], steps, warmup, min_samples) * f["batch"] for f in fields]
  configs = [member_config(module, base_arg, f, [*overrides, f"sample_budget={budget}", *short])
             for f, budget in zip(fields, budgets)]
  todo = [(derive(c, f, devices), c) for c, f in zip(configs, fields)]
  rounds = {member.batch_size: [] for member, _ in todo}
  for k in range(repeats):
    for member, config in todo:
      name = f"b{member.batch_size}" + (f".r{k}" if k else "")
      rate = _sweep_run(os.path.join(workdir, name), name, member, config, devices, warmup)
      rounds[member.batch_size].append(rate)
      logging.info("Throughput at batch %d (round %d of %d): %.1f samples/s.", member.batch_size, k + 1, repeats,
                   rate)
  return {batch: len(rates) / sum(1 / r for r in rates) for batch, rates in rounds.items()}


def _sweep_run(run_dir: str, name: str, member, config, devices, warmup: int) -> float:
  """R of one sweep run in `run_dir`, trained first unless a finished run of its budget is there."""
  finished = rundir.finished_samples(run_dir)
  if finished < member.sample_budget:
    saved = rundir.read_config(run_dir)
    if saved is not None and saved["config"]["sample_budget"] != member.sample_budget:
      kept = _set_aside(run_dir, saved["config"]["sample_budget"])
      logging.warning("%s held a sweep run of %d samples (budget %d): moved to %s; rerunning it to %d samples.",
                      run_dir, finished, saved["config"]["sample_budget"], kept, member.sample_budget)
    Trainer(config, run_dir, devices=devices).run()
  run = runs.read_run(run_dir, name)
  if isinstance(run, str):
    raise ValueError(f"Throughput run {run_dir} is not analysable: {run}.")
  return clock.throughput(run.train_samples, run.phase_s, untimed_rows(run.cold, warmup))
