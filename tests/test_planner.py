"""Planner: the S(B) fit recovers known parameters; T(B) = S(B) / R(B) picks the known best batch."""
import math

import pytest

from jaxrl_batch.analysis import planner


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
  table = planner.render(dict(result, rule="sqrt", target=0.9))
  assert "| 64 | 100.0 | 1250 | 12.50 | 13.00 |" in table and "Recommended batch: 256" in table


def test_throughput_interpolates_in_log_batch():
  assert planner.interpolate_throughput(128, {64: 100.0, 256: 300.0}) == pytest.approx(200.0)
  assert planner.interpolate_throughput(1024, {64: 100.0, 256: 300.0}) == 300.0
