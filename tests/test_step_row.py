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
COUNTERS = step_row.Progress(step=3, samples=384, samples_generated=400, wall_s=12.5, cold=False)
TIMING = step_row.Timing(update_s=2.0, lr=1e-3, kl_coef=0.0, compile_s=0.0)
NOISE = step_row.Noise.of(dict(noise_scale=1.5))

# Each group's names as docs/run_directory.md documents them, in the row's order, with every optional field present:
# users' scripts read these, so a record that renames, drops or reorders one fails here.
PROGRESS_KEYS = ("step", "samples", "samples_generated", "wall_s", "cold")
ROLLOUT_KEYS = ("rollout_s", "reward_s", "sampling_rounds", "reward_mean", "reward_std", "response_len_mean",
                "truncated_frac", "zero_std_group_frac", "reward_errors", "reward_timeouts", "useful_token_frac",
                "rollout_chunks", "preempted", "response_len_max", "response_lens", "reprefill_s", "policy_lag_mean",
                "policy_lag_max", "partial_frac", "carried_over", "update_wait_s", "rollout_wait_s", "policy_version",
                "policy_lag_samples_mean", "reshard_s")
TIMING_KEYS = ("update_s", "lr", "kl_coef", "compile_s", "overlap_frac")
NOISE_KEYS = ("noise_scale", "noise_inter", "noise_intra")
UPDATE_KEYS = ("returns_mean", "vf_explained_var", "loss", "policy_loss", "entropy", "clip_frac", "clip_frac_low",
               "clip_frac_high", "ratio_mean", "tis_capped_frac", "grad_norm", "value_loss", "critic_grad_norm",
               "updates", "router_mismatch_frac", "expert_load_cv", "router_aux_loss", "kl", "logp_gap_mean")
HELD_OUT_KEYS = ("eval_accuracy", "eval_reward_errors", "eval_pass1", "eval_pass_at_k", "eval_maj_at_k")


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
  out = dict(loss=0.5, policy_loss=0.4, clip_frac_low=0.125, clip_frac_high=0.25, logp_gap_mean=0.01,
             noise_signal_sq=2.0, noise_trace=3.0)
  row = step_row.training_row(COUNTERS, _stats(), TIMING, NOISE, step_row.UpdateMetrics.from_fetched(out, 4))
  assert row["samples_generated"] == 400  # the run's count, not the step's
  assert "trained_samples" not in row and "examples" not in row
  assert "carried_over" not in row and "policy_version" not in row  # optional fields of other modes
  assert "overlap_frac" not in row  # generation ahead of the learner only
  assert row["clip_frac"] == 0.375 and row["updates"] == 4 and row["noise_scale"] == 1.5
  assert row["kl"] == 0.0  # no KL term
  assert row["logp_gap_mean"] == 0.01  # the step's (Trainer puts prepare's recomputed one over the first update's)
  assert "noise_signal_sq" not in row and "noise_trace" not in row  # raw estimates feed the EMA, not the row
  assert "grad_norm" not in row and "value_loss" not in row  # not computed by this update
  recomputed = step_row.training_row(COUNTERS, _stats(carried_over=2), TIMING, NOISE,
                                     step_row.UpdateMetrics.from_fetched(dict(out, logp_gap_mean=0.02, kl=0.3), 1))
  assert (recomputed["logp_gap_mean"], recomputed["kl"], recomputed["carried_over"]) == (0.02, 0.3, 2)
  assert json.loads(json.dumps(row)) == row
  unmeasured = step_row.UpdateMetrics.from_fetched(dict(loss=0.5), 1)
  row = step_row.training_row(COUNTERS, _stats(), TIMING, NOISE, unmeasured)
  assert list(row)[-2:] == ["kl", "logp_gap_mean"] and row["logp_gap_mean"] is None  # null, not absent


# Each record with every optional field set.
FULL = dict(Progress=COUNTERS,
            RolloutStats=_stats(**{f.name: 1 for f in dataclasses.fields(RolloutStats) if f.default is None}),
            Timing=dataclasses.replace(TIMING, overlap_frac=0.5),
            Noise=step_row.Noise.of(dict(noise_scale=1.0, noise_inter=0.5, noise_intra=2.0)),
            UpdateMetrics=step_row.UpdateMetrics.from_fetched({k: 0.5 for k in UPDATE_KEYS}, updates_per_step=1),
            HeldOut=step_row.HeldOut(eval_accuracy=0.5, eval_reward_errors=0,
                                     **sampled_metrics(np.ones((2, 3)), [["1"] * 3] * 2)))


def _full_training_row() -> dict:
  return step_row.training_row(FULL["Progress"], FULL["RolloutStats"], FULL["Timing"], FULL["Noise"],
                               FULL["UpdateMetrics"])


@pytest.mark.parametrize("name, keys", [
    ("Progress", PROGRESS_KEYS), ("RolloutStats", ROLLOUT_KEYS), ("Timing", TIMING_KEYS), ("Noise", NOISE_KEYS),
    ("UpdateMetrics", UPDATE_KEYS), ("HeldOut", HELD_OUT_KEYS)])
def test_each_record_holds_its_documented_names(name, keys):
  assert tuple(FULL[name].to_row()) == keys
  assert set(keys) <= _documented_fields()


def test_a_training_row_holds_each_group_in_turn():
  assert list(_full_training_row()) == [*PROGRESS_KEYS, *ROLLOUT_KEYS, *TIMING_KEYS, *NOISE_KEYS, *UPDATE_KEYS]


def test_optional_fields_are_absent_or_null_as_documented():
  assert "overlap_frac" not in TIMING.to_row()
  assert step_row.Noise.of(dict(noise_scale=None)).to_row() == dict(noise_scale=None)  # null without an estimate
  assert step_row.Noise.of(dict.fromkeys(NOISE_KEYS)).to_row() == dict.fromkeys(NOISE_KEYS)  # the split: all three
  with pytest.raises(TypeError):
    step_row.Noise.of(dict(noise_scale=1.0, noise_ratio=2.0))
  warmup = step_row.UpdateMetrics.from_fetched(dict(loss=0.5, value_loss=0.2, critic_grad_norm=1.0), 2).to_row()
  assert warmup == dict(loss=0.5, value_loss=0.2, critic_grad_norm=1.0, updates=2, kl=0.0, logp_gap_mean=None)
  greedy = step_row.HeldOut(eval_accuracy=0.25, eval_reward_errors=1)
  assert step_row.eval_row(2, 64, 3.0, greedy) == dict(step=2, samples=64, wall_s=3.0, eval_accuracy=0.25,
                                                       eval_reward_errors=1)


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
  """The fields of the metrics.jsonl table (its section: other tables name files and config.json's keys)."""
  section = open(DOCS).read().split("\n## metrics.jsonl\n")[1].split("\n## ")[0]
  return set(re.findall(r"^\| `([a-z_0-9]+)` \|", section, flags=re.M))


def test_every_documented_field_is_a_rows_and_every_field_a_row_can_hold_is_documented():
  eval_row = step_row.eval_row(1, 128, 2.0, FULL["HeldOut"])
  assert set(_full_training_row()) | set(eval_row) == _documented_fields()
