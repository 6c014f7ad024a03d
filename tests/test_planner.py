"""Planner: the S(B) fit recovers known parameters (also from chosen learn batches); T(B) = S(B) / R(B) picks the
known best batch and reports its error against measured T; the throughput sweep's step arithmetic, warm-up and
reuse of finished runs."""
import json
import math
import os

import jax
import numpy as np
import pytest

from jaxrl_batch.analysis import planner
from jaxrl_batch.study import runner
from jaxrl_batch.train import rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP = dict(steps=4, warmup=5, min_samples=1024)


def test_fit_recovers_s_min_and_b_noise():
  # S_min = 1000, B_noise = 200: S(100) = 1500, S(200) = 2000, S(400) = 3000.
  assert planner.fit_samples_model([100, 200, 400], [1500, 2000, 3000]) == (pytest.approx(1000), pytest.approx(200))
  assert planner.fit_samples_model([100, 200], [1500, 1400])[1] == math.inf
  with pytest.raises(ValueError, match=">= 2 batch sizes"):
    planner.fit_samples_model([100, 100], [1500, 1500])


def test_plan_predicts_time_and_recommends_the_minimum():
  swept = {64: 100.0, 128: 180.0, 256: 300.0, 512: 400.0, 1024: 440.0}
  measured = {64: (1000 * (1 + 64 / 256), 13.0), 128: (1000 * (1 + 128 / 256), None)}
  result = planner.plan(swept, measured)
  assert result["s_min"] == pytest.approx(1000) and result["b_noise"] == pytest.approx(256)
  t = {r["batch"]: r["predicted_time_to_target_s"] for r in result["rows"]}
  # T = 1000 (1 + B/256) / R: 12.5, 8.33, 6.67, 7.5, 11.36 -> 256 is best.
  assert t[64] == pytest.approx(12.5) and t[256] == pytest.approx(2000 / 300)
  assert result["recommended_batch"] == 256
  assert {r["batch"]: r["measured_time_to_target_s"] for r in result["rows"]}[64] == 13.0
  # The decision rule's factors against B0 = 64: R 300 / 100, S 2000 / 1250; 256 wins as 3.0 > 1.6.
  row = {r["batch"]: r for r in result["rows"]}[256]
  assert row["throughput_gain"] == pytest.approx(3.0) and row["samples_penalty"] == pytest.approx(1.6)
  assert not any(r["predicted"] for r in result["rows"])
  assert all(r["predicted"] == r["swept"] for r in planner.plan(swept, measured, predicted=True)["rows"])
  table = planner.render(dict(result, rule="sqrt", target=0.9, sweep=SWEEP))
  assert "| 64 | 100.0 | 1250 | 12.50 | 13.00 | -3.8% | yes | 1.00x | 1.00x |" in table
  assert "| 256 | 300.0 | 2000 | 6.67 | - | - | no | 3.00x | 1.60x |" in table and "Recommended batch: 256" in table
  assert ">= 3 timed steps and >= 1024 samples per batch, after the compiling step and 5 warm-up steps." in table
  assert "5 warm-up steps; 2 rounds pooled." in planner.render(dict(result, rule="sqrt", target=0.9,
                                                                   sweep=dict(SWEEP, repeats=2)))


def test_plan_fits_only_the_learn_batches_and_reports_the_error():
  # Members at 64 and 256 lie on S = 1000 (1 + B / 256); those at 128 and 512 do not, so they move a fit to all four.
  swept = {64: 100.0, 128: 180.0, 256: 300.0, 512: 400.0}
  measured = {64: (1250.0, 10.0), 128: (2000.0, 12.5), 256: (2000.0, 8.0), 512: (3500.0, None), 1024: (None, None)}
  result = planner.plan(swept, measured, learn_batches=[256, 64])
  assert result["s_min"] == pytest.approx(1000) and result["b_noise"] == pytest.approx(256)
  assert result["learn_batches"] == [64, 256]
  rows = {r["batch"]: r for r in result["rows"]}
  assert [rows[b]["in_fit"] for b in (64, 128, 256, 512, 1024)] == [True, False, True, False, False]
  # Predicted T = 12.5, 8.33, 6.67 s at 64, 128, 256 against 10, 12.5, 8 s measured.
  assert rows[64]["error"] == pytest.approx(0.25) and rows[128]["error"] == pytest.approx(1500 / 180 / 12.5 - 1)
  assert rows[256]["error"] == pytest.approx(-1 / 6) and rows[512]["error"] is None and rows[1024]["error"] is None
  assert result["recommended_batch"] == 256 and result["measured_best_batch"] == 256
  table = planner.render(dict(result, rule="sqrt", target=0.9, sweep=SWEEP))
  assert "| 64 | 100.0 | 1250 | 12.50 | 10.00 | +25.0% | yes |" in table
  assert "| 128 | 180.0 | 1500 | 8.33 | 12.50 | -33.3% | no |" in table and "at B = 64, 256." in table
  assert planner.plan(swept, measured)["s_min"] != pytest.approx(1000)  # All members: a different fit.
  with pytest.raises(ValueError, match=r"Learn batches \[1024\] have no member that reached the target"):
    planner.plan(swept, measured, learn_batches=[64, 1024])


def test_throughput_interpolates_in_log_batch():
  assert planner.interpolate_throughput(128, {64: 100.0, 256: 300.0}) == pytest.approx(200.0)
  assert planner.interpolate_throughput(1024, {64: 100.0, 256: 300.0}) == 300.0


def test_sweep_steps_time_enough_steps_and_samples_after_the_warmup():
  # Compiling step + 5 warm-up + max(3, ceil(1024 / B)) timed steps.
  assert [runner.sweep_steps(b, **SWEEP) for b in (16, 100, 512, 1024)] == [70, 17, 9, 9]
  assert runner.sweep_steps(32, steps=2, warmup=0, min_samples=0) == 2  # The old sweep: `steps` steps.
  for bad in (dict(steps=1), dict(warmup=-1), dict(min_samples=-1)):
    with pytest.raises(ValueError, match=">= 2 steps"):
      runner.sweep_steps(16, **dict(SWEEP, **bad))


def test_untimed_rows_are_each_cold_row_and_its_warmup():
  cold = np.array([1, 0, 0, 0, 0, 1, 0, 0, 0], bool)  # A run resumed at its sixth row.
  assert runner.untimed_rows(cold, 2).tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 0]
  assert runner.untimed_rows(cold, 0).tolist() == cold.tolist()


class _FakeTrainer:
  """Writes the config.json and metrics.jsonl of a sweep run: 10 s compiling, 2 s per warm-up step, then 1 s (3 s in
  a second round's run, `b<B>.r1`)."""
  runs = []

  def __init__(self, config, run_dir, devices=None):
    self.config, self.run_dir = config, run_dir

  def run(self):
    c, run_dir = self.config, self.run_dir
    os.makedirs(run_dir)
    _FakeTrainer.runs.append((os.path.basename(run_dir), c.sample_budget))
    with open(rundir.config_path(run_dir), "w") as f:
      json.dump(dict(config=dict(batch_size=c.batch_size, seed=c.seed, sample_budget=c.sample_budget,
                                 optim=dict(lr_rule=c.optim.lr_rule))), f)
    steps = c.sample_budget // c.batch_size
    rows = [dict(step=0, samples=0, eval_accuracy=0.0)]
    steady = 3.0 if run_dir.endswith(".r1") else 1.0  # A second round on a slower machine.
    rows += [dict(step=i, samples=i * c.batch_size, reward_mean=0.0, rollout_s=10.0 if i == 1 else 2.0 if i <= 6
                  else steady, reward_s=0.0, update_s=0.0, cold=i == 1) for i in range(1, steps + 1)]
    rows.append(dict(step=steps, samples=steps * c.batch_size, eval_accuracy=0.0))
    with open(rundir.metrics_path(run_dir), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)


def test_throughput_sweep_times_after_the_warmup_and_reruns_shorter_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(runner, "Trainer", _FakeTrainer)
  _FakeTrainer.runs = []
  sweep = lambda **kw: runner.throughput_sweep(os.path.join(ROOT, "configs", "grpo_arith.py") + ":debug",
                                               str(tmp_path), [16, 128], "sqrt", devices=jax.devices()[:1], **kw)
  old = sweep(steps=4)  # An older, shorter sweep: 4 steps, R over the last 3 (2 s warm-up steps).
  assert _FakeTrainer.runs == [("b16", 64), ("b128", 512)] and old == {16: 8.0, 128: 64.0}
  assert sweep(**SWEEP) == {16: pytest.approx(16.0), 128: pytest.approx(128.0)}  # The 1 s steps only.
  assert _FakeTrainer.runs[2:] == [("b16", 70 * 16), ("b128", 14 * 128)]  # Both rerun, as the flags ask.
  assert sorted(os.listdir(tmp_path)) == ["b128", "b128.budget512", "b16", "b16.budget64"]  # The old ones kept.
  assert sweep(**dict(SWEEP, min_samples=512)) == {16: pytest.approx(16.0), 128: pytest.approx(128.0)}
  assert len(_FakeTrainer.runs) == 4  # Finished runs at least that long are reused.
  # Two rounds: the first round's runs are reused, the second's (3 s steps) run after them; each batch pools both,
  # total samples over total seconds: 2 steps' samples in 1 + 3 s.
  assert sweep(**SWEEP, repeats=2) == {16: pytest.approx(8.0), 128: pytest.approx(64.0)}
  assert _FakeTrainer.runs[4:] == [("b16.r1", 70 * 16), ("b128.r1", 14 * 128)]


def test_a_given_samples_model_plans_without_a_study():
  """S(B) given as (S_min, B_noise), e.g. for hardware and batches no study ran: nothing is fitted."""
  swept = {64: 100.0, 256: 300.0, 1024: 440.0}
  result = planner.plan(swept, {}, samples_model=(1000.0, 256.0))
  assert (result["s_min"], result["b_noise"], result["learn_batches"]) == (1000.0, 256.0, [])
  t = {r["batch"]: r["predicted_time_to_target_s"] for r in result["rows"]}
  assert t == {64: pytest.approx(12.5), 256: pytest.approx(2000 / 300), 1024: pytest.approx(5000 / 440)}
  assert result["recommended_batch"] == 256 and not any(r["in_fit"] for r in result["rows"])
  sweep = dict(topology="v5p:4x4x2", num_slices=1, lengths="fixed:100", prompt_tokens=8, response_tokens=128)
  table = planner.render(dict(result, rule="sqrt", target=None, sweep=sweep))
  assert "samples to target, given." in table and "R(B) predicted for v5p:4x4x2 (1 slice(s))" in table
