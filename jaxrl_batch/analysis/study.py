"""`analyze`: a study directory of runs -> analysis.json, report.md and four PNG plots, written into it."""
import json
import math
import os

from jaxrl_batch.analysis import decision, members, noise, plots, report
from jaxrl_batch.analysis.curves import check_smooth, mean_abs_gap
from jaxrl_batch.analysis.runs import load_study

DEFINITIONS = {
    "eval_curve": "the evaluation metric (`metric`; default eval_accuracy, the greedy held-out accuracy) vs samples "
                  "from evaluation rows; smooth=k (odd) is a centred moving average over k points, the window "
                  "shrinking symmetrically at the ends",
    "samples_to_target": "S: first crossing of the target, linearly interpolated between the evaluation points "
                         "around it (the first point's samples if it is already >= target); never reached: "
                         "censored (None), counted in n_censored",
    "training_clock": "cumulative rollout_s + reward_s + update_s of training rows (evaluation and checkpoint time "
                      "excluded; asynchronous rows count rollout_wait_s + update_s, the learner's critical path); "
                      "the first row's seconds (compile time) are replaced by its samples / R",
    "time_to_target_s": "T: the training clock at S, linearly interpolated in samples between training rows",
    "throughput_samples_per_s": "R: samples of training rows except the first / their summed phase seconds; "
                                "<phase>_s_per_sample splits 1/R into rollout, reward, update",
    "aggregate": "member = (rule, batch, staleness); S and T are means over seeds that reached the target, R the "
                 "mean over all seeds; *_ci: 90% percentile bootstrap over seeds (2000 resamples, fixed seed), "
                 "[x, x] for one seed",
    "decision": "against the reference member: gain = R/R0, penalty = S/S0, predicted_time_ratio = penalty/gain, "
                "measured_time_ratio = T/T0 with measured_time_ratio_ci, its 90% percentile bootstrap over both "
                "members' seeds: paired by seed (ci_paired; a seed fixes the warm start both share) when both "
                "reached the target with the same >= 2 seeds and none censored, else resampled independently; "
                "verdict faster if that interval lies below 1, slower if "
                "above, indistinguishable if it contains 1; censored if either member never reached the target",
    "noise": "with --noise_run: that run's mean noise_scale (B_simple, rollouts; with rl.noise_split its "
             "noise_inter in prompts and noise_intra in rollouts) and per rule the predicted samples penalty "
             "(1 + B/B_simple)/(1 + B0/B_simple) next to the measured S/S0, the B_noise of S(B) = S_min (1 + "
             "B/B_noise) fitted to the rule's members, and the batch where the penalty reaches 1.1 (predicted: "
             "0.1 B_simple + 1.1 B0)",
    "invariance_gap": "mean |seed-mean accuracy - reference seed-mean accuracy| over the samples both cover",
    "family_range": "per rule, the contiguous batches around the reference batch with invariance_gap <= "
                    "invariance_tol (synchronous members)",
    "staleness": "per (rule, batch) with asynchronous members (rl.max_staleness = k > 0): each k decided against "
                 "the synchronous member of that rule and batch (gain, penalty, time ratios, verdict), gap = its "
                 "invariance gap to that member's curve, absorbs = the largest k up to which every level's "
                 "penalty <= gain",
}


def _check(target: float, smooth: int, invariance_tol: float, metric: str) -> None:
  if not (isinstance(metric, str) and metric.startswith("eval_")):
    raise ValueError(f"metric={metric!r} must be a field of the evaluation rows: eval_accuracy, eval_pass1, "
                     "eval_pass_at_k, eval_maj_at_k.")
  if not (math.isfinite(target) and 0 < target <= 1):
    raise ValueError(f"target must be a held-out accuracy in (0, 1], got {target}.")
  if invariance_tol < 0:
    raise ValueError(f"invariance_tol must be >= 0 (accuracy units), got {invariance_tol}.")
  check_smooth(smooth)


def analyze(study_dir: str, target: float, reference: str | None = None, smooth: int = 1,
            invariance_tol: float = 0.05, metric: str = "eval_accuracy", noise_run: str | None = None) -> dict:
  """Analyses every run under `study_dir` at `target` of `metric`; writes and returns analysis.json's content.

  Args:
    study_dir: directory of run subdirectories `<rule>_b<batch>[_k<staleness>]_s<seed>/` (config.json,
      metrics.jsonl).
    target: value (0..1) of `metric` to reach.
    reference: member '<rule>_b<batch>[_k<staleness>]' the others are compared with; None: the smallest synchronous
      `sqrt` batch, else the smallest synchronous batch.
    smooth: odd number of evaluation points in the centred moving average (1 = none).
    invariance_tol: largest invariance gap (accuracy units) of a batch inside its rule's family range.
    metric: the evaluation field whose curve is analysed: eval_accuracy (greedy), or with eval.num_samples > 0
      eval_pass1, eval_pass_at_k, eval_maj_at_k (`train.evaluation`); every evaluation row must hold it.
    noise_run: a run directory whose logged gradient noise scale (e.g. the reference member trained with
      rl.noise_split=True) is compared with the penalties the study measured (`analysis.noise`); None: no such
      section.
  """
  _check(target, smooth, invariance_tol, metric)
  runs, skipped = load_study(study_dir, metric)
  study = members.group([members.seed_result(r, target, smooth) for r in runs])
  summaries = [m.summary() for m in study]
  ref = decision.choose_reference(summaries, reference)
  ref_member = next(m for m in study if m.name == ref["member"])
  synchronous = {(m.rule, m.batch): m for m in study if m.staleness == 0}
  for member, summary in zip(study, summaries):
    summary["seeds"] = [r.to_json() for r in member.seeds]
  for member, summary in zip(study, summaries):
    summary.update(decision.decide(summary, ref), invariance_gap=mean_abs_gap(member.curve, ref_member.curve))
    sync = synchronous.get((member.rule, member.batch))
    if member.staleness and sync is not None:
      summary["staleness_gap"] = mean_abs_gap(member.curve, sync.curve)
  families = {}
  for rule in sorted({m.rule for m in study}):
    gaps = {s["batch"]: s["invariance_gap"] for s in summaries if s["rule"] == rule and not s["staleness"]}
    families[rule] = dict(reference_batch=ref["batch"],
                          range=decision.family_range(gaps, ref["batch"], invariance_tol))
  analysis = dict(target=target, metric=metric, reference=ref["member"], smooth=smooth, invariance_tol=invariance_tol,
                  definitions=DEFINITIONS, members=summaries, families=families,
                  staleness=decision.staleness(summaries), skipped=skipped)
  if noise_run:
    analysis["noise"] = noise.compare(noise.measured(noise_run), summaries, ref)
  analysis["files"] = ["analysis.json", "report.md"] + plots.write(study, summaries, target, study_dir, metric)
  with open(os.path.join(study_dir, "analysis.json"), "w") as f:
    json.dump(analysis, f, indent=2)
  with open(os.path.join(study_dir, "report.md"), "w") as f:
    f.write(report.render(analysis))
  return analysis
