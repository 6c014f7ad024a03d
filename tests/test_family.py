"""Tests for the batch-size family learning-rate rules."""
import math

import pytest

from jaxrl_batch.config import family


@pytest.mark.parametrize("rule, batch, expected", [
    ("none", 512, 2e-4),
    ("linear", 512, 8e-4),       # 2e-4 * 512/128
    ("linear", 64, 1e-4),        # 2e-4 * 64/128
    ("sqrt", 512, 4e-4),         # 2e-4 * sqrt(4)
    ("sqrt", 256, 2.8284271e-4),  # 2e-4 * 1.41421356
])
def test_scale_lr(rule, batch, expected):
  assert family.scale_lr(2e-4, 128, batch, rule) == pytest.approx(expected, rel=1e-7)


@pytest.mark.parametrize("args, match", [
    ((2e-4, 128, 256, "cubic"), r"Unknown lr rule 'cubic'; use one of \('none', 'linear', 'sqrt', 'adam_sde'\)"),
    ((0.0, 128, 256, "sqrt"), "base_lr must be > 0"),
    ((2e-4, 0, 256, "sqrt"), "base_batch=0"),
    ((2e-4, 128, -1, "none"), "batch=-1"),
])
def test_scale_lr_rejects_bad_arguments(args, match):
  with pytest.raises(ValueError, match=match):
    family.scale_lr(*args)


def test_derive_lr_from_rule():
  lr = family.derive_lr(2e-4, 128, 256, "sqrt", lr_override=None)
  assert lr.lr == pytest.approx(2e-4 * math.sqrt(2))
  assert not lr.overridden
  assert lr.describe() == "lr=2.83e-4 (sqrt rule: 2e-4 * sqrt(256/128))"


@pytest.mark.parametrize("override", [None, 0.0, -1.0])
def test_non_positive_override_derives(override):
  lr = family.derive_lr(2e-4, 128, 512, "linear", lr_override=override)
  assert (lr.lr, lr.overridden) == (pytest.approx(8e-4), False)
  assert lr.describe() == "lr=8e-4 (linear rule: 2e-4 * 512/128)"


def test_none_rule_describe():
  lr = family.derive_lr(2e-4, 128, 512, "none", lr_override=None)
  assert lr.describe() == "lr=2e-4 (none rule: 2e-4 at any batch)"


def test_override_wins_and_is_described():
  lr = family.derive_lr(2e-4, 128, 256, "sqrt", lr_override=1e-3)
  assert (lr.lr, lr.overridden) == (1e-3, True)
  assert lr.describe() == "lr=1e-3 (explicit override; the sqrt rule would give 2.83e-4)"


def test_override_still_validates_rule():
  with pytest.raises(ValueError, match="Unknown lr rule 'sqrtt'"):
    family.derive_lr(2e-4, 128, 256, "sqrtt", lr_override=1e-3)


def test_adam_sde_scales_lr_betas_and_eps():
  # kappa = 4: lr x 2, 1 - b1 = 0.1 -> 0.4, 1 - b2 = 0.001 -> 0.004, eps / 2.
  assert family.scale_lr(1e-4, 128, 512, "adam_sde") == pytest.approx(2e-4)
  b1, b2, eps = family.scale_adam(0.9, 0.999, 1e-8, 128, 512, "adam_sde")
  assert (b1, b2, eps) == (pytest.approx(0.6), pytest.approx(0.996), pytest.approx(5e-9))
  assert family.scale_adam(0.9, 0.999, 1e-8, 128, 512, "sqrt") == (0.9, 0.999, 1e-8)


def test_adam_sde_refuses_a_batch_that_breaks_beta1():
  with pytest.raises(ValueError, match="beta1, beta2 = -0.6, 0.984"):
    family.scale_adam(0.9, 0.999, 1e-8, 128, 16 * 128, "adam_sde")


def test_member_of_a_prompts_family_derives_prompts_from_the_batch():
  from configs import ppo_arith  # pylint: disable=import-outside-toplevel
  m = family.member(ppo_arith.get_config("batch=256"))
  assert (m.batch_size, m.num_prompts, m.group_size) == (256, 32, 8)
  assert (m.mini_batch_size, m.micro_batch_size, m.num_micro, m.updates_per_step) == (128, 64, 2, 4)
  assert m.total_steps == 192 and m.name == "sqrt_b256_s0" and m.score_num_micro == 1
  config = ppo_arith.get_config("batch=256")
  config.score_micro_batch_size = 64
  assert family.member(config).score_num_micro == 4 and family.member(config).to_json()["score_num_micro"] == 4
  assert m.actor_lr.lr == pytest.approx(5e-5 * math.sqrt(2)) and m.critic_lr.lr == pytest.approx(3e-4 * math.sqrt(2))
  assert m.to_json()["batch_derivation"] == "B=256 rollouts = 32 prompts x 8 samples (family_axis=prompts: P = B / G)"


def test_batch_override_on_a_group_size_family_changes_the_group_not_the_prompts():
  from configs import grpo_arith  # pylint: disable=import-outside-toplevel
  config = grpo_arith.get_config("family_axis=group_size")
  assert (family.member(config).num_prompts, family.member(config).group_size) == (16, 8)
  config.batch_size = 256  # --config.batch_size=256
  m = family.member(config)
  assert (m.num_prompts, m.group_size) == (16, 16)
  assert "16 prompts x 16 samples (family_axis=group_size: G = B / P)" in m.describe()
  assert m.actor_lr.describe() == "lr=7.07e-5 (sqrt rule: 5e-5 * sqrt(256/128))"


@pytest.mark.parametrize("arg, overrides, match", [
    ("", dict(batch_size=100), "batch_size=100 must be a positive multiple of group_size=8"),
    ("family_axis=group_size", dict(batch_size=100), "multiple of num_prompts=16 .*family_axis=group_size"),
    ("family_axis=group_size", dict(group_size=4), "group_size=4 contradicts batch_size=128 / num_prompts=16"),
    ("", dict(num_prompts=3), "num_prompts=3 contradicts batch_size=128 / group_size=8"),
    ("", dict(micro_batch_size=48), "micro_batch_size=48 must divide the mini-batch"),
    ("", dict(sample_budget=64), "sample_budget=64 is smaller than one batch"),
    ("", dict(score_micro_batch_size=48), "score_micro_batch_size=48 must divide batch_size=128"),
])
def test_member_refuses_batch_settings_that_cannot_run(arg, overrides, match):
  from configs import grpo_arith  # pylint: disable=import-outside-toplevel
  config = grpo_arith.get_config(arg)
  config.update(overrides)
  with pytest.raises(ValueError, match=match):
    family.member(config)
