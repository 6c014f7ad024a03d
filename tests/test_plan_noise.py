"""plan_batch --noise_run: S(B) = S_min (1 + B / B_noise) from one hand-written run that logged noise_scale.

The run: batch b = 64, noise_scale null, 60, 100, 80 over its four training rows (mean B_simple = 80), and
evaluations at 0, 64, .., 256 samples of eval_accuracy 0.4, 0.5, .., 0.8 (target 0.65 crossed at S_run = 160) and
eval_pass1 0.4, 0.5, 0.7, 0.7, 0.8 (crossed at 112; smoothed over 3 points, 0.4, 1.6/3, 1.9/3, 2.2/3, 0.8, at
128 + 64 / 6). So S_min = S_run / (1 + 64 / 80) = S_run / 1.8.
"""
import json
import os
import subprocess
import sys

import pytest

from jaxrl_batch.analysis import noise, planner
from tests.helpers import ROOT

BATCH = 64
NOISE = (None, 60.0, 100.0, 80.0)
EVALS = ((0, 0.4, 0.4), (64, 0.5, 0.5), (128, 0.6, 0.7), (192, 0.7, 0.7), (256, 0.8, 0.8))  # samples, accuracy, pass1


def write_noise_run(run_dir, noise_scale=NOISE, evals=EVALS):
  """A run directory as launch.train writes it: config.json, and metrics.jsonl's training rows (phase seconds,
  reward_mean, noise_scale) and evaluation rows, in order of samples."""
  os.makedirs(run_dir)
  config = dict(batch_size=BATCH, num_prompts=BATCH // 4, group_size=4, seed=0, sample_budget=BATCH * len(noise_scale),
                optim=dict(lr_rule="sqrt"))
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(dict(config=config), f)
  rows = [dict(step=i, samples=i * BATCH, rollout_s=0.25, reward_s=0.125, update_s=0.125, reward_mean=0.5,
               noise_scale=n) for i, n in enumerate(noise_scale, 1)]
  rows += [dict(step=s // BATCH, samples=s, eval_accuracy=a, eval_pass1=p) for s, a, p in evals]
  rows.sort(key=lambda r: (r["samples"], "eval_accuracy" in r))
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(run_dir)


def test_the_noise_run_gives_b_noise_and_s_min(tmp_path):
  run = write_noise_run(tmp_path / "noise")
  model = noise.samples_model(run, 0.65)
  assert model["b_noise"] == pytest.approx(80.0) and model["samples_to_target"] == pytest.approx(160.0)
  assert model["s_min"] == pytest.approx(160.0 / 1.8)
  assert {k: model[k] for k in ("source", "run", "batch", "target", "metric", "smooth", "rows")} == dict(
      source="noise_run", run=run, batch=64, target=0.65, metric="eval_accuracy", smooth=1, rows=4)
  assert noise.samples_model(run, 0.65, metric="eval_pass1")["s_min"] == pytest.approx(112.0 / 1.8)
  smoothed = noise.samples_model(run, 0.65, metric="eval_pass1", smooth=3)
  assert smoothed["samples_to_target"] == pytest.approx(128 + 64 / 6)


def test_the_plan_predicts_t_from_the_noise_runs_s_b(tmp_path):
  model = noise.samples_model(write_noise_run(tmp_path / "noise"), 0.65)
  swept = {32: 50.0, 128: 150.0, 512: 300.0}
  result = planner.plan(swept, {}, samples_model=(model["s_min"], model["b_noise"]), predicted=True)
  s_min = 160 / 1.8
  t = {r["batch"]: r["predicted_time_to_target_s"] for r in result["rows"]}
  assert t == {b: pytest.approx(s_min * (1 + b / 80) / rate) for b, rate in swept.items()}
  assert all(r["predicted"] and not r["in_fit"] for r in result["rows"])
  # T = 88.9 x 1.4 / 50 = 2.49, x 2.6 / 150 = 1.54, x 7.4 / 300 = 2.19 s: 128 is best.
  assert result["recommended_batch"] == 128
  table = planner.render(dict(result, rule="sqrt", target=0.65, samples_model=model,
                              sweep=dict(steps=4, warmup=5, min_samples=1024)))
  assert "S(B) = 89 (1 + B / 80) samples to target, from the noise-scale run " in table
  assert "S_min = its 160 samples to eval_accuracy >= 0.65 at its batch 64 / (1 + 64 / B_noise)." in table


def test_noise_run_errors_name_the_fix(tmp_path):
  run = write_noise_run(tmp_path / "noise")
  with pytest.raises(ValueError, match=r"never reached eval_accuracy >= 0.9 \(its best: 0.800 after 256 samples\): "
                                       "give a --target it reached, or train it on more samples"):
    noise.samples_model(run, 0.9)
  silent = write_noise_run(tmp_path / "silent", noise_scale=(None, None))
  with pytest.raises(ValueError, match="logged no noise_scale: train it with micro-batches"):
    noise.samples_model(silent, 0.65)
  negative = write_noise_run(tmp_path / "negative", noise_scale=(None, 20.0, -30.0))
  with pytest.raises(ValueError, match=r"mean noise_scale of -5 <= 0 over 3 rows.*--samples_model=S_MIN:B_NOISE"):
    noise.samples_model(negative, 0.65)
  with pytest.raises(ValueError, match="missing holds no config.json: pass the directory of a launch.train run"):
    noise.samples_model(str(tmp_path / "missing"), 0.65)
  unevaluated = write_noise_run(tmp_path / "unevaluated", evals=())
  with pytest.raises(ValueError, match=r"has no curve to read its samples to target from \(no evaluation rows\)"):
    noise.samples_model(unevaluated, 0.65)


# In a child process (the launchers' flag names overlap, so none is imported here): plan_batch's flag checks, then its
# main with --noise_run and --topology, R(B) faked as B samples/s (step_time.sweep compiles; nothing here may).
_PROBE = r"""
import json, sys, types
from absl import flags
from jaxrl_batch.predict import program_time, step_time
from launch import plan_batch

run, workdir = sys.argv[1:]
FLAGS, errors = flags.FLAGS, []
base = ["plan_batch", "--config=configs/grpo_arith.py", f"--workdir={workdir}"]
for extra in (["--samples_model=100:50", f"--noise_run={run}", "--target=0.65"], [f"--noise_run={run}"],
              ["--target=0.65"]):
  try:
    FLAGS(base + extra)
    errors.append(None)
  except flags.IllegalFlagValueError as e:
    errors.append(str(e))
  FLAGS.unparse_flags()

class Step:
  programs = dict(decode=types.SimpleNamespace(rates=program_time.Rates("v5p", 459e12, 2765e9, 600e9, "published")))
  def __init__(self, batch):
    self.samples_per_s = float(batch)
  def to_json(self):
    return dict(seconds=1.0)

step_time.sweep = lambda member, batches, *args, **kwargs: {b: Step(b) for b in batches}
FLAGS(base + ["--topology=v5p:2x2x1", "--batches=32,128", f"--noise_run={run}", "--target=0.65"])
plan_batch.main([])
print(json.dumps(errors))
"""


def test_plan_batch_records_the_noise_run_and_refuses_mixed_sources(tmp_path):
  run = write_noise_run(tmp_path / "noise")
  workdir = tmp_path / "plan"  # not made: a plan of predicted figures makes its directory
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _PROBE, run, str(workdir)], cwd=ROOT, capture_output=True, text=True,
                        timeout=120, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  both, no_target, no_run = json.loads(proc.stdout.strip().splitlines()[-1])
  assert "--samples_model and --noise_run both give S(B): pass one of them" in both
  assert "--noise_run needs --target=X" in no_target and "--target is read only with --noise_run" in no_run
  plan = json.loads((workdir / "plan.json").read_text())
  assert plan["target"] == 0.65 and plan["s_min"] == pytest.approx(160 / 1.8) and plan["b_noise"] == 80.0
  model = plan["samples_model"]
  assert model == dict(source="noise_run", run=run, batch=64, samples_to_target=pytest.approx(160.0), target=0.65,
                       metric="eval_accuracy", smooth=1, rows=4, s_min=plan["s_min"], b_noise=80.0)
  rows = {r["batch"]: r for r in plan["rows"]}
  assert rows[128]["predicted_time_to_target_s"] == pytest.approx(160 / 1.8 * (1 + 128 / 80) / 128)
  assert rows[32]["predicted"] and rows[32]["step"] == dict(seconds=1.0)
  assert plan["sweep"]["rates"]["name"] == "v5p" and plan["sweep"]["min_samples"] == 1024
  assert "from the noise-scale run" in (workdir / "plan.md").read_text()
