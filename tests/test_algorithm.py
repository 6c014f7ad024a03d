"""Every documented algorithm combination builds a config; bad combinations are refused with the fix named."""
import itertools

import jax
import pytest

from configs import grpo_arith, ppo_arith
from jaxrl_batch.rl.advantages import ESTIMATORS
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.losses import AGGREGATIONS, KL_ESTIMATORS
from jaxrl_batch.train.setup import Experiment

KL_VARIANTS = [dict(kl_coef=0.0)] + [dict(kl_coef=0.1, kl_in="loss", kl_estimator=k) for k in KL_ESTIMATORS] + [
    dict(kl_coef=0.1, kl_in="reward", kl_estimator="k1"), dict(kl_coef=0.1, kl_target=0.05)]
POLICY_LOSSES = [dict(), dict(clip_high=0.28), dict(dual_clip=3.0), dict(ratio_level="sequence"),
                 dict(old_logp="trainer", tis_cap=2.0), dict(entropy_coef=0.01)]
SAMPLING = [dict(), dict(dynamic_sampling=True), dict(overlong="mask"), dict(overlong="penalty", overlong_buffer=2),
            dict(epochs=2, mini_batches=4)]


def build(estimator, rl):
  module = ppo_arith if estimator == "gae" else grpo_arith
  c = module.get_config("debug")
  c.mesh.data = 1
  c.rl.update(estimator=estimator, **rl)
  return c


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_documented_combination_builds(estimator):
  """Estimator x aggregation x KL variant x policy loss x sampling option: 720 configs per estimator run
  through the checks; one per estimator also builds its whole Experiment."""
  for agg, kl, loss, sampling in itertools.product(AGGREGATIONS, KL_VARIANTS, POLICY_LOSSES, SAMPLING):
    cfg = AlgoConfig.from_config(build(estimator, dict(loss_agg=agg, **kl, **loss, **sampling)))
    assert cfg.critic == (estimator == "gae")
  Experiment.create(build(estimator, dict(loss_agg="constant")), devices=jax.devices()[:1])


def test_shared_and_smaller_critics_build():
  for share, layers in ((True, 0), (False, 1)):
    c = build("gae", {})
    c.critic.update(share_backbone=share, num_layers=layers)
    assert AlgoConfig.from_config(c).critic_layers == layers


@pytest.mark.parametrize("estimator, rl, critic, group_size, message", [
    ("gae", {}, None, 8, None),
    ("grpo", {}, None, 1, "needs group_size >= 2"),
    ("rloo", {}, None, 1, "needs group_size >= 2"),
    ("reinforce_pp", {"dynamic_sampling": True}, None, 1, "dynamic_sampling drops groups"),
    ("grpo", {"dual_clip": 0.5}, None, 8, "must be > 1"),
    ("grpo", {"clip_low": 1.0}, None, 8, "clip_low=1.0"),
    ("grpo", {"kl_target": 0.1}, None, 8, "starts from rl.kl_coef"),
    ("grpo", {"kl_estimator": "k5", "kl_coef": 0.1}, None, 8, "k5"),
    ("grpo", {"ratio_level": "step"}, None, 8, "token | sequence"),
    ("grpo", {"overlong": "drop"}, None, 8, "none | mask | penalty"),
    ("grpo", {"epochs": 0}, None, 8, "rl.epochs=0"),
    ("grpo", {"entropy_coef": -0.1}, None, 8, "entropy_coef=-0.1"),
    ("gae", {}, {"share_backbone": True, "num_layers": 2}, 8, "num_layers .* must then be 0"),
], ids=lambda x: str(x)[:20])
def test_bad_combinations_are_refused(estimator, rl, critic, group_size, message):
  c = build(estimator, rl)
  c.group_size, c.batch_size = group_size, 32
  if critic:
    c.critic.update(critic)
  if message is None:  # PPO with GAE works with one sample per prompt.
    AlgoConfig.from_config(c)
    return
  with pytest.raises(ValueError, match=message):
    AlgoConfig.from_config(c)


def test_ppo_without_gae_is_refused():
  c = build("gae", {})
  c.rl.estimator = "grpo"
  with pytest.raises(ValueError, match="would not use it; set rl.estimator='gae'"):
    AlgoConfig.from_config(c)


def test_the_rl_group_must_hold_every_field():
  c = build("grpo", {})
  del c.rl["noise_split"]
  with pytest.raises(ValueError, match=r"config.rl lacks \['noise_split'\]"):
    AlgoConfig.from_config(c)
  c = build("grpo", dict(typo_knob=1))
  with pytest.raises(ValueError, match=r"Unknown config.rl keys \['typo_knob'\]"):
    AlgoConfig.from_config(c)
