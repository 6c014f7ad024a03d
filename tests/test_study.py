"""The study runner: members from flags or sweep(), every member validated first, equal budgets, skip/resume, and
tiny studies end to end (the arithmetic debug family, and the GSM8K tiny_random family at two batch sizes).

Trained runs are shared: one SFT cache per module, and each study or sweep is trained once by a module fixture.
"""
import json
import os
import subprocess
import sys

import jax
import pytest

from configs import grpo_arith
from jaxrl_batch.analysis import analyze
from jaxrl_batch.config.args import apply_overrides
from jaxrl_batch.study import runner as study
from jaxrl_batch.train import rundir
from tests.helpers import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "grpo_arith.py")
GSM8K = os.path.join(ROOT, "configs", "grpo_gsm8k_qwen.py")
ONE = jax.devices()[:1]


# Under `-n 2` the tests of one trained study or sweep run in one worker, which trains it once (`--dist=loadgroup`);
# the GSM8K study's members are the sweep's batches, so its test runs there too, on the programs compiled for them.
ON_ARITH_STUDYS_WORKER = pytest.mark.xdist_group("arith_study")
ON_SWEEPS_WORKER = pytest.mark.xdist_group("throughput_sweep")


@pytest.fixture(scope="module")
def cache(base_cache):
  """`--set` of the suite's SFT cache (one warm start per model)."""
  return f"sft.cache_dir={base_cache}"


@pytest.fixture(scope="module")
def arith_study(tmp_path_factory, cache):
  """(run_study args, workdir) of the demo's reduced study: 2 rules x 2 batches of the debug family, trained."""
  workdir = str(tmp_path_factory.mktemp("arith") / "study")
  overrides = [cache, "sample_budget=64", "eval_every_samples=32"]
  args = (CONFIG + ":debug", workdir, [16, 32], ["sqrt", "none"], 1, overrides)
  study.run_study(*args, devices=ONE)
  return args, workdir


@pytest.fixture(scope="module")
def gsm8k_study(tmp_path_factory, cache):
  """The members of `launch.study --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --batches=16,32
  --rules=sqrt --seeds=1`, trained, and their workdir."""
  workdir = str(tmp_path_factory.mktemp("gsm8k") / "study")
  members = study.run_study(GSM8K + ":model=tiny_random", workdir, [16, 32], ["sqrt"], 1, [cache], devices=ONE)
  return members, workdir


@pytest.fixture(scope="module")
def swept(tmp_path_factory, cache):
  """(plan directory, rates) of a 2-step throughput sweep of the GSM8K tiny family in <plan dir>/throughput/."""
  plan_dir = tmp_path_factory.mktemp("plan")
  rates = study.throughput_sweep(GSM8K + ":model=tiny_random", str(plan_dir / "throughput"), [16, 32], "sqrt", 2,
                                 [cache], devices=ONE)
  return plan_dir, rates


def test_members_come_from_flags_or_the_sweep():
  module = study.load_config_module(CONFIG)
  swept_members = study.member_fields(module, [], [], 2)
  assert {m["batch"] for m in swept_members} == {64, 128, 256, 512}
  assert {m["lr_rule"] for m in swept_members} == {"sqrt", "none"} and len(swept_members) == 4 * 2 * 2
  assert study.member_fields(module, [16, 32], ["sqrt"], 1) == [dict(batch=16, lr_rule="sqrt", seed=0),
                                                                  dict(batch=32, lr_rule="sqrt", seed=0)]
  gsm8k = study.member_fields(study.load_config_module(GSM8K), [], [], 1)
  assert [m["batch"] for m in gsm8k] == [512, 1024, 2048, 4096, 8192, 16384, 32768]
  with pytest.raises(ValueError, match="at least one seed"):
    study.member_fields(module, [16], ["sqrt"], 0)


def test_member_config_derives_from_the_family():
  module = study.load_config_module(CONFIG)
  fields = dict(batch=256, lr_rule="none", seed=2)
  c = study.member_config(module, "", fields, ["sample_budget=4096", "optim.b1=0.8"])
  assert (c.batch_size, c.optim.lr_rule, c.seed, c.sample_budget, c.optim.b1) == (256, "none", 2, 4096, 0.8)
  assert c.optim.base_batch == grpo_arith.BASE_BATCH
  member = study.derive(c, fields, ONE)
  assert (member.name, member.num_prompts, member.actor_lr.lr) == ("none_b256_s2", 32, grpo_arith.BASE_LR)
  # The member's fields come after the base argument and win.
  assert study.config_arg("debug,batch=8", fields) == "debug,batch=8,batch=256,lr_rule=none,seed=2"


def test_staleness_is_an_axis_of_members():
  module = study.load_config_module(CONFIG)
  fields = study.member_fields(module, [32], ["sqrt"], 1, staleness=[0, 2])
  assert fields == [dict(batch=32, lr_rule="sqrt", seed=0), dict(batch=32, lr_rule="sqrt", seed=0, staleness=2)]
  members = [study.derive(study.member_config(module, "debug", f), f, ONE) for f in fields]
  assert [(m.name, m.algo.max_staleness) for m in members] == [("sqrt_b32_s0", 0), ("sqrt_b32_k2_s0", 2)]
  with pytest.raises(ValueError, match="staleness >= 0"):
    study.member_fields(module, [32], ["sqrt"], 1, staleness=[-1])


@pytest.mark.parametrize("body, batches, message", [
    ("c = grpo_gsm8k_qwen.get_config(arg)", [16, 18], "batch_size=18 must be a positive multiple of group_size=4"),
    ("c = grpo_arith.get_config(arg); c.sample_budget = 4 * c.batch_size", [16, 32],
     r"different sample budgets \[64, 128\]"),
    ("c = grpo_arith.get_config(arg); c.batch_size = 16", [16, 32],
     "Member .*'batch': 32.* built a config with batch=16: the config's get_config must honour batch="),
])
def test_every_member_validates_before_any_trains(tmp_path, body, batches, message):
  path = tmp_path / "family.py"
  path.write_text(f"from configs import grpo_arith, grpo_gsm8k_qwen\n\ndef get_config(arg):\n  {body}\n  return c\n")
  with pytest.raises(ValueError, match=message):
    study.run_study(f"{path}:debug", str(tmp_path / "study"), batches, ["sqrt"], 1, devices=ONE)
  assert not (tmp_path / "study").exists()


@pytest.mark.parametrize("override, message", [
    ("sample_budget", "must look like key=value"),
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("sample_budget=many", "expected int"),
    ("batch_size.x=1", "'batch_size' is not a config group"),
])
def test_bad_overrides_are_refused(override, message):
  with pytest.raises(ValueError, match=message):
    apply_overrides(grpo_arith.get_config("debug"), [override])


@ON_ARITH_STUDYS_WORKER
def test_tiny_study_runs_every_member_to_the_same_budget(arith_study):
  _, workdir = arith_study
  names = sorted(os.listdir(workdir))
  assert names == ["none_b16_s0", "none_b32_s0", "sqrt_b16_s0", "sqrt_b32_s0"]
  for name in names:
    assert rundir.finished_samples(os.path.join(workdir, name)) == 64
    saved = rundir.read_config(os.path.join(workdir, name))
    assert saved["config"]["batch_size"] == saved["derived"]["batch_size"] == int(name.split("_b")[1].split("_")[0])


@ON_ARITH_STUDYS_WORKER
def test_rerunning_a_study_skips_finished_members(arith_study):
  args, workdir = arith_study
  paths = [rundir.metrics_path(os.path.join(workdir, n)) for n in sorted(os.listdir(workdir))]
  mtimes = [os.path.getmtime(p) for p in paths]
  assert [m.name for m in study.run_study(*args, devices=ONE)] == [
      "sqrt_b16_s0", "sqrt_b32_s0", "none_b16_s0", "none_b32_s0"]
  assert mtimes == [os.path.getmtime(p) for p in paths]


@ON_ARITH_STUDYS_WORKER
def test_tiny_study_is_analysed_with_censored_members(arith_study):
  _, workdir = arith_study
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


@ON_SWEEPS_WORKER
def test_gsm8k_tiny_study_runs_two_batches_to_the_same_budget_and_is_analysed(gsm8k_study):
  members, workdir = gsm8k_study
  assert [(m.name, m.num_prompts, m.group_size) for m in members] == [("sqrt_b16_s0", 4, 4), ("sqrt_b32_s0", 8, 4)]
  for m in members:
    assert rundir.finished_samples(os.path.join(workdir, m.name)) == m.sample_budget == 64
    assert rundir.read_config(os.path.join(workdir, m.name))["derived"]["num_prompts"] == m.num_prompts
  assert members[1].actor_lr.describe() == "lr=1.41e-4 (sqrt rule: 1e-4 * sqrt(32/16))"
  analysis = analyze(workdir, target=0.5)
  assert analysis["skipped"] == []
  assert [(m["member"], m["n_seeds"]) for m in analysis["members"]] == [("sqrt_b16", 1), ("sqrt_b32", 1)]
  assert all(m["throughput_samples_per_s"] > 0 for m in analysis["members"])


@ON_SWEEPS_WORKER
def test_throughput_sweep_measures_each_batch(swept):
  plan_dir, rates = swept
  assert sorted(rates) == [16, 32] and all(r > 0 for r in rates.values())
  assert [rundir.finished_samples(str(plan_dir / "throughput" / b)) for b in ("b16", "b32")] == [32, 64]
  with pytest.raises(ValueError, match=">= 2 steps"):
    study.throughput_sweep(GSM8K, str(plan_dir / "other"), [16], "sqrt", 1)


@pytest.mark.slow
@ON_SWEEPS_WORKER
def test_plan_batch_cli_writes_the_plan_and_reuses_finished_sweep_runs(swept, cache):
  plan_dir, _ = swept
  analysis = dict(target=0.9, members=[
      dict(rule="sqrt", batch=16, samples_to_target=1000.0, time_to_target_s=4.0),
      dict(rule="sqrt", batch=32, samples_to_target=1500.0, time_to_target_s=5.0),
      dict(rule="none", batch=32, samples_to_target=None, time_to_target_s=None)])
  (plan_dir / "analysis.json").write_text(json.dumps(analysis))
  logs = [plan_dir / "throughput" / b / rundir.METRICS for b in ("b16", "b32")]
  mtimes = [os.path.getmtime(p) for p in logs]
  proc = subprocess.run(
      [sys.executable, "-m", "launch.plan_batch", "--config=configs/grpo_gsm8k_qwen.py:model=tiny_random",
       f"--workdir={plan_dir}", "--batches=16,32", "--steps=2", "--warmup=0", "--min_samples=0", f"--set={cache}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=xla_flags(1)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert mtimes == [os.path.getmtime(p) for p in logs]  # The sweep's runs were finished: nothing retrained.
  plan = json.loads((plan_dir / "plan.json").read_text())
  # S(16) = 1000, S(32) = 1500: S_min = 500, B_noise = 16.
  assert plan["s_min"] == pytest.approx(500) and plan["b_noise"] == pytest.approx(16)
  assert [r["measured_time_to_target_s"] for r in plan["rows"]] == [4.0, 5.0]
  assert plan["recommended_batch"] in (16, 32) and "Recommended batch" in proc.stdout
  assert (plan_dir / "plan.md").exists()
