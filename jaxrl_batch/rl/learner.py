"""From scored rollouts to updated parameters: the training batch, advantages, then epochs x mini-batches of updates.

Used by the trainer once per rollout step; holds no data position or randomness of its own beyond (seed, step).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_batch.distributed import to_host
from jaxrl_batch.rl import advantages as adv_lib
from jaxrl_batch.rl import losses
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.batch import TrainBatch, sequence_logprobs
from jaxrl_batch.rl.update import Models, score, update


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """A step's scored rollouts on the host (numpy), B = rows trained this step.

  prompt_BxP / prompt_valid_BxP: left-padded prompts; tokens_BxN, logprobs_BxN, mask_BxN: the sampler's output;
  rewards_B: task rewards after any overlong penalty; trained_B: rows whose tokens enter the loss.
  """
  prompt_BxP: np.ndarray
  prompt_valid_BxP: np.ndarray
  tokens_BxN: np.ndarray
  logprobs_BxN: np.ndarray
  mask_BxN: np.ndarray
  rewards_B: np.ndarray
  trained_B: np.ndarray


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def reference_logprobs(ref_params, tokens_BxT, valid_BxT, loss_mask_BxT, *, graphdef, temperature: float):
  """log-probs of the frozen reference policy per token (0 off the loss mask)."""
  logp_BxT, _ = sequence_logprobs(graphdef, ref_params, tokens_BxT, valid_BxT, temperature)
  return jnp.where(loss_mask_BxT, logp_BxT, 0.0)


@functools.partial(jax.jit, static_argnames=("cfg", "group_size"))
def _assemble(tokens_BxT, valid_BxT, mask_BxT, sampler_logp_BxT, trainer_logp_BxT, ref_logp_BxT, values_BxT,
              rewards_B, kl_coef, *, cfg: AlgoConfig, group_size: int) -> tuple[TrainBatch, dict]:
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
                     zeros_BxT if values_BxT is None else values_BxT)
  return batch, stats


class Learner:
  """Turns `Rollouts` into a `TrainBatch` and applies cfg.epochs x cfg.mini_batches updates to it."""

  def __init__(self, cfg: AlgoConfig, models: Models, *, group_size: int, micro_batch_size: int, seed: int,
               shard_batch):
    self.cfg, self.models = cfg, models
    self.group_size, self.micro_batch_size, self.seed = group_size, micro_batch_size, seed
    self.shard_batch = shard_batch

  def prepare(self, state: dict, rollouts: Rollouts, ref_params, kl_coef: float) -> tuple[TrainBatch, dict]:
    """The training batch (sharded) and per-step statistics (returns_mean, vf_explained_var, old-logp gap)."""
    cfg, r = self.cfg, rollouts
    tokens_BxT = np.concatenate([r.prompt_BxP, r.tokens_BxN], axis=1)
    valid_BxT = np.concatenate([r.prompt_valid_BxP.astype(bool), r.mask_BxN.astype(bool)], axis=1)
    loss_mask_BxT = np.concatenate([np.zeros(r.prompt_BxP.shape, bool), r.mask_BxN & r.trained_B[:, None]], axis=1)
    sampler_logp_BxT = np.concatenate([np.zeros(r.prompt_BxP.shape, np.float32), r.logprobs_BxN], axis=1)
    sampler_logp_BxT = np.where(loss_mask_BxT, sampler_logp_BxT, 0.0).astype(np.float32)
    tokens_BxT, valid_BxT, mask_BxT, sampler_logp_BxT, rewards_B = self.shard_batch(
        (tokens_BxT, valid_BxT, loss_mask_BxT, sampler_logp_BxT, r.rewards_B.astype(np.float32)))
    trainer_logp_BxT, values_BxT = score(state["params"], state.get("critic"), tokens_BxT, valid_BxT, mask_BxT,
                                         models=self.models, cfg=cfg, need_policy=cfg.old_logp == "trainer")
    ref_logp_BxT = None
    if cfg.use_kl:
      ref_logp_BxT = reference_logprobs(ref_params, tokens_BxT, valid_BxT, mask_BxT, graphdef=self.models.graphdef,
                                         temperature=cfg.temperature)
    batch, stats = _assemble(tokens_BxT, valid_BxT, mask_BxT, sampler_logp_BxT, trainer_logp_BxT, ref_logp_BxT,
                             values_BxT, rewards_B, jnp.float32(kl_coef), cfg=cfg, group_size=self.group_size)
    return batch, {k: float(v) for k, v in to_host(stats).items()}

  def train(self, state: dict, batch: TrainBatch, step: int, kl_coef: float) -> tuple[dict, dict]:
    """cfg.epochs passes over `batch`, each in cfg.mini_batches shuffled mini-batches (one update each); the actor
    is frozen during the first critic.warmup_steps steps. Returns (state, metrics averaged over the updates)."""
    cfg = self.cfg
    b = batch.tokens_BxT.shape[0]
    size = b // cfg.mini_batches
    num_micro = max(size // (self.micro_batch_size or size), 1)
    train_actor = step >= cfg.critic_warmup_steps
    rng = np.random.default_rng([self.seed, step, 1])
    host = to_host(batch) if cfg.mini_batches > 1 else None
    history = []
    for _ in range(cfg.epochs):
      order = rng.permutation(b) if cfg.mini_batches > 1 else None
      for i in range(cfg.mini_batches):
        mini = batch if order is None else self.shard_batch(
            jax.tree.map(lambda x: x[order[i * size:(i + 1) * size]], host))
        state, metrics = update(state, mini, jnp.float32(kl_coef), models=self.models, cfg=cfg, num_micro=num_micro,
                                train_actor=train_actor)
        history.append(metrics)
    history = to_host(history)
    mean = {k: float(np.mean([m[k] for m in history])) for k in history[0]}
    mean["updates"] = len(history)
    if train_actor:
      mean["clip_frac"] = mean["clip_frac_low"] + mean["clip_frac_high"]
      mean["logp_gap"] = float(history[0]["logp_gap"])  # Before any update of this step: sampler vs trainer only.
    return state, mean
