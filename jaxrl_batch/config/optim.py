"""AdamW from a config, with the learning-rate schedule measured in samples (rollouts) seen.

Family members with different batch sizes take different numbers of optimizer steps for the same
number of samples; measuring warmup and decay in samples keeps their schedules comparable. The
schedule itself is an optax schedule over the update count: warmup_samples / samples_per_update
updates of warmup, decay until sample_budget samples.

The learning rate is a schedule function, not an injected hyperparameter. `optimizer.schedule(n)`
is the lr optax uses for the update after `n` updates (optax passes the same count);
`optimizer.lr_at(n)` is the same lr computed on the host in float64 (no device work), for logging.
Note that with warmup the first update (n = 0) has lr 0.
"""
import math
from typing import Any, Callable, NamedTuple

import optax

from jaxrl_batch.config import family

SCHEDULES = ("constant", "cosine")


class Optimizer(NamedTuple):
  """tx: the optax transformation; schedule: update count -> lr (optax schedule); lr: the peak lr and its
  derivation; adam: the (beta1, beta2, epsilon) used (rescaled by the adam_sde rule); lr_at: update count ->
  the same lr as a Python float, computed on the host."""
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  lr: family.LearningRate
  adam: tuple[float, float, float]
  lr_at: Callable[[int], float]


def sample_schedule(peak_lr: float, samples_per_update: float, warmup_samples: int, kind: str, sample_budget: int,
                    final_lr_frac: float) -> tuple[optax.Schedule, Callable[[int], float]]:
  """(optax schedule, host function) over update count n, both giving the lr at samples = n * samples_per_update.

  Linear warmup from 0 to `peak_lr` over `warmup_samples`; then constant, or ("cosine") a cosine from
  `peak_lr` down to `final_lr_frac * peak_lr` at `sample_budget` samples, held there afterwards. Phase
  lengths in updates are warmup_samples / samples_per_update and (sample_budget - warmup_samples) /
  samples_per_update, fractional when the division is not exact.
  """
  if kind not in SCHEDULES:
    raise ValueError(f"Unknown schedule {kind!r}; use one of {SCHEDULES}.")
  if samples_per_update <= 0:
    raise ValueError(f"samples_per_update must be > 0 (rollouts per update), got {samples_per_update}.")
  if warmup_samples < 0:
    raise ValueError(f"warmup_samples must be >= 0 (0 disables warmup), got {warmup_samples}.")
  if not 0.0 <= final_lr_frac <= 1.0:
    raise ValueError(f"final_lr_frac must be in [0, 1] (fraction of the peak lr), got {final_lr_frac}.")
  if kind == "cosine" and sample_budget <= warmup_samples:
    raise ValueError(f"The cosine schedule needs sample_budget > warmup_samples, got "
                     f"sample_budget={sample_budget}, warmup_samples={warmup_samples}.")
  warmup_updates = warmup_samples / samples_per_update
  decay_updates = (sample_budget - warmup_samples) / samples_per_update

  # A schedule peaking at 1, scaled by peak_lr: in float32 the warmup lr then equals
  # peak_lr * (n * samples_per_update / warmup_samples) bit for bit when warmup_updates is a power of two (the
  # shipped settings); optax.linear_schedule(0, peak_lr) computes peak_lr - peak_lr * (1 - n / warmup_updates).
  warmup = optax.linear_schedule(0.0, 1.0, warmup_updates) if warmup_updates else optax.constant_schedule(1.0)
  if kind == "cosine":
    cosine = optax.cosine_decay_schedule(1.0, decay_updates, alpha=final_lr_frac)
    unit = optax.join_schedules([warmup, cosine], [warmup_updates]) if warmup_updates else cosine
  else:
    unit = warmup

  def lr_at(updates: int) -> float:
    if updates < warmup_updates:
      return peak_lr * (updates / warmup_updates)
    if kind == "constant":
      return peak_lr
    progress = min((updates - warmup_updates) / decay_updates, 1.0)
    return peak_lr * (final_lr_frac + (1.0 - final_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress)))

  return (lambda count: peak_lr * unit(count)), lr_at


def make_optimizer(optim_cfg: Any, samples_per_update: int, sample_budget: int, updates_per_batch: int = 1,
                   settings: tuple[family.LearningRate, tuple[float, float, float]] | None = None) -> Optimizer:
  """AdamW (optionally after global-norm clipping) for a member with `samples_per_update` rollouts per step.

  `settings`: the member's (peak lr, Adam's (beta1, beta2, eps)), as `family.Member` derived them; None derives them
  the same way (`family.optimizer_settings` at batch = samples_per_update). With `updates_per_batch` > 1 (epochs x
  mini-batches) the schedule advances samples_per_update / updates_per_batch samples per optimizer update.

  `optim_cfg` fields: base_lr, base_batch, lr_rule, lr (explicit peak lr; <= 0 derives it by the rule at
  batch = samples_per_update), b1, b2, eps, weight_decay (decoupled, multiplied by the lr as in
  optax.adamw; applied to every parameter), grad_clip (global-norm; 0 disables), warmup_samples,
  schedule ("constant" | "cosine"), final_lr_frac. `sample_budget` is the total samples of the run.
  """
  lr, (b1, b2, eps) = settings or family.optimizer_settings(optim_cfg, samples_per_update)
  schedule, lr_at = sample_schedule(lr.lr, samples_per_update / updates_per_batch, optim_cfg.warmup_samples,
                                    optim_cfg.schedule, sample_budget, optim_cfg.final_lr_frac)
  if optim_cfg.grad_clip < 0:
    raise ValueError(f"grad_clip must be >= 0 (global norm; 0 disables), got {optim_cfg.grad_clip}.")
  tx = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=optim_cfg.weight_decay)
  # The clip (or identity) keeps the optimizer state's structure independent of grad_clip: a branch may change it.
  clip = optax.clip_by_global_norm(optim_cfg.grad_clip) if optim_cfg.grad_clip > 0 else optax.identity()
  tx = optax.chain(clip, tx)
  return Optimizer(tx=tx, schedule=schedule, lr=lr, adam=(b1, b2, eps), lr_at=lr_at)
