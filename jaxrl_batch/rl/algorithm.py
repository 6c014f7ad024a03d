"""The algorithm's settings (`config.rl`, `config.critic`) as one frozen value, checked for bad combinations.

`AlgoConfig` is hashable: it is a static argument of the jitted update. The KL coefficient is not part of it (it
moves under the adaptive controller); `use_kl` says whether the reference model is needed at all.
"""
import dataclasses

import ml_collections

from jaxrl_batch.rl.advantages import ESTIMATORS, GROUP_ESTIMATORS
from jaxrl_batch.rl.losses import AGGREGATIONS, KL_ESTIMATORS, TIS_MODES

ALGOS = ("grpo", "ppo")


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """See the commented `rl` and `critic` groups of configs/grpo_arith.py and configs/ppo_arith.py."""

  algo: str = "grpo"
  estimator: str = "grpo"
  gamma: float = 1.0
  lam: float = 1.0
  whiten_advantages: bool = False
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float = 0.0
  ratio_level: str = "token"
  loss_agg: str = "token_mean"
  loss_agg_constant: float = 0.0
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_in: str = "loss"
  kl_target: float = 0.0
  kl_horizon: int = 10_000
  epochs: int = 1
  mini_batches: int = 1
  old_logp: str = "sampler"
  tis_cap: float = 0.0
  tis_mode: str = "truncate"
  max_staleness: int = 0
  dynamic_sampling: bool = False
  max_sampling_rounds: int = 3
  overlong: str = "none"
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0
  entropy_coef: float = 0.0
  router_aux_loss_coef: float = 0.0
  noise_split: bool = False
  temperature: float = 1.0
  critic: bool = False
  share_backbone: bool = False
  critic_layers: int = 0
  vf_clip: float = 0.2
  vf_coef: float = 1.0
  critic_warmup_steps: int = 0

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
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(rl.keys()) - fields)
    if unknown:
      raise ValueError(f"Unknown config.rl keys {unknown}; valid keys are {sorted(fields - {'algo', 'critic'})}.")
    out = cls(algo=config.algo, temperature=config.sampling.temperature or 1.0, critic=config.algo == "ppo",
              share_backbone=critic.share_backbone, critic_layers=critic.num_layers, vf_clip=critic.vf_clip,
              vf_coef=critic.vf_coef, critic_warmup_steps=critic.warmup_steps, **dict(rl))
    out.check(config.group_size if group_size is None else group_size)
    return out

  def check(self, group_size: int) -> None:
    """Raises ValueError naming the field and the fix for every combination that cannot be trained."""
    def need(ok: bool, message: str):
      if not ok:
        raise ValueError(message)

    need(self.algo in ALGOS, f"algo={self.algo!r}: use one of {ALGOS}.")
    need(self.estimator in ESTIMATORS, f"rl.estimator={self.estimator!r}: use one of {ESTIMATORS}.")
    need(self.estimator != "gae" or self.critic,
         "rl.estimator='gae' needs a critic, which only algo='ppo' trains; use configs/ppo_arith.py or a "
         "critic-free estimator (grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline).")
    need(not self.critic or self.estimator == "gae",
         f"algo='ppo' trains a critic, but rl.estimator={self.estimator!r} would not use it; set rl.estimator='gae'"
         " or algo='grpo'.")
    need(self.estimator not in GROUP_ESTIMATORS or group_size >= 2,
         f"rl.estimator={self.estimator!r} compares the samples of a prompt, so it needs group_size >= 2 (got "
         f"{group_size}); raise group_size or use reinforce_pp / gae.")
    need(not self.dynamic_sampling or group_size >= 2,
         "rl.dynamic_sampling drops groups whose rewards are all equal; it needs group_size >= 2.")
    need(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, f"rl.gamma={self.gamma}, rl.lam={self.lam}: both in [0, 1].")
    need(0 <= self.clip_low < 1 and self.clip_high >= 0,
         f"rl.clip_low={self.clip_low} must be in [0, 1) and rl.clip_high={self.clip_high} >= 0.")
    need(self.dual_clip == 0 or self.dual_clip > 1,
         f"rl.dual_clip={self.dual_clip}: the dual-clip constant must be > 1 (3 is usual), or 0 to disable.")
    need(self.ratio_level in ("token", "sequence"), f"rl.ratio_level={self.ratio_level!r}: token | sequence.")
    need(self.loss_agg in AGGREGATIONS, f"rl.loss_agg={self.loss_agg!r}: use one of {AGGREGATIONS}.")
    need(self.loss_agg_constant >= 0, "rl.loss_agg_constant must be >= 0 (0 = the response budget in tokens).")
    need(self.kl_coef >= 0, f"rl.kl_coef={self.kl_coef} must be >= 0.")
    need(self.kl_estimator in KL_ESTIMATORS, f"rl.kl_estimator={self.kl_estimator!r}: use one of {KL_ESTIMATORS}.")
    need(self.kl_in in ("loss", "reward"), f"rl.kl_in={self.kl_in!r}: loss | reward.")
    need(self.kl_in == "loss" or self.kl_estimator == "k1",
         f"rl.kl_in='reward' subtracts the per-token k1 = log(pi/pi_ref) from the reward; set rl.kl_estimator='k1'"
         f" (got {self.kl_estimator!r}), or put the KL in the loss.")
    need(self.kl_target >= 0 and (self.kl_target == 0 or self.kl_coef > 0),
         f"rl.kl_target={self.kl_target}: the adaptive KL controller starts from rl.kl_coef, which must be > 0.")
    need(self.kl_horizon > 0, "rl.kl_horizon must be > 0 (samples).")
    need(self.epochs >= 1 and self.mini_batches >= 1,
         f"rl.epochs={self.epochs} and rl.mini_batches={self.mini_batches} must both be >= 1.")
    need(self.old_logp in ("sampler", "trainer"), f"rl.old_logp={self.old_logp!r}: sampler | trainer.")
    need(self.tis_cap == 0 or (self.tis_cap >= 1 and self.old_logp == "trainer"),
         f"rl.tis_cap={self.tis_cap}: truncated importance sampling reweights by pi_trainer / pi_sampler, so it "
         "needs rl.old_logp='trainer' and a cap >= 1 (2 is usual), or 0 to disable.")
    need(self.tis_mode in TIS_MODES, f"rl.tis_mode={self.tis_mode!r}: truncate (truncated IS) | mask (the decoupled "
         "PPO objective's weight: tokens past rl.tis_cap leave the loss).")
    need(isinstance(self.max_staleness, int) and self.max_staleness >= 0,
         f"rl.max_staleness={self.max_staleness}: steps generation may run ahead of the learner, an integer >= 0 "
         "(0 = synchronous).")
    need(self.max_sampling_rounds >= 1, "rl.max_sampling_rounds must be >= 1.")
    need(self.overlong in ("none", "mask", "penalty"), f"rl.overlong={self.overlong!r}: none | mask | penalty.")
    need(self.overlong_buffer >= 0 and self.overlong_penalty >= 0,
         "rl.overlong_buffer and rl.overlong_penalty must be >= 0.")
    need(self.entropy_coef >= 0, f"rl.entropy_coef={self.entropy_coef} must be >= 0 (a bonus; 0 = off).")
    need(self.router_aux_loss_coef >= 0, f"rl.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (the "
         "MoE load-balancing loss weight; 0 = off).")
    need(not self.noise_split or group_size >= 2,
         "rl.noise_split separates the noise between prompts from the noise between samples of one prompt, so it "
         f"needs group_size >= 2 (got {group_size}); set rl.noise_split=False.")
    need(not (self.share_backbone and self.critic_layers),
         "critic.share_backbone puts the value head on the policy itself; critic.num_layers (a separate, "
         "smaller critic) must then be 0.")
    need(self.critic_layers >= 0 and self.vf_clip >= 0 and self.vf_coef > 0 and self.critic_warmup_steps >= 0,
         "critic.num_layers, critic.vf_clip and critic.warmup_steps must be >= 0 and critic.vf_coef > 0.")
