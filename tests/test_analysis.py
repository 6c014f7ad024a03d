"""Tests for the study analysis, on synthetic run directories with known S, T and R.

Every synthetic step takes 0.5 s (rollout 0.25 + reward 0.125 + update 0.125) except the first, which adds 30 s
of "compile"; so R = batch / 0.5 samples/s and the training clock at samples s is s / R.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_batch.analysis import analyze, clock, curves
from jaxrl_batch.analysis.bootstrap import mean_ci
from tests.close import assert_close

STEP_S = (0.25, 0.125, 0.125)  # rollout, reward, update seconds of every step.
COMPILE_S = 30.0  # Extra rollout seconds of the first step.
MEMBER_FIELDS = {
    "batch", "rule", "samples_to_target", "samples_to_target_ci", "time_to_target_s", "time_to_target_ci",
    "throughput_samples_per_s", "throughput_ci", "rollout_s_per_sample", "reward_s_per_sample",
    "update_s_per_sample", "gain", "penalty", "predicted_time_ratio", "measured_time_ratio",
    "measured_time_ratio_ci", "ci_paired", "verdict",
    "invariance_gap", "n_seeds", "n_censored", "seeds", "staleness"}


def write_run(root, rule, batch, evals, seed=0, budget=1024, steps=None, name=None, staleness=0, speed=1.0):
  """A run dir with evaluation points `evals` [(samples, accuracy)] and `steps` training rows (default: budget);
  `staleness` > 0 writes rl.max_staleness, `speed` divides every step's seconds (asynchronous rows: the step's
  visible seconds, rollout_wait_s + update_s, while generation keeps its own)."""
  run_dir = root / (name or f"{rule}_b{batch}" + (f"_k{staleness}" if staleness else "") + f"_s{seed}")
  run_dir.mkdir()
  config = dict(config=dict(batch_size=batch, seed=seed, sample_budget=budget, optim=dict(lr_rule=rule)),
                derived=dict(lr=1e-4))
  if staleness:
    config["config"]["rl"] = dict(max_staleness=staleness)
  (run_dir / "config.json").write_text(json.dumps(config))
  rows = []
  for step in range(1, (steps or budget // batch) + 1):
    rollout = STEP_S[0] + (COMPILE_S if step == 1 else 0.0)
    if staleness:
      rows.append(dict(step=step, samples=step * batch, wall_s=0.5 * step, rollout_s=rollout, reward_s=STEP_S[1],
                       update_s=STEP_S[2], rollout_wait_s=(rollout + STEP_S[1] + STEP_S[2]) / speed - STEP_S[2],
                       reward_mean=0.5))
    else:
      rows.append(dict(step=step, samples=step * batch, wall_s=0.5 * step, rollout_s=rollout / speed,
                       reward_s=STEP_S[1] / speed, update_s=STEP_S[2] / speed, reward_mean=0.5))
  rows += [dict(step=s // batch, samples=s, wall_s=0.0, eval_accuracy=a) for s, a in evals]
  rows.sort(key=lambda r: (r["samples"], "eval_accuracy" in r))
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return run_dir


def linear(slope, start=0.4, end=1024, every=256):
  """Evaluation points of accuracy = start + slope * samples / 1024."""
  return [(s, start + slope * s / 1024) for s in range(0, end + 1, every)]


def reaching(s_true, end=1024):
  """Evaluation points crossing accuracy 0.6 exactly at samples `s_true` (linear from 0.4 at 0)."""
  return [(s, 0.4 + 0.2 * s / s_true) for s in range(0, end + 1, 256)]


def by_name(analysis):
  return {m["member"]: m for m in analysis["members"]}


def test_samples_to_target_interpolates_between_eval_points():
  samples, accuracy = np.array([0, 256, 512, 768]), np.array([0.4, 0.5, 0.7, 0.9])
  assert curves.samples_to_target(samples, accuracy, 0.6) == pytest.approx(384)  # 256 + 0.1/0.2 * 256
  assert curves.samples_to_target(samples, accuracy, 0.7) == 512
  assert curves.samples_to_target(samples, accuracy, 0.3) == 0  # Already there at the first point.
  assert curves.samples_to_target(samples, accuracy, 0.95) is None


def test_clock_excludes_first_row_and_interpolates_in_samples():
  train_samples = np.array([64, 128, 192])
  phase_s = np.array([[30.0, 0, 0], [1.0, 0, 0], [2.0, 0.5, 0.5]])  # Steps 2..3: 128 samples in 4 s.
  assert clock.throughput(train_samples, phase_s) == 32
  assert_close(clock.seconds_per_sample(train_samples, phase_s), [3 / 128, 0.5 / 128, 0.5 / 128], 1e-7)
  # Knots: (0, 0), (64, 64/32 = 2), (128, 3), (192, 6).
  assert_close(clock.clock_at(train_samples, phase_s, [32, 64, 96, 160]), [1, 2, 2.5, 4.5], 1e-7)


def test_single_run_S_T_R_exact(tmp_path):
  write_run(tmp_path, "sqrt", 64, [(0, 0.4), (256, 0.5), (512, 0.7), (768, 0.9), (1024, 0.95)])
  m = by_name(analyze(str(tmp_path), target=0.6))["sqrt_b64"]
  assert m["samples_to_target"] == pytest.approx(384)
  assert m["time_to_target_s"] == pytest.approx(3.0)  # 384 samples at 128 samples/s; the 30 s compile excluded.
  assert m["throughput_samples_per_s"] == pytest.approx(128)
  assert [m[f"{p}_s_per_sample"] for p in ("rollout", "reward", "update")] == pytest.approx(
      [0.25 / 64, 0.125 / 64, 0.125 / 64])
  assert m["samples_to_target_ci"] == [m["samples_to_target"]] * 2
  assert m["time_to_target_ci"] == [m["time_to_target_s"]] * 2
  assert m["throughput_ci"] == [m["throughput_samples_per_s"]] * 2
  assert (m["n_seeds"], m["n_censored"], m["verdict"], m["gain"], m["invariance_gap"]) == (1, 0, "reference", 1, 0)
  assert m["seeds"] == [dict(dir="sqrt_b64_s0", seed=0, samples_to_target=m["samples_to_target"],
                             time_to_target_s=m["time_to_target_s"], throughput_samples_per_s=128.0,
                             finished=True, censored=False)]


def test_bootstrap_interval_brackets_the_mean(tmp_path):
  for seed, s_true in enumerate((384, 512, 640)):
    write_run(tmp_path, "sqrt", 64, reaching(s_true), seed=seed)
  m = by_name(analyze(str(tmp_path), target=0.6))["sqrt_b64"]
  assert m["samples_to_target"] == pytest.approx(512)
  lo, hi = m["samples_to_target_ci"]
  assert 384 <= lo < 512 < hi <= 640
  assert m["time_to_target_ci"] == pytest.approx([lo / 128, hi / 128])
  assert mean_ci([]) is None
  assert mean_ci([2.5]) == [2.5, 2.5]


def test_censored_seed_is_counted_not_dropped(tmp_path):
  write_run(tmp_path, "sqrt", 64, reaching(512), seed=0)
  write_run(tmp_path, "sqrt", 64, linear(0.1, end=512), seed=1, budget=1024, steps=8)  # Stopped at 512 samples.
  write_run(tmp_path, "none", 128, linear(0.1))
  analysis = analyze(str(tmp_path), target=0.6)
  m = by_name(analysis)["sqrt_b64"]
  assert (m["n_seeds"], m["n_censored"]) == (2, 1)
  assert m["samples_to_target"] == pytest.approx(512)  # Mean over the seeds that reached the target.
  censored = m["seeds"][1]
  assert (censored["censored"], censored["finished"], censored["samples_to_target"]) == (True, False, None)
  assert censored["time_to_target_s"] is None
  never = by_name(analysis)["none_b128"]
  assert (never["n_censored"], never["samples_to_target"], never["time_to_target_ci"]) == (1, None, None)
  assert never["verdict"] == "censored"
  assert (never["penalty"], never["predicted_time_ratio"], never["measured_time_ratio"]) == (None, None, None)
  assert never["gain"] == pytest.approx(2)  # Throughput does not depend on the target.


def test_decision_faster_and_slower(tmp_path):
  write_run(tmp_path, "sqrt", 64, reaching(384), budget=2560)  # R = 128, S = 384, T = 3.
  write_run(tmp_path, "sqrt", 128, reaching(512), budget=2560)  # R = 256, S = 512, T = 2.
  write_run(tmp_path, "none", 256, reaching(2048, end=2560), budget=2560)  # R = 512, S = 2048, T = 4.
  members = by_name(analyze(str(tmp_path), target=0.6))
  fast, slow = members["sqrt_b128"], members["none_b256"]
  assert (fast["gain"], fast["penalty"]) == pytest.approx((2, 4 / 3))
  assert (fast["predicted_time_ratio"], fast["measured_time_ratio"]) == pytest.approx((2 / 3, 2 / 3))
  assert fast["verdict"] == "faster"
  assert (slow["gain"], slow["penalty"]) == pytest.approx((4, 16 / 3))
  assert (slow["predicted_time_ratio"], slow["measured_time_ratio"]) == pytest.approx((4 / 3, 4 / 3))
  assert slow["verdict"] == "slower"
  report = (tmp_path / "report.md").read_text()
  assert "The fastest to accuracy 0.6 is sqrt_b128" in report
  assert "Are the un-retuned (`none`) larger batches slower? yes: none_b256 slower (1.33x)." in report


def test_verdicts_are_faster_or_slower_only_when_the_ratio_interval_excludes_1(tmp_path):
  """Three seeds per member: S varies over seeds. sqrt_b128's times are all below the reference's (faster);
  none_b128's straddle them (indistinguishable, though its mean ratio is below 1)."""
  for seed, s in enumerate((384, 448, 512)):  # R = 128: T = 3, 3.5, 4
    write_run(tmp_path, "sqrt", 64, reaching(s), budget=2560, seed=seed)
  for seed, s in enumerate((512, 576, 640)):  # R = 256: T = 2, 2.25, 2.5
    write_run(tmp_path, "sqrt", 128, reaching(s), budget=2560, seed=seed)
  for seed, s in enumerate((512, 768, 1152)):  # R = 256: T = 2, 3, 4.5
    write_run(tmp_path, "none", 128, reaching(s, end=2560), budget=2560, seed=seed)
  analysis = analyze(str(tmp_path), target=0.6)
  members = by_name(analysis)
  fast, unsure = members["sqrt_b128"], members["none_b128"]
  assert fast["verdict"] == "faster" and fast["measured_time_ratio_ci"][1] < 1
  assert unsure["measured_time_ratio"] == pytest.approx(9.5 / 10.5) and unsure["verdict"] == "indistinguishable"
  lo, hi = unsure["measured_time_ratio_ci"]
  assert lo < 1 < hi
  # The interval is a bootstrap of the two members' seed means, paired by seed (the same seeds reached the target in
  # both): within the extreme per-seed ratios, around the mean one.
  assert unsure["ci_paired"] and 2 / 3 <= lo < unsure["measured_time_ratio"] < hi <= 4.5 / 4
  report = (tmp_path / "report.md").read_text()
  assert f"| 0.90x [{lo:.2f}, {hi:.2f}] p | indistinguishable |" in report


def test_seeds_that_share_a_warm_start_are_paired(tmp_path):
  """The seed sets T for both members (T = 2, 4, 8 s at B0 = 64; 0.9x that at 128): resampled independently the
  ratio's interval straddles 1, paired by seed it is 0.9 exactly: faster. A censored seed unpairs the members."""
  for seed, t in enumerate((2.0, 4.0, 8.0)):
    write_run(tmp_path, "sqrt", 64, reaching(t * 128, end=2048), budget=2048, seed=seed)
    write_run(tmp_path, "sqrt", 128, reaching(0.9 * t * 256, end=2048), budget=2048, seed=seed)
    write_run(tmp_path, "none", 128, reaching(0.9 * t * 256 if seed else 4096, end=2048), budget=2048, seed=seed)
  members = by_name(analyze(str(tmp_path), target=0.6))
  paired, unpaired = members["sqrt_b128"], members["none_b128"]
  assert paired["ci_paired"] and paired["measured_time_ratio_ci"] == pytest.approx([0.9, 0.9])
  assert paired["verdict"] == "faster"
  assert not unpaired["ci_paired"] and unpaired["n_censored"] == 1
  lo, hi = unpaired["measured_time_ratio_ci"]
  assert lo < 1 < hi and unpaired["verdict"] == "indistinguishable"


def test_staleness_members_are_decided_against_their_synchronous_batch(tmp_path):
  write_run(tmp_path, "sqrt", 64, reaching(384), budget=2560)  # R = 128, S = 384.
  write_run(tmp_path, "sqrt", 64, reaching(448), budget=2560, staleness=1, speed=1.5)  # penalty 7/6 < gain 1.5
  write_run(tmp_path, "sqrt", 64, reaching(640), budget=2560, staleness=2, speed=1.5)  # penalty 5/3 > gain 1.5
  write_run(tmp_path, "sqrt", 128, reaching(512), budget=2560)
  analysis = analyze(str(tmp_path), target=0.6)
  assert analysis["reference"] == "sqrt_b64"  # the synchronous member, not an asynchronous one of the same batch
  # Family ranges are over synchronous members: the asynchronous ones at batch 64 do not stand for batch 64.
  assert analysis["families"]["sqrt"] == dict(reference_batch=64, range=[64, 64])
  assert by_name(analysis)["sqrt_b64_k2"]["invariance_gap"] > analysis["invariance_tol"]
  [batch] = analysis["staleness"]
  assert (batch["synchronous"], batch["absorbs"]) == ("sqrt_b64", 1)
  k1, k2 = batch["levels"]
  assert (k1["member"], k1["gain"], k1["penalty"], k1["verdict"]) == ("sqrt_b64_k1", pytest.approx(1.5),
                                                                      pytest.approx(7 / 6), "faster")
  assert k1["measured_time_ratio"] == pytest.approx(7 / 9)
  assert (k2["member"], k2["penalty"], k2["verdict"]) == ("sqrt_b64_k2", pytest.approx(5 / 3), "slower")
  assert k1["gap"] == pytest.approx(by_name(analysis)["sqrt_b64_k1"]["staleness_gap"]) and 0 < k1["gap"] < k2["gap"]
  report = (tmp_path / "report.md").read_text()
  assert "`sqrt_b64` absorbs staleness up to k = 1" in report and "| sqrt_b64_k2 | 2 |" in report


def test_invariance_gap_and_family_range(tmp_path):
  write_run(tmp_path, "sqrt", 64, linear(0.4))  # Reference.
  write_run(tmp_path, "sqrt", 128, linear(0.36, end=2048), budget=2048)  # Gap 0.04/2 over the shared [0, 1024].
  write_run(tmp_path, "sqrt", 256, linear(0.32))  # 0.04.
  write_run(tmp_path, "sqrt", 512, linear(0.2))  # 0.1: breaks the family.
  write_run(tmp_path, "sqrt", 1024, linear(0.38), budget=2048)  # 0.01, but not contiguous with the reference.
  write_run(tmp_path, "none", 64, linear(0.46))  # 0.03.
  write_run(tmp_path, "none", 128, linear(0.2))  # 0.1.
  write_run(tmp_path, "linear", 128, linear(0.2, start=0.5))  # Crosses the reference at 512: two triangles, 0.05.
  analysis = analyze(str(tmp_path), target=0.6, invariance_tol=0.06)
  gaps = {name: m["invariance_gap"] for name, m in by_name(analysis).items()}
  assert gaps == pytest.approx(dict(sqrt_b64=0, sqrt_b128=0.02, sqrt_b256=0.04, sqrt_b512=0.1, sqrt_b1024=0.01,
                                    none_b64=0.03, none_b128=0.1, linear_b128=0.05))
  assert analysis["families"] == dict(linear=dict(reference_batch=64, range=[128, 128]),
                                      none=dict(reference_batch=64, range=[64, 64]),
                                      sqrt=dict(reference_batch=64, range=[64, 256]))
  tight = analyze(str(tmp_path), target=0.6, invariance_tol=0.035)["families"]
  assert (tight["sqrt"]["range"], tight["none"]["range"], tight["linear"]["range"]) == ([64, 128], [64, 64], None)


def test_reference_default_and_explicit(tmp_path):
  write_run(tmp_path, "none", 32, linear(0.4))
  write_run(tmp_path, "linear", 64, linear(0.4))
  assert analyze(str(tmp_path), target=0.6)["reference"] == "none_b32"  # No sqrt: the smallest batch.
  write_run(tmp_path, "sqrt", 128, linear(0.4))
  write_run(tmp_path, "sqrt", 256, linear(0.4))
  assert analyze(str(tmp_path), target=0.6)["reference"] == "sqrt_b128"  # The smallest sqrt batch.
  assert analyze(str(tmp_path), target=0.6, reference="linear_b64")["reference"] == "linear_b64"
  with pytest.raises(ValueError, match=r"'sqrt_b999' is not in the study; pick one of \['linear_b64'"):
    analyze(str(tmp_path), target=0.6, reference="sqrt_b999")
  with pytest.raises(ValueError, match=r"is not '<rule>_b<batch>' or '<rule>_b<batch>_k<staleness>'"):
    analyze(str(tmp_path), target=0.6, reference="b64")


def test_smoothing(tmp_path):
  assert_close(curves.smooth(np.array([0, 0.3, 0.6, 0.3, 0.9]), 3), [0, 0.3, 0.4, 0.6, 0.9], 1e-7)
  assert_close(curves.smooth(np.array([0, 0.3, 0.6, 0.3, 0.9]), 5), [0, 0.3, 0.42, 0.6, 0.9], 1e-7)
  with pytest.raises(ValueError, match="smooth must be an odd number"):
    curves.smooth(np.zeros(3), 2)
  write_run(tmp_path, "sqrt", 64, [(0, 0.4), (256, 0.8), (512, 0.4), (768, 0.8), (1024, 0.8)])
  assert by_name(analyze(str(tmp_path), target=0.7))["sqrt_b64"]["samples_to_target"] == pytest.approx(192)
  # Smoothed: 0.4, 0.533, 0.667, 0.667, 0.8 -> crosses 0.7 a quarter of the way from 768 to 1024.
  smoothed = analyze(str(tmp_path), target=0.7, smooth=3)
  assert (smoothed["smooth"], by_name(smoothed)["sqrt_b64"]["samples_to_target"]) == (3, pytest.approx(832))


def test_outputs_and_contract(tmp_path):
  write_run(tmp_path, "sqrt", 64, reaching(384))
  write_run(tmp_path, "none", 128, reaching(512))
  (tmp_path / "sqrt_b256_s0").mkdir()  # A run that has not written anything yet.
  (tmp_path / "sqrt_b256_s0" / "config.json").write_text("{}")
  write_run(tmp_path, "sqrt", 512, [(0, 0.4)], steps=1)  # Only the compile step so far.
  analysis = analyze(str(tmp_path), target=0.6)
  on_disk = json.loads((tmp_path / "analysis.json").read_text())
  assert on_disk == analysis
  assert {"target", "reference", "smooth", "definitions", "members", "families", "skipped"} <= set(on_disk)
  for m in on_disk["members"]:
    assert MEMBER_FIELDS <= set(m)
    assert set(m["seeds"][0]) == {"dir", "seed", "samples_to_target", "time_to_target_s",
                                  "throughput_samples_per_s", "finished", "censored"}
  assert on_disk["skipped"] == [
      dict(dir="sqrt_b256_s0", reason="no metrics.jsonl"),
      dict(dir="sqrt_b512_s0", reason="1 training rows (needs 2: the first is excluded as compile time)")]
  report = (tmp_path / "report.md").read_text()
  assert "| member | seeds | S samples [90% CI]" in report and "| sqrt_b64 | 1 | 384 [384, 384]" in report
  assert "`sqrt` keeps the accuracy-vs-samples curve within 0.05 of the reference only at batch 64." in report
  assert "- `sqrt_b256_s0`: no metrics.jsonl" in report
  for name in ("accuracy_vs_samples.png", "accuracy_vs_time.png", "throughput_vs_batch.png",
               "time_to_target_vs_batch.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_study_dirs_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    analyze(str(tmp_path / "missing"), target=0.6)
  with pytest.raises(ValueError, match="No runs in .*<rule>_b<batch>_s<seed>"):
    analyze(str(tmp_path), target=0.6)
  run_dir = write_run(tmp_path, "sqrt", 64, reaching(384))
  with pytest.raises(ValueError, match=r"target must be a held-out accuracy in \(0, 1\]"):
    analyze(str(tmp_path), target=60)
  good = (run_dir / "metrics.jsonl").read_text()
  lines = len(good.splitlines())
  (run_dir / "metrics.jsonl").write_text(good + '{"step": 17, "samples": 1088, "rollout_s": 0.2}\n')
  with pytest.raises(ValueError, match=fr"metrics.jsonl:{lines + 1} is not a metrics row \(training rows need "
                     r"samples, rollout_s, reward_s, update_s.*KeyError\('reward_s'\).*Fix or delete that line"):
    analyze(str(tmp_path), target=0.6)
  (run_dir / "metrics.jsonl").write_text(good + '{"step": 17, "samples": 1088, "rollout_s": 0.2\n')
  with pytest.raises(ValueError, match=fr"metrics.jsonl:{lines + 1} is not a JSON metrics row .*Fix or delete that"):
    analyze(str(tmp_path), target=0.6)
  (run_dir / "metrics.jsonl").unlink()
  write_run(tmp_path, "sqrt", 64, reaching(384), name="copy")
  write_run(tmp_path, "sqrt", 64, reaching(384), name="copy2")
  with pytest.raises(ValueError, match="copy and copy2 .* are the same run"):
    analyze(str(tmp_path), target=0.6)
  (tmp_path / "copy2" / "config.json").write_text('{"config": {"batch_size": 64}}')
  with pytest.raises(ValueError, match="copy2/config.json is not a launch.train config.json .*KeyError"):
    analyze(str(tmp_path), target=0.6)
  (tmp_path / "copy2" / "config.json").write_text('{"config": ')
  with pytest.raises(ValueError, match="copy2/config.json is not a launch.train config.json .*Remove the run or"):
    analyze(str(tmp_path), target=0.6)


@pytest.mark.slow
def test_launcher_prints_table_and_paths(tmp_path):
  write_run(tmp_path, "sqrt", 64, reaching(384))
  proc = subprocess.run([sys.executable, "-m", "launch.analyze", f"--workdir={tmp_path}", "--target=0.6"],
                        capture_output=True, text=True, check=False, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == 0, proc.stderr
  assert "| sqrt_b64 | 1 | 384 [384, 384]" in proc.stdout
  assert os.path.join(str(tmp_path), "report.md") in proc.stdout


def test_cold_rows_after_a_resume_are_charged_at_the_steady_rate():
  # Four steps of 32 samples, 1 s each when warm; rows 1 and 3 are cold (compile) and took 9 s.
  train_samples = np.array([32.0, 64.0, 96.0, 128.0])
  phase_s = np.array([[9.0, 0.0, 0.0], [1.0, 0.0, 0.0], [9.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
  cold = np.array([True, False, True, False])
  assert clock.throughput(train_samples, phase_s, cold) == 32
  assert_close(clock.clock_at(train_samples, phase_s, [64, 128], cold), [2, 4], 1e-7)
  # Without the marker only the first row is excluded, and the resume's compile time counts.
  assert_close(clock.clock_at(train_samples, phase_s, [128]), [32 / (96 / 11) + 11], 1e-7)


def test_noise_scale_of_one_run_against_the_measured_penalties(tmp_path):
  """S = 500, 500, 600, 1000 at batches 16..128 (a penalty from 64 on); a noise run logging B_simple = 80 rollouts
  as G x 15 prompts + 20 (means over its rows, the EMA's first null) predicts the penalty
  (1 + B/80) / (1 + 16/80) and its 1.1x start at 0.1 x 80 + 1.1 x 16 = 25.6; the measured one starts at 64."""
  for batch, s in ((16, 500), (32, 500), (64, 600), (128, 1000)):
    write_run(tmp_path, "sqrt", batch, reaching(s, end=2048), budget=2048)
  noise_run = tmp_path.parent / "noise_run"
  noise_run.mkdir()
  (noise_run / "config.json").write_text(json.dumps(dict(config=dict(batch_size=16, num_prompts=4, group_size=0))))
  rows = [dict(step=1, samples=16, reward_mean=0.5, noise_scale=None, noise_inter=None, noise_intra=None)]
  rows += [dict(step=s, samples=16 * s, reward_mean=0.5, noise_scale=80.0 + d, noise_inter=15.0 + d / 4,
                noise_intra=20.0) for s, d in ((2, -4.0), (3, 4.0))]
  (noise_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  noise = analyze(str(tmp_path), 0.6, noise_run=str(noise_run))["noise"]
  assert (noise["noise_scale"], noise["noise_inter"], noise["noise_intra"]) == (80.0, 15.0, 20.0)
  assert noise["group_size"] == 4 and noise["rows"] == 3 and noise["predicted_start"] == pytest.approx(25.6)
  sqrt = noise["rules"]["sqrt"]
  assert [b["measured_penalty"] for b in sqrt["batches"]] == pytest.approx([1.0, 1.0, 1.2, 2.0])
  assert [b["predicted_penalty"] for b in sqrt["batches"]] == pytest.approx(
      [(1 + b / 80) / 1.2 for b in (16, 32, 64, 128)])
  assert sqrt["measured_start"] == 64 and sqrt["fit"]["b_noise"] > 0
  report = (tmp_path / "report.md").read_text()
  assert "## Gradient noise scale" in report and "B_simple = 80 rollouts = G x 15 prompts" in report
  (noise_run / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
  with pytest.raises(ValueError, match="logged no noise_scale"):
    analyze(str(tmp_path), 0.6, noise_run=str(noise_run))
