"""The GRPO update: clipped surrogate + optional k3 KL, gradients accumulated over micro-batches."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl_batch.rl.batch import TrainBatch, sequence_logprobs, split_micro_batches
from jaxrl_batch.rl.losses import entropy_from_logits, grpo_loss, masked_token_sum_mean


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
  """Static loss settings (a jit static argument).

  clip_eps: ratio clip epsilon.
  kl_coef: weight of the k3 KL to the reference policy; 0 skips it.
  temperature: the sampling temperature; log-probs are scored under softmax(logits / temperature).
  """

  clip_eps: float = 0.2
  kl_coef: float = 0.0
  temperature: float = 1.0


def _micro_loss(params, graphdef, micro: TrainBatch, num_tokens, cfg: GRPOLossConfig):
  logp_BxT, logits_BxTxV = sequence_logprobs(graphdef, params, micro.tokens_BxT, micro.valid_BxT, cfg.temperature)
  mask_BxT = micro.loss_mask_BxT
  ref = micro.ref_logp_BxT if cfg.kl_coef > 0 else None
  loss, aux = grpo_loss(logp_BxT, micro.old_logp_BxT, ref, micro.adv_B, mask_BxT, num_tokens, cfg.clip_eps,
                        cfg.kl_coef)
  # Entry t of the entropy comes from the logits at t - 1, like logp.
  entropy_BxT = jnp.pad(entropy_from_logits(jax.lax.stop_gradient(logits_BxTxV[:, :-1])), ((0, 0), (1, 0)))
  aux["entropy"] = masked_token_sum_mean(entropy_BxT, mask_BxT, num_tokens)
  aux["logp_gap"] = masked_token_sum_mean(jnp.abs(jax.lax.stop_gradient(logp_BxT) - micro.old_logp_BxT), mask_BxT,
                                          num_tokens)
  return loss, aux


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "cfg", "num_micro"), donate_argnums=(0, 1))
def update(params, opt_state, batch: TrainBatch, *, graphdef, tx: optax.GradientTransformation, cfg: GRPOLossConfig,
           num_micro: int):
  """One optimizer step on `batch`, accumulating gradients over `num_micro` equal micro-batches.

  Every micro-batch loss is normalised by the token count of the whole batch, so the summed gradient does not
  depend on `num_micro`. Returns (params, opt_state, metrics dict of scalars); `micro_grad_sq` is the mean squared
  norm of the micro-batch mean gradients (for the gradient noise scale).
  """
  num_tokens = jnp.sum(batch.loss_mask_BxT)
  grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

  micro_batches = split_micro_batches(batch, num_micro)

  def micro_grads(micro):
    (loss, aux), grads = grad_fn(params, graphdef, micro, num_tokens, cfg)
    # Each micro gradient is normalised by the whole batch's tokens; x num_micro makes it (about) its own mean.
    return (loss, aux, grads), optax.tree.norm(grads, squared=True) * num_micro**2

  def accumulate(total, micro):
    return jax.tree.map(jnp.add, total, micro_grads(micro)), None

  shapes = jax.eval_shape(micro_grads, jax.tree.map(lambda x: x[0], micro_batches))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  ((loss, aux, grads), micro_sq_sum), _ = jax.lax.scan(accumulate, zeros, micro_batches)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = dict(aux, loss=loss, grad_norm=optax.tree.norm(grads), num_tokens=num_tokens,
                 micro_grad_sq=micro_sq_sum / num_micro)
  return params, opt_state, metrics


@jax.jit
def rollout_batch(prompt_BxP, prompt_valid_BxP, rollout, adv_B) -> TrainBatch:
  """The training batch of sampled responses: prompt + response tokens, loss on the response (EOS included)."""
  tokens_BxT = jnp.concatenate([prompt_BxP, rollout.tokens_BxN], axis=1)
  valid_BxT = jnp.concatenate([prompt_valid_BxP.astype(bool), rollout.mask_BxN], axis=1)
  loss_mask_BxT = jnp.concatenate([jnp.zeros_like(prompt_valid_BxP, bool), rollout.mask_BxN], axis=1)
  old_logp_BxT = jnp.concatenate([jnp.zeros(prompt_BxP.shape, jnp.float32), rollout.logprobs_BxN], axis=1)
  return TrainBatch(tokens_BxT, valid_BxT, loss_mask_BxT, old_logp_BxT, jnp.zeros_like(old_logp_BxT),
                    adv_B.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def reference_logprobs(ref_params, batch: TrainBatch, *, graphdef, temperature: float) -> TrainBatch:
  """`batch` with ref_logp_BxT filled in from the frozen reference policy."""
  logp_BxT, _ = sequence_logprobs(graphdef, ref_params, batch.tokens_BxT, batch.valid_BxT, temperature)
  return batch._replace(ref_logp_BxT=jnp.where(batch.loss_mask_BxT, logp_BxT, 0.0))
