"""Equal-sample studies: every member of a batch family (rule x batch x seed) trained to the same sample budget.

Each member runs in `workdir/<rule>_b<batch>_s<seed>/` (its own config.json, metrics.jsonl, checkpoints). Finished
members are skipped and unfinished ones resume, so rerunning the study command continues where it stopped.
"""
import dataclasses
import importlib.util
import json
import logging
import os
import time

import ml_collections

from jaxrl_batch.analysis import clock, runs
from jaxrl_batch.config_args import apply_overrides
from jaxrl_batch.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Member:
  rule: str
  batch: int
  seed: int

  @property
  def name(self) -> str:
    return f"{self.rule}_b{self.batch}_s{self.seed}"


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


def members(module, batches: list[int], rules: list[str], num_seeds: int) -> list[Member]:
  """rule x batch x seed; empty `batches`/`rules` take the values listed by the config's `sweep()`."""
  if not batches or not rules:
    if not hasattr(module, "sweep"):
      raise ValueError("Give --batches and --rules: the config file has no sweep() to take them from.")
    swept = [dict(item.split("=") for item in arg.split(",")) for arg in module.sweep()]
    batches = batches or sorted({int(s["batch"]) for s in swept})
    rules = rules or list(dict.fromkeys(s["lr_rule"] for s in swept))
  if num_seeds < 1:
    raise ValueError(f"--seeds={num_seeds}: run at least one seed.")
  return [Member(r, b, s) for r in rules for b in batches for s in range(num_seeds)]


def member_config(module, base_arg: str, member: Member, overrides: list[str]) -> ml_collections.ConfigDict:
  arg = ",".join(filter(None, [base_arg, f"batch={member.batch}", f"lr_rule={member.rule}", f"seed={member.seed}"]))
  config = module.get_config(arg)
  apply_overrides(config, overrides)
  return config


def finished_samples(run_dir: str) -> int:
  """Cumulative samples of a run's last training row (0 if it has none)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return max((r["samples"] for r in rows if "reward_mean" in r), default=0)


def run_study(config_path: str, workdir: str, batches: list[int], rules: list[str], num_seeds: int,
              overrides: list[str] = (), devices=None) -> list[Member]:
  """Runs (or resumes) every member to the same sample budget; returns the members in run order."""
  path, _, base_arg = config_path.partition(":")
  module = load_config_module(path)
  todo = members(module, batches, rules, num_seeds)
  configs = {m: member_config(module, base_arg, m, overrides) for m in todo}  # Every member validates first.
  budgets = {c.sample_budget for c in configs.values()}
  if len(budgets) != 1:
    raise ValueError(f"Members have different sample budgets {sorted(budgets)}; a study compares equal samples.")
  os.makedirs(workdir, exist_ok=True)
  start, done = time.time(), 0
  for i, member in enumerate(todo):
    run_dir = os.path.join(workdir, member.name)
    config = configs[member]
    if finished_samples(run_dir) >= config.sample_budget:
      logging.info("[%d/%d] %s: finished, skipped.", i + 1, len(todo), member.name)
      continue
    logging.info("[%d/%d] %s: running to %d samples.", i + 1, len(todo), member.name, config.sample_budget)
    Trainer(config, run_dir, devices=devices).run()
    done += 1
    per_member = (time.time() - start) / done
    remaining = sum(finished_samples(os.path.join(workdir, m.name)) < configs[m].sample_budget for m in todo)
    logging.info("Study: %d/%d members finished; about %.0f s left.", len(todo) - remaining, len(todo),
                 per_member * remaining)
  return todo


def throughput_sweep(config_path: str, workdir: str, batches: list[int], rule: str, steps: int,
                     overrides: list[str] = (), devices=None) -> dict[int, float]:
  """Measured samples/s at each batch from `steps` training steps (no training to target); {batch: R}.

  Each batch runs in `workdir/b<batch>/` like a study member (resumable), with evaluation and checkpoints only at
  its end; R excludes the first (compiling) step, as in the analysis.
  """
  if steps < 2:
    raise ValueError(f"steps={steps}: the sweep needs >= 2 steps (the first one compiles and is not timed).")
  path, _, base_arg = config_path.partition(":")
  module = load_config_module(path)
  rates = {}
  for batch in batches:
    member = Member(rule, batch, 0)
    budget = [f"sample_budget={steps * batch}", "eval_every_samples=0", "checkpoint_every_samples=0"]
    run_dir = os.path.join(workdir, f"b{batch}")
    config = member_config(module, base_arg, member, [*overrides, *budget])
    if finished_samples(run_dir) < config.sample_budget:
      Trainer(config, run_dir, devices=devices).run()
    run = runs.read_run(run_dir, f"b{batch}")
    if isinstance(run, str):
      raise ValueError(f"Throughput run {run_dir} is not analysable: {run}.")
    rates[batch] = clock.throughput(run.train_samples, run.phase_s, run.cold)
    logging.info("Throughput at batch %d: %.1f samples/s.", batch, rates[batch])
  return rates
