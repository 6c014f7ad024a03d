"""The study runner: members from flags or sweep(), equal budgets, skip/resume, and a tiny study end to end."""
import json
import os

import jax
import pytest

from configs import grpo_arith
from jaxrl_batch import study
from jaxrl_batch.analysis import analyze
from jaxrl_batch.config_args import apply_overrides

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "grpo_arith.py")


def test_members_come_from_flags_or_the_sweep():
  module = study.load_config_module(CONFIG)
  swept = study.members(module, [], [], 2)
  assert {m.batch for m in swept} == {64, 128, 256, 512} and {m.rule for m in swept} == {"sqrt", "none"}
  assert len(swept) == 4 * 2 * 2
  explicit = study.members(module, [16, 32], ["sqrt"], 1)
  assert [m.name for m in explicit] == ["sqrt_b16_s0", "sqrt_b32_s0"]
  with pytest.raises(ValueError, match="at least one seed"):
    study.members(module, [16], ["sqrt"], 0)


def test_member_config_derives_from_the_family():
  module = study.load_config_module(CONFIG)
  c = study.member_config(module, "", study.Member("none", 256, 2), ["sample_budget=4096", "optim.b1=0.8"])
  assert (c.batch_size, c.optim.lr_rule, c.seed, c.sample_budget, c.optim.b1) == (256, "none", 2, 4096, 0.8)
  assert c.optim.base_batch == grpo_arith.BASE_BATCH


@pytest.mark.parametrize("override, message", [
    ("sample_budget", "must look like key=value"),
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("sample_budget=many", "expected int"),
    ("batch_size.x=1", "'batch_size' is not a config group"),
])
def test_bad_overrides_are_refused(override, message):
  with pytest.raises(ValueError, match=message):
    apply_overrides(grpo_arith.get_config("debug"), [override])


def test_tiny_study_runs_every_member_to_the_same_budget_and_skips_finished(tmp_path):
  workdir = str(tmp_path / "study")
  overrides = [f"sft.cache_dir={tmp_path / 'base'}", "sample_budget=64", "eval_every_samples=32"]
  args = (CONFIG + ":debug", workdir, [16, 32], ["sqrt", "none"], 1, overrides)
  study.run_study(*args, devices=jax.devices()[:1])
  names = sorted(os.listdir(workdir))
  assert names == ["none_b16_s0", "none_b32_s0", "sqrt_b16_s0", "sqrt_b32_s0"]
  for name in names:
    assert study.finished_samples(os.path.join(workdir, name)) == 64
    with open(os.path.join(workdir, name, "config.json")) as f:
      saved = json.load(f)["config"]
    assert saved["batch_size"] == int(name.split("_b")[1].split("_")[0])
  mtimes = {n: os.path.getmtime(os.path.join(workdir, n, "metrics.jsonl")) for n in names}
  study.run_study(*args, devices=jax.devices()[:1])
  assert mtimes == {n: os.path.getmtime(os.path.join(workdir, n, "metrics.jsonl")) for n in names}

  analysis = analyze(workdir, target=0.5)
  assert analysis["reference"] == "sqrt_b16"
  assert {m["member"] for m in analysis["members"]} == {"sqrt_b16", "sqrt_b32", "none_b16", "none_b32"}
  for m in analysis["members"]:
    assert m["throughput_samples_per_s"] > 0 and m["n_seeds"] == 1
    # The debug model is untrained: it never reaches 0.5, and says so instead of dropping the run.
    assert m["n_censored"] == 1 and m["samples_to_target"] is None and m["verdict"] in ("censored", "reference")
  for name in analysis["files"]:
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  assert "Censored" in open(os.path.join(workdir, "report.md")).read()


def test_throughput_sweep_measures_each_batch(tmp_path):
  rates = study.throughput_sweep(CONFIG + ":debug", str(tmp_path / "sweep"), [8, 16], "sqrt", 3,
                                 [f"sft.cache_dir={tmp_path / 'base'}"], devices=jax.devices()[:1])
  assert sorted(rates) == [8, 16] and all(r > 0 for r in rates.values())
  assert study.finished_samples(str(tmp_path / "sweep" / "b16")) == 48
  with pytest.raises(ValueError, match=">= 2 steps"):
    study.throughput_sweep(CONFIG + ":debug", str(tmp_path / "sweep"), [8], "sqrt", 1)


def test_plan_batch_cli_writes_the_plan(tmp_path):
  import subprocess
  import sys
  analysis = dict(target=0.9, members=[
      dict(rule="sqrt", batch=8, samples_to_target=1000.0, time_to_target_s=4.0),
      dict(rule="sqrt", batch=16, samples_to_target=1500.0, time_to_target_s=5.0),
      dict(rule="none", batch=16, samples_to_target=None, time_to_target_s=None)])
  with open(tmp_path / "analysis.json", "w") as f:
    json.dump(analysis, f)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, "-m", "launch.plan_batch", "--config=configs/grpo_arith.py:debug", f"--workdir={tmp_path}",
       "--batches=8,16", "--steps=2", f"--set=sft.cache_dir={tmp_path / 'base'}", "--set=mesh.data=1"],
      cwd=root, capture_output=True, text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""))
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "plan.json") as f:
    plan = json.load(f)
  # S(8) = 1000, S(16) = 1500: S_min = 500, B_noise = 8.
  assert plan["s_min"] == pytest.approx(500) and plan["b_noise"] == pytest.approx(8)
  assert [r["measured_time_to_target_s"] for r in plan["rows"]] == [4.0, 5.0]
  assert plan["recommended_batch"] in (8, 16) and "Recommended batch" in proc.stdout
  assert os.path.exists(tmp_path / "plan.md")
