"""Batch-size families: how the learning rate scales when the batch grows, and the `Member` derived from a config.

A family is a base member (batch B0, learning rate lr0) plus a rule; the member at batch B gets
  none:   lr0
  linear: lr0 * B / B0
  sqrt:   lr0 * sqrt(B / B0)
  adam_sde: lr0 * sqrt(B / B0), and Adam's 1 - beta1 and 1 - beta2 multiplied by kappa = B / B0, epsilon divided
            by sqrt(kappa) (the square-root scaling rule of Adam's SDE approximation, Malladi et al. 2022)
Batch sizes count rollouts per optimizer update. An explicit learning rate overrides the rule, and the
derivation records both so logs show what the rule would have given.
"""
import dataclasses
import math

from jaxrl_batch.rl.algorithm import AlgoConfig

RULES = ("none", "linear", "sqrt", "adam_sde")


def _check_rule(rule: str) -> None:
  if rule not in RULES:
    raise ValueError(f"Unknown lr rule {rule!r}; use one of {RULES}.")


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
  """Learning rate for `batch` rollouts/update, scaled from (`base_lr`, `base_batch`) by `rule`."""
  _check_rule(rule)
  if base_lr <= 0:
    raise ValueError(f"base_lr must be > 0, got {base_lr}; set the base member's learning rate.")
  if base_batch <= 0 or batch <= 0:
    raise ValueError(
        f"Batch sizes must be > 0, got base_batch={base_batch}, batch={batch} (rollouts per update).")
  if rule == "none":
    return base_lr
  if rule == "linear":
    return base_lr * batch / base_batch
  return base_lr * math.sqrt(batch / base_batch)


def scale_adam(b1: float, b2: float, eps: float, base_batch: int, batch: int, rule: str) -> tuple[float, float, float]:
  """Adam's (beta1, beta2, epsilon) for `batch`: changed only by the adam_sde rule."""
  _check_rule(rule)
  if rule != "adam_sde":
    return b1, b2, eps
  kappa = batch / base_batch
  scaled = (1.0 - kappa * (1.0 - b1), 1.0 - kappa * (1.0 - b2))
  if min(scaled) <= 0.0:
    raise ValueError(f"adam_sde at batch {batch} (kappa = {kappa:g} x base_batch {base_batch}) makes "
                     f"beta1, beta2 = {scaled[0]:g}, {scaled[1]:g}, which must stay in (0, 1); raise "
                     "optim.b1/b2 or shrink the batch range.")
  return scaled[0], scaled[1], eps / math.sqrt(kappa)


def _fmt(x: float) -> str:
  """Short scientific notation: 2.8284e-4 -> '2.83e-4', 2e-4 -> '2e-4'."""
  mantissa, exponent = f"{x:.2e}".split("e")
  return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


@dataclasses.dataclass(frozen=True)
class LearningRate:
  """The learning rate of one family member and how it was obtained.

  Attributes:
    lr: the peak learning rate actually used.
    rule: the family's scaling rule (one of RULES).
    base_lr: learning rate of the base member.
    base_batch: rollouts per update of the base member.
    batch: rollouts per update of this member.
    overridden: True when `lr` was given explicitly instead of derived by the rule.
  """
  lr: float
  rule: str
  base_lr: float
  base_batch: int
  batch: int
  overridden: bool

  def rule_lr(self) -> float:
    """The learning rate the rule gives for this member (equal to `lr` unless overridden)."""
    return scale_lr(self.base_lr, self.base_batch, self.batch, self.rule)

  def derivation(self) -> str:
    """The rule's formula with this member's numbers, e.g. '2e-4 * sqrt(256/128)'."""
    base = _fmt(self.base_lr)
    if self.rule == "linear":
      return f"{base} * {self.batch}/{self.base_batch}"
    if self.rule == "sqrt":
      return f"{base} * sqrt({self.batch}/{self.base_batch})"
    if self.rule == "adam_sde":
      return f"{base} * sqrt({self.batch}/{self.base_batch}), Adam betas and eps rescaled"
    return f"{base} at any batch"

  def describe(self) -> str:
    """One line for logs, e.g. 'lr=2.83e-4 (sqrt rule: 2e-4 * sqrt(256/128))'."""
    if self.overridden:
      return (f"lr={_fmt(self.lr)} (explicit override; the {self.rule} rule would give "
              f"{_fmt(self.rule_lr())})")
    return f"lr={_fmt(self.lr)} ({self.rule} rule: {self.derivation()})"


def derive_lr(base_lr: float, base_batch: int, batch: int, rule: str,
              lr_override: float | None) -> LearningRate:
  """The member's learning rate: `lr_override` if it is not None and > 0, else the rule's value.

  The rule and the base values are validated even when overridden, so a typo never hides.
  """
  rule_lr = scale_lr(base_lr, base_batch, batch, rule)
  overridden = lr_override is not None and lr_override > 0
  return LearningRate(
      lr=float(lr_override) if overridden else rule_lr,
      rule=rule, base_lr=base_lr, base_batch=base_batch, batch=batch, overridden=overridden)


FAMILY_AXES = ("prompts", "group_size")


def optimizer_settings(optim_cfg, batch: int) -> tuple[LearningRate, tuple[float, float, float]]:
  """(peak lr with its derivation, Adam's (beta1, beta2, eps)) of an optimizer group (`optim` or `critic.optim`) at
  `batch` rollouts per step."""
  lr = derive_lr(optim_cfg.base_lr, optim_cfg.base_batch, batch, optim_cfg.lr_rule, optim_cfg.lr)
  return lr, scale_adam(optim_cfg.b1, optim_cfg.b2, optim_cfg.eps, optim_cfg.base_batch, batch, optim_cfg.lr_rule)


@dataclasses.dataclass(frozen=True)
class Member:
  """One member of a batch family, derived and validated once from a config (`member(config)`).

  Everything batch-dependent is read from here; nothing else divides B by G or counts micro-batches.

  Attributes:
    algo: the algorithm's settings (`rl.algorithm.AlgoConfig`).
    family_axis: the batch axis the family scales: "prompts" (G fixed, P = B / G) or "group_size" (P fixed,
      G = B / P).
    seed: the run's seed.
    batch_size: B, rollouts per step (= num_prompts x group_size).
    num_prompts: P, prompts per step.
    group_size: G, samples per prompt.
    mini_batch_size: rollouts per optimizer update (B / rl.mini_batches).
    micro_batch_size: rollouts per forward/backward (divides mini_batch_size).
    num_micro: micro-batches per update (gradient accumulation steps).
    score_num_micro: forwards that score a step's batch (old and reference log-probs, old values): batch_size /
      config.score_micro_batch_size (1 for 0).
    sample_budget: samples the run trains on.
    total_steps: rollout steps to reach the budget (exact unless rows are dropped from the loss).
    actor_lr, actor_adam: the actor's peak lr (with its derivation) and Adam's (beta1, beta2, eps).
    critic_lr, critic_adam: the same for the critic (PPO), else None.
    batch_derivation: how B, P and G follow from the config, for logs.
  """
  algo: AlgoConfig
  family_axis: str
  seed: int
  batch_size: int
  num_prompts: int
  group_size: int
  mini_batch_size: int
  micro_batch_size: int
  num_micro: int
  sample_budget: int
  total_steps: int
  actor_lr: LearningRate
  actor_adam: tuple[float, float, float]
  critic_lr: LearningRate | None
  critic_adam: tuple[float, float, float] | None
  batch_derivation: str
  score_num_micro: int = 1

  @property
  def rule(self) -> str:
    return self.actor_lr.rule

  @property
  def name(self) -> str:
    """The member's directory name in a study: '<rule>_b<batch>_s<seed>', '<rule>_b<batch>_k<k>_s<seed>' when
    generation runs k = rl.max_staleness steps ahead."""
    stale = f"_k{self.algo.max_staleness}" if self.algo.max_staleness else ""
    return f"{self.rule}_b{self.batch_size}{stale}_s{self.seed}"

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per rollout step (rl.epochs x rl.mini_batches)."""
    return self.algo.updates_per_step

  def describe(self) -> str:
    """One line for logs."""
    a = self.algo
    return (f"{a.algo.upper()}: {self.batch_derivation}; {a.epochs} epoch(s) x {a.mini_batches} mini-batch(es) of "
            f"{self.mini_batch_size} in {self.num_micro} micro-batch(es); about {self.total_steps} steps for "
            f"{self.sample_budget} samples. {self.actor_lr.describe()}")

  def to_json(self) -> dict:
    """The member's fields of config.json["derived"]."""
    out = dict(family_axis=self.family_axis, batch_size=self.batch_size, num_prompts=self.num_prompts,
               group_size=self.group_size, mini_batch_size=self.mini_batch_size,
               micro_batch_size=self.micro_batch_size, num_micro=self.num_micro,
               score_num_micro=self.score_num_micro, total_steps=self.total_steps,
               batch_derivation=self.batch_derivation, lr=self.actor_lr.lr, lr_derivation=self.actor_lr.describe(),
               lr_overridden=self.actor_lr.overridden, adam_b1_b2_eps=self.actor_adam)
    if self.critic_lr is not None:
      out.update(critic_lr=self.critic_lr.lr, critic_lr_derivation=self.critic_lr.describe(),
                 critic_adam_b1_b2_eps=self.critic_adam)
    return out


def _prompts_and_group(config) -> tuple[int, int, str]:
  """(P, G, derivation) from batch_size and the family axis: the config fixes the axis's other factor, and the
  scaled one is B / that factor."""
  b, axis = config.batch_size, config.family_axis
  if axis not in FAMILY_AXES:
    raise ValueError(f"family_axis={axis!r}: use one of {FAMILY_AXES}.")
  if b <= 0:
    raise ValueError(f"batch_size={b} must be > 0 (rollouts per step).")
  fixed_name, derived_name = ("group_size", "num_prompts") if axis == "prompts" else ("num_prompts", "group_size")
  fixed, given = config[fixed_name], config[derived_name]
  if fixed < 1:
    raise ValueError(f"{fixed_name}={fixed}: a family_axis={axis} member fixes {fixed_name}; set it >= 1.")
  if b % fixed:
    raise ValueError(f"batch_size={b} must be a positive multiple of {fixed_name}={fixed} (batch = prompts x group "
                     f"size, family_axis={axis}); e.g. batch_size={max(fixed, b - b % fixed)}.")
  derived = b // fixed
  if given and given != derived:
    raise ValueError(f"{derived_name}={given} contradicts batch_size={b} / {fixed_name}={fixed} = {derived} on a "
                     f"family_axis={axis} member; set {derived_name}=0 (derived) or change batch_size.")
  p, g = (derived, fixed) if axis == "prompts" else (fixed, derived)
  formula = "P = B / G" if axis == "prompts" else "G = B / P"
  return p, g, f"B={b} rollouts = {p} prompts x {g} samples (family_axis={axis}: {formula})"


def member(config, data_parallel: int = 1) -> Member:
  """The member `config` describes, validated for a mesh that splits the batch `data_parallel` ways.

  Raises ValueError naming the field and the fix for batch settings that cannot run.
  """
  p, g, derivation = _prompts_and_group(config)
  b = config.batch_size
  algo = AlgoConfig.from_config(config, group_size=g)
  if b % algo.mini_batches:
    raise ValueError(f"batch_size={b} must be divisible by rl.mini_batches={algo.mini_batches}.")
  mini = b // algo.mini_batches
  if mini % data_parallel:
    raise ValueError(f"The mini-batch (batch_size / rl.mini_batches = {mini}) must be divisible by the "
                     f"data-parallel device count {data_parallel} (mesh.data x mesh.fsdp); change batch_size, "
                     "rl.mini_batches or config.mesh.")
  micro = config.micro_batch_size or mini
  if micro < 0 or mini % micro or micro % data_parallel:
    raise ValueError(f"micro_batch_size={config.micro_batch_size} must divide the mini-batch (batch_size / "
                     f"rl.mini_batches = {mini}) and be divisible by the data-parallel device count {data_parallel};"
                     " 0 uses the whole mini-batch.")
  score_micro = config.score_micro_batch_size or b
  if score_micro < 0 or b % score_micro or score_micro % data_parallel:
    raise ValueError(f"score_micro_batch_size={config.score_micro_batch_size} must divide batch_size={b} and "
                     f"be divisible by the data-parallel device count {data_parallel}; 0 scores the whole batch in "
                     "one forward.")
  for name in ("eval_every_samples", "checkpoint_every_samples"):
    if config[name] < 0:
      raise ValueError(f"{name}={config[name]} must be >= 0 (samples between two; 0 = only at the end).")
  if config.log_every_steps < 1:
    raise ValueError(f"log_every_steps={config.log_every_steps} must be >= 1 (steps between progress lines).")
  if config.sample_budget < b:
    raise ValueError(f"sample_budget={config.sample_budget} is smaller than one batch ({b} rollouts).")
  stop_at = config.stop_at_accuracy
  if not 0 <= stop_at <= 1 or (stop_at and not config.eval_every_samples):
    raise ValueError(f"stop_at_accuracy={stop_at}: the held-out accuracy (0..1] that ends the run early, checked at "
                     "each evaluation (so eval_every_samples must be > 0); 0 = train to sample_budget.")
  actor_lr, actor_adam = optimizer_settings(config.optim, b)
  critic_lr, critic_adam = optimizer_settings(config.critic.optim, b) if algo.critic else (None, None)
  return Member(algo=algo, family_axis=config.family_axis, seed=config.seed, batch_size=b,
                num_prompts=p, group_size=g, mini_batch_size=mini, micro_batch_size=micro, num_micro=mini // micro,
                sample_budget=config.sample_budget, total_steps=math.ceil(config.sample_budget / b),
                actor_lr=actor_lr, actor_adam=actor_adam, critic_lr=critic_lr, critic_adam=critic_adam,
                batch_derivation=derivation, score_num_micro=b // score_micro)
