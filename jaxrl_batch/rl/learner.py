"""From scored rollouts to updated parameters: the training batch, advantages, then epochs x mini-batches of updates.

Used by the trainer once per rollout step. Everything runs on the device: the batch is assembled from the rollouts
where they were sampled, and mini-batches are on-device gathers (by row orders drawn on the host from
`streams.shuffle_rng(seed, step)` and uploaded with the rewards) that keep the batch sharding; the step's metrics
stay on the device for the caller to fetch once.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_batch.rl import advantages as adv_lib
from jaxrl_batch.rl import losses
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.rl.packing import Packing
from jaxrl_batch.rl.forward import ModelDefs, logprobs_and_values, reference_cfg
from jaxrl_batch.rl.noise_scale import needs_ids
from jaxrl_batch.rl.update import update
from jaxrl_batch.runtime import sharding, streams


@functools.partial(jax.jit, static_argnames=("cfg", "group_size"))
def _assemble(tokens_BxT, valid_BxT, mask_BxT, sampler_logp_BxT, trainer_logp_BxT, ref_logp_BxT, values_BxT,
              rewards_B, kl_coef, experts_BxTxLxK=None, *, cfg: AlgoConfig, group_size: int
              ) -> tuple[TrainBatch, dict]:
  """Advantages and returns, and the batch around them, in one program; stats: returns_mean, and
  logp_gap_mean / vf_explained_var when trainer log-probs / values exist."""
  num_tokens = jnp.sum(mask_BxT)
  old_logp_BxT = sampler_logp_BxT if trainer_logp_BxT is None else trainer_logp_BxT
  token_rewards_BxT = None
  if cfg.use_kl and cfg.kl_in == "reward":
    token_rewards_BxT = -kl_coef * (old_logp_BxT - ref_logp_BxT)
  adv_BxT, returns_BxT = adv_lib.estimate(cfg.estimator, rewards_B, mask_BxT, group_size=group_size,
                                          token_rewards_BxT=token_rewards_BxT, values_BxT=values_BxT,
                                          gamma=cfg.gamma, lam=cfg.lam)
  if cfg.whiten_advantages:
    adv_BxT = adv_lib.whiten(adv_BxT, mask_BxT)
  stats = dict(returns_mean=losses.masked_token_sum_mean(returns_BxT, mask_BxT, num_tokens))
  if trainer_logp_BxT is not None:
    stats["logp_gap_mean"] = losses.masked_token_sum_mean(jnp.abs(trainer_logp_BxT - sampler_logp_BxT), mask_BxT,
                                                          num_tokens)
  if values_BxT is not None:
    stats["vf_explained_var"] = losses.explained_variance(values_BxT, returns_BxT, mask_BxT)
  zeros_BxT = jnp.zeros_like(old_logp_BxT)
  batch = TrainBatch(tokens_BxT, valid_BxT, mask_BxT, old_logp_BxT, sampler_logp_BxT,
                     zeros_BxT if ref_logp_BxT is None else ref_logp_BxT, adv_BxT, returns_BxT,
                     zeros_BxT if values_BxT is None else values_BxT, experts_BxTxLxK)
  return batch, stats


@functools.partial(jax.jit, static_argnames=("mesh",))
def _from_rollouts(rollouts, *, mesh):
  """(tokens_BxT, valid_BxT, loss_mask_BxT, sampler_logp_BxT, rewards_B, experts_BxTxLxK or None) of a
  `rl.rollouts.Rollouts`, with T = prompt + response tokens."""
  r = rollouts
  tokens_BxT = jnp.concatenate([r.prompt_BxP, r.tokens_BxN], axis=1)
  valid_BxT = jnp.concatenate([r.prompt_valid_BxP.astype(bool), r.mask_BxN.astype(bool)], axis=1)
  loss_mask_BxT = jnp.concatenate([jnp.zeros(r.prompt_BxP.shape, bool), r.mask_BxN & r.trained_B[:, None]], axis=1)
  sampler_logp_BxT = jnp.concatenate([jnp.zeros(r.prompt_BxP.shape, jnp.float32), r.logprobs_BxN], axis=1)
  sampler_logp_BxT = jnp.where(loss_mask_BxT, sampler_logp_BxT, 0.0).astype(jnp.float32)
  out = (tokens_BxT, valid_BxT, loss_mask_BxT, sampler_logp_BxT, r.rewards_B.astype(jnp.float32), r.experts_BxTxLxK)
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding.batch_sharding(mesh, x.ndim)), out)


@functools.partial(jax.jit, static_argnames=("mesh",))
def _take_rows(batch: TrainBatch, rows_S, *, mesh) -> TrainBatch:
  """The mini-batch of rows `rows_S`, batch-sharded like `batch`."""
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(jnp.take(x, rows_S, axis=0),
                                                                 sharding.batch_sharding(mesh, x.ndim)), batch)


@functools.partial(jax.jit, static_argnames=("batch_size", "group_size"))
def _prompt_ids(rows_S=None, *, batch_size: int, group_size: int) -> jax.Array:
  """(S, 2) int32 prompt id and index in its group of the batch rows `rows_S` (None: all B rows), computed on the
  device (no host transfer)."""
  rows_S = jnp.arange(batch_size, dtype=jnp.int32) if rows_S is None else rows_S
  return jnp.stack([rows_S // group_size, rows_S % group_size], axis=1)


@jax.jit
def _mean_over_updates(history: list[dict]) -> dict:
  """Each metric's mean over the step's updates; `logp_gap_mean` and `router_mismatch_frac` from the first (before any
  update of this step: the sampler's weights)."""
  out = {k: jnp.mean(jnp.stack([m[k] for m in history])) for k in history[0]}
  for first in ("logp_gap_mean", "router_mismatch_frac"):
    if first in out:
      out[first] = history[0][first]
  return out


class Learner:
  """Turns rollouts into a `TrainBatch` and applies cfg.epochs x cfg.mini_batches updates to it."""

  def __init__(self, cfg: AlgoConfig, models: ModelDefs, *, group_size: int, mini_batch_size: int, num_micro: int,
               seed: int, mesh, packing: Packing | None = None, score_num_micro: int = 1):
    """`packing`: every forward (trainer log-probs, reference, critic values, the update) over packed rows;
    `score_num_micro`: forwards that score a batch of padded rows (trainer and reference log-probs, values)."""
    self.cfg, self.models, self.mesh, self.packing = cfg, models, mesh, packing
    self.score_num_micro = score_num_micro
    self.group_size, self.mini_batch_size, self.num_micro, self.seed = group_size, mini_batch_size, num_micro, seed

  @property
  def with_ids(self) -> bool:
    """Whether `update` gets each row's prompt and sample index (`needs_ids`)."""
    return needs_ids(self.cfg, self.group_size, self.mini_batch_size, self.num_micro, self.packing)

  def update_kwargs(self, train_actor: bool) -> dict:
    """The static arguments of `rl.update.update` as `train` passes them (the compile-only check passes these)."""
    return dict(models=self.models, cfg=self.cfg, num_micro=self.num_micro, train_actor=train_actor,
                packing=self.packing)

  def score_kwargs(self, reference: bool = False) -> dict:
    """The static arguments of `rl.forward.logprobs_and_values` as `prepare` passes them: the policy's old
    log-probs and the critic's values, or with `reference` the frozen reference policy's log-probs (no routing
    replay, no critic)."""
    if reference:
      return dict(models=ModelDefs(self.models.graphdef), cfg=reference_cfg(self.cfg), packing=self.packing,
                  num_micro=self.score_num_micro)
    return dict(models=self.models, cfg=self.cfg, need_policy=self.cfg.old_logp == "trainer", packing=self.packing,
                num_micro=self.score_num_micro)

  def orders(self, step: int, batch_size: int) -> list[np.ndarray]:
    """Host row orders of the step's mini-batches (epochs x mini_batches int32 arrays; none for one mini-batch): a
    shuffle per epoch, each mini-batch's rows in batch order, so that a prompt's rows in it are contiguous and
    micro-batches split few groups (which the noise scale's estimate then needs less; `rl.noise_scale`)."""
    if self.cfg.mini_batches == 1:
      return []
    rng, size = streams.shuffle_rng(self.seed, step), self.mini_batch_size
    orders = []
    for _ in range(self.cfg.epochs):
      order = rng.permutation(batch_size).astype(np.int32)
      orders += [np.sort(order[i * size:(i + 1) * size]) for i in range(self.cfg.mini_batches)]
    return orders

  def prepare(self, state: dict, rollouts, ref_params, kl_coef) -> tuple[TrainBatch, dict]:
    """The training batch (sharded) and per-step statistics on the device (returns_mean, vf_explained_var, old-logp
    gap). `rollouts`: a `rl.rollouts.Rollouts`; kl_coef: float32 device scalar."""
    cfg = self.cfg
    tokens_BxT, valid_BxT, mask_BxT, sampler_logp_BxT, rewards_B, experts = _from_rollouts(rollouts, mesh=self.mesh)
    trainer_logp_BxT, values_BxT = logprobs_and_values(state["params"], state.get("critic"), tokens_BxT, valid_BxT,
                                                       mask_BxT, experts, **self.score_kwargs())
    ref_logp_BxT = None
    if cfg.use_kl:
      ref_logp_BxT, _ = logprobs_and_values(ref_params, None, tokens_BxT, valid_BxT, mask_BxT,
                                            **self.score_kwargs(reference=True))
    return _assemble(tokens_BxT, valid_BxT, mask_BxT, sampler_logp_BxT, trainer_logp_BxT, ref_logp_BxT, values_BxT,
                     rewards_B, kl_coef, experts, cfg=cfg, group_size=self.group_size)

  def train(self, state: dict, batch: TrainBatch, orders: list[jax.Array], step: int, kl_coef
            ) -> tuple[dict, dict]:
    """cfg.epochs passes over `batch`, each in cfg.mini_batches mini-batches (rows `orders`, from `orders()`, one
    update each); the actor is frozen during the first critic.warmup_steps steps. Returns (state, device metrics
    averaged over the updates)."""
    cfg = self.cfg
    train_actor = step >= cfg.critic_warmup_steps
    ids = lambda rows=None: (_prompt_ids(rows, batch_size=batch.tokens_BxT.shape[0], group_size=self.group_size)
                             if self.with_ids else None)
    minis = [(_take_rows(batch, rows, mesh=self.mesh), ids(rows)) for rows in orders] or [(batch, ids())] * cfg.epochs
    history = []
    for mini, mini_ids in minis:
      state, metrics = update(state, mini, kl_coef, mini_ids, **self.update_kwargs(train_actor))
      history.append(metrics)
    return state, _mean_over_updates(history)
