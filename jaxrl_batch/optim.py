"""AdamW from a config, with the learning-rate schedule measured in samples (rollouts) seen.

Family members with different batch sizes take different numbers of optimizer steps for the same
number of samples; measuring warmup and decay in samples keeps their schedules comparable.

The learning rate is a schedule function, not an injected hyperparameter: to log the lr used by the
next update, call `optimizer.schedule(step)` with `step` = number of updates already applied (optax
passes the same count to the schedule). Note that with warmup the first update (step 0) has lr 0.
"""
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_batch import family

SCHEDULES = ("constant", "cosine")


class Optimizer(NamedTuple):
  """tx: the optax transformation; schedule: update count -> lr; lr: the peak lr and its derivation;
  adam: the (beta1, beta2, epsilon) used (rescaled by the adam_sde rule)."""
  tx: optax.GradientTransformation
  schedule: Callable[[jax.Array | int], jax.Array]
  lr: family.LearningRate
  adam: tuple[float, float, float]


def sample_schedule(peak_lr: float, samples_per_update: int, warmup_samples: int, kind: str,
                    sample_budget: int, final_lr_frac: float) -> Callable[[jax.Array | int], jax.Array]:
  """Schedule over update count n, evaluated at samples = n * samples_per_update.

  Linear warmup from 0 to `peak_lr` over `warmup_samples`; then constant, or ("cosine") a cosine from
  `peak_lr` down to `final_lr_frac * peak_lr` at `sample_budget` samples, held there afterwards.
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

  def schedule(step):
    # float32 before multiplying: step * samples_per_update overflows int32 in long runs.
    samples = jnp.asarray(step, jnp.float32) * samples_per_update
    warmup = jnp.minimum(samples / warmup_samples, 1.0) if warmup_samples > 0 else 1.0
    if kind == "constant":
      return peak_lr * warmup
    progress = jnp.clip((samples - warmup_samples) / (sample_budget - warmup_samples), 0.0, 1.0)
    cosine = final_lr_frac + (1.0 - final_lr_frac) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return peak_lr * warmup * cosine

  return schedule


def make_optimizer(optim_cfg: Any, samples_per_update: int, sample_budget: int, updates_per_batch: int = 1) -> Optimizer:
  """AdamW (optionally after global-norm clipping) for a member with `samples_per_update` rollouts per step.

  The family rule sees the batch `samples_per_update`; with `updates_per_batch` > 1 (epochs x mini-batches) the
  schedule advances samples_per_update / updates_per_batch samples per optimizer update.

  `optim_cfg` fields: base_lr, base_batch, lr_rule, lr (explicit peak lr; <= 0 derives it by the rule at
  batch = samples_per_update), b1, b2, eps, weight_decay (decoupled, multiplied by the lr as in
  optax.adamw; applied to every parameter), grad_clip (global-norm; 0 disables), warmup_samples,
  schedule ("constant" | "cosine"), final_lr_frac. `sample_budget` is the total samples of the run.
  """
  lr = family.derive_lr(optim_cfg.base_lr, optim_cfg.base_batch, samples_per_update,
                        optim_cfg.lr_rule, optim_cfg.lr)
  schedule = sample_schedule(lr.lr, samples_per_update / updates_per_batch, optim_cfg.warmup_samples,
                             optim_cfg.schedule, sample_budget, optim_cfg.final_lr_frac)
  if optim_cfg.grad_clip < 0:
    raise ValueError(f"grad_clip must be >= 0 (global norm; 0 disables), got {optim_cfg.grad_clip}.")
  b1, b2, eps = family.scale_adam(optim_cfg.b1, optim_cfg.b2, optim_cfg.eps, optim_cfg.base_batch,
                                  samples_per_update, optim_cfg.lr_rule)
  tx = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=optim_cfg.weight_decay)
  if optim_cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(optim_cfg.grad_clip), tx)
  return Optimizer(tx=tx, schedule=schedule, lr=lr, adam=(b1, b2, eps))
