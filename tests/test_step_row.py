"""The metrics row's one owner (`train.step_row`): what a row holds, checked against hand-written expectations, and
every key it can hold documented in docs/run_directory.md."""
import dataclasses
import json
import os
import re

import numpy as np
import pytest

from jaxrl_batch.sampling import EngineStats
from jaxrl_batch.train import step_row
from jaxrl_batch.train.evaluation import sampled_metrics
from jaxrl_batch.train.step_row import RolloutStats
from tests.close import assert_close

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "run_directory.md")
COUNTERS = dict(step=3, samples=384, samples_generated=400, wall_s=12.5, cold=False)


def _stats(**optional) -> RolloutStats:
  engine = [EngineStats(chunks=2, slot_steps=40, decoded=30, preempted=1), EngineStats(chunks=1, slot_steps=10,
                                                                                       decoded=5)]
  return RolloutStats.of(rewards_E=np.array([1.0, 0.0, 1.0, 1.0]), lengths_E=np.array([3, 5, 4, 8]),
                         truncated_E=np.array([False, False, False, True]), engine=engine, zero_std_frac=0.5,
                         rollout_s=1.5, reward_s=0.25, samples_generated=4, sampling_rounds=2, reward_errors=1,
                         reward_timeouts=0, trained_samples=3, examples=[dict(completion="7")],
                         response_lens=[3, 5, 4, 8], **optional)


def test_rollout_statistics_match_a_hand_computation():
  s = _stats()
  assert (s.reward_mean, s.reward_std, s.response_len_mean, s.truncated_frac) == (0.75, pytest.approx(0.4330127),
                                                                                 5.0, 0.25)
  assert (s.useful_token_frac, s.rollout_chunks, s.preempted, s.response_len_max) == (35 / 50, 3, 1, 8)
  empty = RolloutStats.of(rewards_E=[], lengths_E=[], truncated_E=[], engine=[], zero_std_frac=0.0, rollout_s=0.0,
                          reward_s=0.0, samples_generated=0, sampling_rounds=1, reward_errors=0, reward_timeouts=0,
                          trained_samples=0, examples=[], response_lens=[])
  assert (empty.reward_mean, empty.reward_std, empty.truncated_frac, empty.useful_token_frac,
          empty.response_len_max) == (0, 0, 0, 0, 0)


def test_a_training_row_joins_counters_rollouts_timing_update_and_noise():
  update = dict(loss=0.5, policy_loss=0.4, clip_frac_low=0.125, clip_frac_high=0.25, logp_gap_mean=0.01,
                noise_signal_sq=2.0, noise_trace=3.0)
  row = step_row.training_row(COUNTERS, _stats(), dict(update_s=2.0, lr=1e-3, kl_coef=0.0), update,
                              dict(noise_scale=1.5), updates_per_step=4)
  assert row["samples_generated"] == 400  # the run's count, not the step's
  assert "trained_samples" not in row and "examples" not in row
  assert "carried_over" not in row and "policy_version" not in row  # optional fields of other modes
  assert row["clip_frac"] == 0.375 and row["updates"] == 4 and row["noise_scale"] == 1.5
  assert row["kl"] == 0.0  # no KL term
  assert row["logp_gap_mean"] == 0.01  # the step's (Trainer puts prepare's recomputed one over the first update's)
  assert "noise_signal_sq" not in row and "noise_trace" not in row  # raw estimates feed the EMA, not the row
  recomputed = step_row.training_row(COUNTERS, _stats(carried_over=2), {}, dict(update, logp_gap_mean=0.02, kl=0.3),
                                     {}, updates_per_step=1)
  assert (recomputed["logp_gap_mean"], recomputed["kl"], recomputed["carried_over"]) == (0.02, 0.3, 2)
  assert json.loads(json.dumps(row)) == row


def test_rollout_stats_survive_a_checkpoint_as_json():
  stats = _stats(update_wait_s=np.float64(0.5), policy_version=2)
  assert RolloutStats(**json.loads(json.dumps(stats.to_json()))) == stats


@pytest.mark.parametrize("overlong, rewards, trained", [
    ("none", [1.0, 0.5, 1.0], [True, True, True]),
    ("mask", [1.0, 0.5, 1.0], [True, True, False]),
    ("penalty", [1.0, 0.5 - 0.25, 0.0], [True, True, True]),  # the last 4 of 10 tokens ramp down: 7 is 1/4 way
])
def test_overlong_handling(overlong, rewards, trained):
  algo = dataclasses.make_dataclass("Algo", ["overlong", "overlong_buffer", "overlong_penalty"])(overlong, 4, 1.0)
  rewards_B, trained_B = step_row.trained_rewards(algo, np.array([1.0, 0.5, 1.0], np.float32), np.array([5, 7, 10]),
                                                  np.array([False, False, True]), response_len=10)
  assert_close(rewards_B, rewards, 1e-7)
  assert trained_B.tolist() == trained


def _documented_fields() -> set[str]:
  return set(re.findall(r"^\| `([a-z_0-9]+)` \|", open(DOCS).read(), flags=re.M))


def test_every_field_a_row_can_hold_is_documented():
  every_optional = {f.name: 1 for f in dataclasses.fields(RolloutStats) if f.default is None}
  update = {k: 0.5 for k in step_row.UPDATE_KEYS + ("clip_frac_low", "clip_frac_high", "kl", "logp_gap_mean")}
  row = step_row.training_row(COUNTERS, _stats(**every_optional),
                              dict(update_s=1.0, lr=1e-3, kl_coef=0.1, overlap_frac=0.5), update,
                              dict(noise_scale=1.0, noise_inter=0.5, noise_intra=2.0), updates_per_step=1)
  held_out = dict(eval_accuracy=0.5, eval_reward_errors=0, **sampled_metrics(np.ones((2, 3)), [["1"] * 3] * 2))
  keys = set(row) | set(step_row.eval_row(1, 128, 2.0, held_out))
  assert keys - _documented_fields() == set()
