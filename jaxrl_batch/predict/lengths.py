"""Response lengths for a predicted step, from a stated distribution or replayed from a run.

A spec names where one rollout's response length in tokens (EOS included) comes from, clipped to [1, budget]:
`lognormal:MEDIAN:SIGMA` (RL responses' long tail), `uniform:LOW:HIGH` or `fixed:N`, drawn independently; or
`run:DIR`, the lengths a run generated (its metrics rows' `response_lens`), replayed a prompt's group at a time: a
group's samples share a problem, so their lengths move together and a step's longest response is the longest of
B / G problems, not of B independent draws. Draws come from a seeded generator, so every member of a sweep sees the
same distribution and a rerun the same lengths.
"""
import os

import numpy as np

from jaxrl_batch.train import rundir

DRAWN_FORMS = "lognormal:MEDIAN:SIGMA, uniform:LOW:HIGH or fixed:N"
FORMS = "lognormal:MEDIAN:SIGMA, uniform:LOW:HIGH, fixed:N or run:DIR"


def response_lengths(spec: str, batch: int, budget: int, seed: int = 0) -> np.ndarray:
  """`batch` response lengths (int) drawn from `spec`, clipped to [1, budget]."""
  kind, _, rest = spec.partition(":")
  rng = np.random.default_rng(seed)
  if kind == "run":
    drawn = _replayed(rest, batch, rng)
  else:
    drawn = _drawn(spec, batch, rng)
  return np.clip(np.rint(drawn), 1, budget).astype(np.int64)


def prompt_lengths(spec: str, batch: int, budget: int, seed: int = 1) -> np.ndarray:
  """`batch` prompt lengths drawn from a parametric `spec` (a run logs no prompt lengths to replay)."""
  if spec.startswith("run:"):
    raise ValueError(f"Prompt lengths {spec!r}: a run's metrics hold its response lengths, not its prompts'; give "
                     f"{DRAWN_FORMS}.")
  return response_lengths(spec, batch, budget, seed)


def _drawn(spec: str, batch: int, rng: np.random.Generator) -> np.ndarray:
  """`batch` independent draws of a parametric spec."""
  kind, *args = spec.split(":")
  try:
    values = [float(a) for a in args]
  except ValueError:
    values = None
  arity = dict(lognormal=2, uniform=2, fixed=1).get(kind)
  if arity is None or values is None or len(values) != arity or min(values) <= 0:
    raise ValueError(f"Response lengths {spec!r}: give {FORMS} (positive numbers; DIR a run directory).")
  if kind == "lognormal":
    return rng.lognormal(np.log(values[0]), values[1], batch)
  if kind == "uniform":
    return rng.uniform(values[0], values[1], batch)
  return np.full(batch, values[0])


def run_groups(run_dir: str) -> np.ndarray:
  """[N, G] lengths of every prompt group a run generated: each training row's `response_lens` cut into its groups of
  G (the run's `group_size`, config.json)."""
  config = rundir.read_config(run_dir)
  if config is None or not os.path.isfile(rundir.metrics_path(run_dir)):
    raise ValueError(f"Response lengths run:{run_dir}: no run there (it needs metrics.jsonl and config.json); give "
                     f"the directory of a run that trained, or a distribution ({FORMS}).")
  group = config["derived"]["group_size"]
  steps = [r["response_lens"] for r in rundir.read_metrics(run_dir) if r.get("response_lens")]
  if not steps:
    raise ValueError(f"Response lengths run:{run_dir}: its metrics rows hold no `response_lens` (a run from before "
                     f"they were logged, or one that has not trained a step); train it on, or give a distribution "
                     f"({FORMS}).")
  return np.concatenate([np.reshape(lens, (-1, group)) for lens in steps])


def _replayed(run_dir: str, batch: int, rng: np.random.Generator) -> np.ndarray:
  """`batch` lengths made of whole groups of the run, drawn with replacement (the last one cut to fit)."""
  groups_NxG = run_groups(run_dir)
  picked = rng.integers(len(groups_NxG), size=-(-batch // groups_NxG.shape[1]))
  return groups_NxG[picked].reshape(-1)[:batch]
