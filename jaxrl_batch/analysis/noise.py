"""Does the gradient noise scale, measured during one run, predict where a study's samples penalty starts?

McCandlish et al. (2018): with the critical batch B_crit ~ B_simple, samples to target grow as
S(B) = S_min (1 + B / B_noise). Given one run's measured noise scale (`rl.noise_scale`, rollouts), the samples
penalty of batch B against the reference batch B0 is predicted as
  penalty(B) = (1 + B / B_simple) / (1 + B0 / B_simple),
next to the penalty S(B) / S(B0) each rule measured and the B_noise of that rule's S(B) fit; the penalty "starts"
where it reaches PENALTY_START (predicted: at B = (PENALTY_START - 1) B_simple + PENALTY_START B0). With
`rl.noise_split` the run also gives B_simple's inter-prompt part (prompts) and intra-prompt part (rollouts).

The same run also gives S(B) itself, for a plan no study fitted (`samples_model`): B_noise = its B_simple, and S_min
from the samples it needed to reach the target at its own batch b, S_run = S_min (1 + b / B_noise).
"""
import math
import os

import numpy as np

from jaxrl_batch.analysis import members, planner, runs
from jaxrl_batch.train import rundir

FIELDS = ("noise_scale", "noise_inter", "noise_intra")
PENALTY_START = 1.1  # A samples penalty of 10%.


def measured(run_dir: str) -> dict:
  """Means over the training rows of `run_dir` that hold each of FIELDS (absent: None), and the run's batch and
  group size, from its config.json and metrics.jsonl."""
  saved = rundir.read_config(run_dir)
  if saved is None:
    raise ValueError(f"{run_dir} holds no config.json: pass the directory of a launch.train run (its --workdir).")
  config = saved["config"]
  rows = [r for r in rundir.read_metrics(run_dir) if "reward_mean" in r]
  means = {}
  for field in FIELDS:
    values = [r[field] for r in rows if r.get(field) is not None]
    means[field] = float(np.mean(values)) if values else None
  if means["noise_scale"] is None:
    raise ValueError(f"{run_dir} logged no noise_scale: train it with micro-batches (micro_batch_size < the batch) "
                     "or with --config.rl.noise_split=True.")
  batch = int(config["batch_size"])
  group = int(config["group_size"]) or batch // int(config["num_prompts"])
  return dict(run=run_dir, batch=batch, group_size=group, rows=len(rows), **means)


def samples_model(run_dir: str, target: float, metric: str = "eval_accuracy", smooth: int = 1) -> dict:
  """S(B) = S_min (1 + B / B_noise) from the run in `run_dir` that logged noise_scale: B_noise = its mean B_simple,
  S_min = S_run / (1 + b / B_noise), S_run its samples to `target` of `metric` at its batch b, read as the analysis
  reads S (curve smoothed over `smooth` points). plan.json's `samples_model`: those, where they came from, and S_run."""
  noise = measured(run_dir)
  b_noise, batch = noise["noise_scale"], noise["batch"]
  if b_noise <= 0:
    raise ValueError(f"{run_dir} logged a mean noise_scale of {b_noise:.3g} <= 0 over {noise['rows']} rows, not a "
                     "batch: the estimate is too noisy; train the run longer, or give S(B) with "
                     "--samples_model=S_MIN:B_NOISE.")
  run = runs.read_run(run_dir, os.path.basename(os.path.normpath(run_dir)), metric)
  if isinstance(run, str):
    raise ValueError(f"{run_dir} has no curve to read its samples to target from ({run}): train it until it has "
                     "evaluated past the target.")
  seed = members.seed_result(run, target, smooth)
  if seed.samples_to_target is None:
    raise ValueError(f"{run_dir} never reached {metric} >= {target} (its best: {seed.curve[1].max():.3f} after "
                     f"{run.eval_samples[-1]:.0f} samples): give a --target it reached, or train it on more samples.")
  return dict(source="noise_run", run=run_dir, batch=batch, samples_to_target=seed.samples_to_target,
              target=target, metric=metric, smooth=smooth, rows=noise["rows"],
              s_min=seed.samples_to_target / (1 + batch / b_noise), b_noise=b_noise)


def predicted_penalty(batch: float, reference_batch: float, b_simple: float) -> float:
  """S(B) / S(B0) under S = S_min (1 + B / B_simple)."""
  return (1 + batch / b_simple) / (1 + reference_batch / b_simple)


def compare(noise: dict, summaries: list[dict], reference: dict) -> dict:
  """analysis.json's `noise`: the run's measured noise scales and, per rule of the synchronous members, the B_noise
  of its S(B) fit (None with fewer than 2 batches that reached the target) and each batch's measured penalty
  against the one predicted from noise_scale, both relative to the rule's member at the reference batch; where the
  penalty starts, predicted and per rule measured (the first batch above the reference's with a measured penalty
  >= PENALTY_START, None if none)."""
  b_simple, b0 = noise["noise_scale"], reference["batch"]
  rules = {}
  for rule in sorted({s["rule"] for s in summaries if not s["staleness"]}):
    members = sorted((s for s in summaries if s["rule"] == rule and not s["staleness"]), key=lambda s: s["batch"])
    reached = [s for s in members if s["samples_to_target"] is not None]
    fit = None
    if len({s["batch"] for s in reached}) >= 2:
      try:
        s_min, b_noise = planner.fit_samples_model([s["batch"] for s in reached],
                                                   [s["samples_to_target"] for s in reached])
        fit = dict(s_min=s_min, b_noise=None if math.isinf(b_noise) else b_noise)
      except ValueError:
        fit = None
    base = next((s["samples_to_target"] for s in reached if s["batch"] == b0), None)
    rows = [dict(batch=s["batch"], predicted_penalty=predicted_penalty(s["batch"], b0, b_simple),
                 measured_penalty=None if base is None or s["samples_to_target"] is None
                 else s["samples_to_target"] / base) for s in members]
    start = next((r["batch"] for r in rows if r["batch"] > b0 and r["measured_penalty"] is not None
                  and r["measured_penalty"] >= PENALTY_START), None)
    rules[rule] = dict(fit=fit, batches=rows, measured_start=start)
  return dict(noise, reference_batch=b0, penalty_start=PENALTY_START,
              predicted_start=(PENALTY_START - 1) * b_simple + PENALTY_START * b0, rules=rules)
