"""The algorithm's settings (`config.rl`, `config.critic`) as one frozen value, checked for bad combinations.

`AlgoConfig` is hashable: it is a static argument of the jitted update. The KL coefficient is not part of it (it
moves under the adaptive controller); `use_kl` says whether the reference model is needed at all.
"""
import dataclasses

import ml_collections

from jaxrl_batch.rl.advantages import ESTIMATORS, GROUP_ESTIMATORS
from jaxrl_batch.rl.losses import AGGREGATIONS, KL_ESTIMATORS, TIS_MODES

ALGOS = ("grpo", "ppo")
# Fields read from outside the `rl` group: config.algo, config.sampling.temperature and the critic group.
NOT_RL = ("algo", "temperature", "critic", "share_backbone", "critic_layers", "vf_clip", "vf_coef",
          "critic_warmup_steps")


def _need(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """The run's `algo`, its `rl` group, the critic's fields of `critic` (named critic_* here) and the sampling
  temperature. Built by `from_config`; every field comes from the config, where configs/base.py sets and comments
  its default (no defaults here, so there is one place for each)."""

  algo: str
  estimator: str
  gamma: float
  lam: float
  whiten_advantages: bool
  clip_low: float
  clip_high: float
  dual_clip: float
  ratio_level: str
  loss_agg: str
  loss_agg_constant: float
  kl_coef: float
  kl_estimator: str
  kl_in: str
  kl_target: float
  kl_horizon: int
  epochs: int
  mini_batches: int
  old_logp: str
  tis_cap: float
  tis_mode: str
  max_staleness: int
  dynamic_sampling: bool
  max_sampling_rounds: int
  overlong: str
  overlong_buffer: int
  overlong_penalty: float
  entropy_coef: float
  router_aux_loss_coef: float
  noise_split: bool
  temperature: float
  critic: bool
  share_backbone: bool
  critic_layers: int
  vf_clip: float
  vf_coef: float
  critic_warmup_steps: int

  @property
  def use_kl(self) -> bool:
    """Whether a KL term exists (and the reference model must be held)."""
    return self.kl_coef > 0

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per rollout batch."""
    return self.epochs * self.mini_batches

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, group_size: int | None = None) -> "AlgoConfig":
    """Reads config.algo, config.rl, config.critic and the sampling temperature; refuses bad combinations.
    `group_size`: samples per prompt of the member (`family.Member.group_size`; default `config.group_size`)."""
    rl, critic = config.rl, config.critic
    rl_fields = {f.name for f in dataclasses.fields(cls)} - set(NOT_RL)
    unknown, missing = sorted(set(rl.keys()) - rl_fields), sorted(rl_fields - set(rl.keys()))
    if unknown:
      raise ValueError(f"Unknown config.rl keys {unknown}; valid keys are {sorted(rl_fields)}.")
    if missing:
      raise ValueError(f"config.rl lacks {missing}: the group holds every field of configs/base.py's rl_config.")
    out = cls(algo=config.algo, temperature=config.sampling.temperature or 1.0, critic=config.algo == "ppo",
              share_backbone=critic.share_backbone, critic_layers=critic.num_layers, vf_clip=critic.vf_clip,
              vf_coef=critic.vf_coef, critic_warmup_steps=critic.warmup_steps, **dict(rl))
    out.check(config.group_size if group_size is None else group_size)
    return out

  def check(self, group_size: int) -> None:
    """Raises ValueError naming the field and the fix for every combination that cannot be trained."""
    self._check_estimator(group_size)
    self._check_policy_loss(group_size)
    self._check_kl()
    self._check_schedule()
    self._check_critic()

  def _check_estimator(self, group_size: int) -> None:
    _need(self.algo in ALGOS, f"algo={self.algo!r}: use one of {ALGOS}.")
    _need(self.estimator in ESTIMATORS, f"rl.estimator={self.estimator!r}: use one of {ESTIMATORS}.")
    _need(self.estimator != "gae" or self.critic,
          "rl.estimator='gae' needs a critic, which only algo='ppo' trains; use configs/ppo_arith.py or a "
          "critic-free estimator (grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline).")
    _need(not self.critic or self.estimator == "gae",
          f"algo='ppo' trains a critic, but rl.estimator={self.estimator!r} would not use it; set rl.estimator='gae'"
          " or algo='grpo'.")
    _need(self.estimator not in GROUP_ESTIMATORS or group_size >= 2,
          f"rl.estimator={self.estimator!r} compares the samples of a prompt, so it needs group_size >= 2 (got "
          f"{group_size}); raise group_size or use reinforce_pp / gae.")
    _need(not self.dynamic_sampling or group_size >= 2,
          "rl.dynamic_sampling drops groups whose rewards are all equal; it needs group_size >= 2.")

  def _check_policy_loss(self, group_size: int) -> None:
    _need(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, f"rl.gamma={self.gamma}, rl.lam={self.lam}: both in [0, 1].")
    _need(0 <= self.clip_low < 1 and self.clip_high >= 0,
          f"rl.clip_low={self.clip_low} must be in [0, 1) and rl.clip_high={self.clip_high} >= 0.")
    _need(self.dual_clip == 0 or self.dual_clip > 1,
          f"rl.dual_clip={self.dual_clip}: the dual-clip constant must be > 1 (3 is usual), or 0 to disable.")
    _need(self.ratio_level in ("token", "sequence"), f"rl.ratio_level={self.ratio_level!r}: token | sequence.")
    _need(self.loss_agg in AGGREGATIONS, f"rl.loss_agg={self.loss_agg!r}: use one of {AGGREGATIONS}.")
    _need(self.loss_agg_constant >= 0, "rl.loss_agg_constant must be >= 0 (0 = the response budget in tokens).")
    _need(self.entropy_coef >= 0, f"rl.entropy_coef={self.entropy_coef} must be >= 0 (a bonus; 0 = off).")
    _need(self.router_aux_loss_coef >= 0, f"rl.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (the "
          "MoE load-balancing loss weight; 0 = off).")
    _need(not self.noise_split or group_size >= 2,
          "rl.noise_split separates the noise between prompts from the noise between samples of one prompt, so it "
          f"needs group_size >= 2 (got {group_size}); set rl.noise_split=False.")

  def _check_kl(self) -> None:
    _need(self.kl_coef >= 0, f"rl.kl_coef={self.kl_coef} must be >= 0.")
    _need(self.kl_estimator in KL_ESTIMATORS, f"rl.kl_estimator={self.kl_estimator!r}: use one of {KL_ESTIMATORS}.")
    _need(self.kl_in in ("loss", "reward"), f"rl.kl_in={self.kl_in!r}: loss | reward.")
    _need(self.kl_in == "loss" or self.kl_estimator == "k1",
          f"rl.kl_in='reward' subtracts the per-token k1 = log(pi/pi_ref) from the reward; set rl.kl_estimator='k1'"
          f" (got {self.kl_estimator!r}), or put the KL in the loss.")
    _need(self.kl_target >= 0 and (self.kl_target == 0 or self.kl_coef > 0),
          f"rl.kl_target={self.kl_target}: the adaptive KL controller starts from rl.kl_coef, which must be > 0.")
    _need(self.kl_horizon > 0, "rl.kl_horizon must be > 0 (samples).")

  def _check_schedule(self) -> None:
    _need(self.epochs >= 1 and self.mini_batches >= 1,
          f"rl.epochs={self.epochs} and rl.mini_batches={self.mini_batches} must both be >= 1.")
    _need(self.old_logp in ("sampler", "trainer"), f"rl.old_logp={self.old_logp!r}: sampler | trainer.")
    _need(self.tis_cap == 0 or (self.tis_cap >= 1 and self.old_logp == "trainer"),
          f"rl.tis_cap={self.tis_cap}: truncated importance sampling reweights by pi_trainer / pi_sampler, so it "
          "needs rl.old_logp='trainer' and a cap >= 1 (2 is usual), or 0 to disable.")
    _need(self.tis_mode in TIS_MODES, f"rl.tis_mode={self.tis_mode!r}: truncate (truncated IS) | mask (the decoupled "
          "PPO objective's weight: tokens past rl.tis_cap leave the loss).")
    _need(isinstance(self.max_staleness, int) and self.max_staleness >= 0,
          f"rl.max_staleness={self.max_staleness}: steps generation may run ahead of the learner, an integer >= 0 "
          "(0 = synchronous).")
    _need(self.max_sampling_rounds >= 1, "rl.max_sampling_rounds must be >= 1.")
    _need(self.overlong in ("none", "mask", "penalty"), f"rl.overlong={self.overlong!r}: none | mask | penalty.")
    _need(self.overlong_buffer >= 0 and self.overlong_penalty >= 0,
          "rl.overlong_buffer and rl.overlong_penalty must be >= 0.")

  def _check_critic(self) -> None:
    _need(not (self.share_backbone and self.critic_layers),
          "critic.share_backbone puts the value head on the policy itself; critic.num_layers (a separate, "
          "smaller critic) must then be 0.")
    _need(self.critic_layers >= 0 and self.vf_clip >= 0 and self.vf_coef > 0 and self.critic_warmup_steps >= 0,
          "critic.num_layers, critic.vf_clip and critic.warmup_steps must be >= 0 and critic.vf_coef > 0.")
