"""Batch-size planner: predict time-to-target T(B) = S(B) / R(B) for batches that were never trained to target.

- S(B), samples to target, follows the form S(B) = S_min * (1 + B / B_noise) (McCandlish et al. 2018): linear in
  B with intercept S_min and slope S_min / B_noise, fitted by least squares to the members that reached the target.
- R(B), samples per second, is measured directly by a short throughput sweep (a few steps per batch, no training to
  target), and linearly interpolated in log B between swept batches.
The recommendation is the swept batch with the smallest predicted T. A fit with slope <= 0 (no samples penalty
observed) has B_noise = inf: S is flat and the planner then prefers the fastest batch. The fit may be restricted to
the members at a few batches (`learn_batches`), so that the others test the prediction: each trained member's row
holds the relative error of its predicted T.
"""
import math

import numpy as np


def fit_samples_model(batches, samples_to_target) -> tuple[float, float]:
  """(S_min, B_noise) of S(B) = S_min (1 + B / B_noise) by least squares; needs >= 2 distinct batches."""
  b = np.asarray(batches, float)
  s = np.asarray(samples_to_target, float)
  if len(set(b.tolist())) < 2:
    raise ValueError(f"Fitting S(B) needs members at >= 2 batch sizes that reached the target; got {sorted(b)}.")
  slope, intercept = np.polyfit(b, s, 1)
  if intercept <= 0:
    raise ValueError(f"The S(B) fit has a non-positive S_min ({intercept:.3g}); the measured S do not follow "
                     "S_min (1 + B / B_noise). Run more seeds or batches.")
  return float(intercept), (float(intercept / slope) if slope > 0 else math.inf)


def predicted_samples(batch: float, s_min: float, b_noise: float) -> float:
  return s_min * (1.0 + batch / b_noise)


def interpolate_throughput(batch: float, swept: dict[int, float]) -> float:
  """R at `batch` from a sweep {B: samples/s}, linear in log B (clamped at the ends)."""
  xs = sorted(swept)
  return float(np.interp(math.log(batch), [math.log(x) for x in xs], [swept[x] for x in xs]))


def plan(swept: dict[int, float], measured: dict[int, tuple[float, float | None]],
         learn_batches: list[int] | None = None, predicted: bool = False,
         samples_model: tuple[float, float] | None = None) -> dict:
  """Predicted T(B) at every swept batch, predicted vs measured T where a member was trained, and per batch the
  decision rule's two factors against the smallest swept batch B0: throughput_gain R(B) / R(B0) and
  samples_penalty S(B) / S(B0) (a larger batch is faster to target when the gain exceeds the penalty).

  Args:
    swept: {batch: samples/s}: measured by the throughput sweep, or `predicted` from compiled programs.
    measured: {batch: (samples_to_target, time_to_target_s)} of the study's members of one rule (None: censored).
    learn_batches: the batches whose members the S(B) fit uses; None: every member that reached the target.
    predicted: whether `swept` holds predictions (each swept row's `predicted`).
    samples_model: (S_min, B_noise) given instead of fitted (then `measured` is not fitted: give it empty).
  """
  if samples_model is not None:
    return _rows(swept, measured, {}, *samples_model, predicted)
  reached = {b: st[0] for b, st in measured.items() if st[0] is not None}
  if learn_batches is not None:
    missing = sorted(set(learn_batches) - set(reached))
    if missing:
      raise ValueError(f"Learn batches {missing} have no member that reached the target; members that did: "
                       f"{sorted(reached)}.")
    reached = {b: reached[b] for b in learn_batches}
  return _rows(swept, measured, reached, *fit_samples_model(list(reached), list(reached.values())), predicted)


def _rows(swept: dict[int, float], measured: dict, reached: dict, s_min: float, b_noise: float,
          predicted: bool) -> dict:
  """`plan`'s result for the S(B) model (s_min, b_noise), fitted to the members `reached` (or given: none)."""
  rows, b0 = [], min(swept)
  for batch in sorted(set(swept) | set(measured)):
    rate = swept[batch] if batch in swept else interpolate_throughput(batch, swept)
    samples = predicted_samples(batch, s_min, b_noise)
    predicted_t, measured_t = samples / rate, measured.get(batch, (None, None))[1]
    rows.append(dict(batch=batch, throughput_samples_per_s=rate, predicted_samples_to_target=samples,
                     predicted_time_to_target_s=predicted_t, measured_time_to_target_s=measured_t,
                     error=None if measured_t is None else predicted_t / measured_t - 1, swept=batch in swept,
                     in_fit=batch in reached, predicted=predicted and batch in swept,
                     throughput_gain=rate / swept[b0],
                     samples_penalty=samples / predicted_samples(b0, s_min, b_noise)))
  best = min((r for r in rows if r["swept"]), key=lambda r: r["predicted_time_to_target_s"])
  trained = [r for r in rows if r["measured_time_to_target_s"] is not None]
  fastest = min(trained, key=lambda r: r["measured_time_to_target_s"])["batch"] if trained else None
  return dict(s_min=s_min, b_noise=b_noise, rows=rows, recommended_batch=best["batch"],
              learn_batches=sorted(reached), measured_best_batch=fastest)


def render(result: dict) -> str:
  """plan.md: the fit, where R comes from, predicted vs measured T per batch with the decision rule's factors, and the
  recommendation."""
  lines = [f"# Batch plan ({result['rule']} rule, target {result['target']})", "",
           f"S(B) = {result['s_min']:.0f} (1 + B / {result['b_noise']:.0f}) samples to target, "
           + (f"fitted to the members at B = {', '.join(map(str, result['learn_batches']))}."
              if result["learn_batches"] else _given_line(result)),
           _rates_line(result), "",
           "| batch | R samples/s | S predicted | T predicted s | T measured s | error | fitted | R gain | S penalty |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    measured = "-" if r["measured_time_to_target_s"] is None else f"{r['measured_time_to_target_s']:.2f}"
    error = "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"
    lines.append(f"| {r['batch']} | {r['throughput_samples_per_s']:.1f} | {r['predicted_samples_to_target']:.0f} | "
                 f"{r['predicted_time_to_target_s']:.2f} | {measured} | {error} | {'yes' if r['in_fit'] else 'no'} | "
                 f"{r['throughput_gain']:.2f}x | {r['samples_penalty']:.2f}x |")
  lines += ["", f"Recommended batch: {result['recommended_batch']} (smallest predicted T among swept batches); "
            f"fastest trained member: {result['measured_best_batch'] or '-'}.", ""]
  for refused in result.get("refused", ()):
    lines += [f"Not predicted: batch {refused['batch']}: {refused['reason']}", ""]
  return "\n".join(lines + _layout_lines(result))


def _layout_lines(result: dict) -> list[str]:
  """Each member's predicted step in every decode layout (`launch.plan_batch --compare_layouts`), fastest first."""
  mesh = lambda m: " x ".join(f"{axis} {size}" for axis, size in m.items() if size > 1) or "one chip"
  lines = []
  for r in result["rows"]:
    layouts = r.get("step", {}).get("layouts")
    if not layouts:
      continue
    kinds = [f"{t['layout']} ({mesh(t['rollout_mesh'])}): refused, {t['refused']}" if t["refused"] else
             f"{t['layout']} ({mesh(t['rollout_mesh'])}): {t['seconds']:.4f} s, rollout {t['rollout_s']:.4f} s"
             + (f" + reshard {t['reshard_s']:.4f} s" if t["reshard_s"] else "") for t in layouts]
    lines += [f"Decode layouts of batch {r['batch']}, fastest first: " + "; ".join(kinds) + ".", ""]
  return lines


def _given_line(result: dict) -> str:
  """Where an S(B) no study fitted comes from: given, or a noise-scale run's (`noise.samples_model`)."""
  model = result.get("samples_model") or {}
  if model.get("source") != "noise_run":
    return "given."
  return (f"from the noise-scale run {model['run']}: B_noise = its mean B_simple, S_min = its "
          f"{model['samples_to_target']:.0f} samples to {model['metric']} >= {model['target']} at its batch "
          f"{model['batch']} / (1 + {model['batch']} / B_noise).")


def _rates_line(result: dict) -> str:
  """Where R(B) comes from: the measured sweep's settings, or the prediction's topology and lengths."""
  sweep = result["sweep"]
  if "topology" in sweep:
    rates = sweep.get("rates", {})
    how = ("kernel by kernel at this machine's measured rates" if rates.get("launch_s") else
           f"at {rates.get('name', 'the chip')}'s published peak rates")
    return (f"R(B) predicted for {sweep['topology']} ({sweep['num_slices']} slice(s)) from each member's compiled "
            f"programs, {how}, mean steps over {sweep.get('min_samples', 0)} rollouts' lengths: responses "
            f"{sweep['lengths']}, prompts of {sweep['prompt_tokens']} tokens"
            + (f" ({sweep['prompt_lengths']} of them tokens)" if sweep.get("prompt_lengths") else "")
            + f", up to {sweep['response_tokens']} new; reward scoring not counted.")
  return (f"R(B) from >= {sweep['steps'] - 1} timed steps and >= {sweep['min_samples']} samples per batch, after the "
          f"compiling step and {sweep['warmup']} warm-up steps"
          + (f"; {sweep['repeats']} rounds pooled." if sweep.get("repeats", 1) > 1 else "."))
