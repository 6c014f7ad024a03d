"""GRPO loss terms as per-token functions plus one global-token aggregation.

Per-token values are summed over valid tokens and divided by `num_tokens`, the number of valid tokens
of the whole mini-batch (not of the micro-batch slice at hand), so that summing the losses or
gradients of micro-batches gives exactly the full mini-batch value.
"""
import jax
import jax.numpy as jnp


def token_logprobs(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
  """log p(target) per token, float32, computed as logit[target] - logsumexp(logits). Returns logp_BxT."""
  logits_BxTxV = logits_BxTxV.astype(jnp.float32)
  target_logit_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
  return target_logit_BxT - jax.nn.logsumexp(logits_BxTxV, axis=-1)


def entropy_from_logits(logits_BxTxV: jax.Array) -> jax.Array:
  """Entropy of the next-token distribution in nats, float32. Returns ent_BxT."""
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)


def clipped_policy_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, adv_B: jax.Array,
                        clip_eps: float) -> tuple[jax.Array, jax.Array]:
  """PPO/GRPO surrogate per token: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A).

  ratio = exp(logp - old_logp); A is the rollout's advantage broadcast over its tokens.
  Returns (loss_BxT, clipped_BxT), clipped_BxT a float32 0/1 indicator that the clipped branch is the
  strictly smaller one (ratio > 1 + eps with A > 0, or ratio < 1 - eps with A < 0); such a token
  contributes no gradient.
  """
  ratio_BxT = jnp.exp(logp_BxT - old_logp_BxT)
  adv_Bx1 = adv_B[:, None]
  unclipped_BxT = ratio_BxT * adv_Bx1
  clipped_obj_BxT = jnp.clip(ratio_BxT, 1.0 - clip_eps, 1.0 + clip_eps) * adv_Bx1
  loss_BxT = -jnp.minimum(unclipped_BxT, clipped_obj_BxT)
  return loss_BxT, (clipped_obj_BxT < unclipped_BxT).astype(jnp.float32)


def kl_k3(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
  """Schulman's k3 estimate of KL(pi || pi_ref) per token: exp(d) - d - 1, d = ref_logp - logp (>= 0)."""
  d_BxT = ref_logp_BxT - logp_BxT
  return jnp.exp(d_BxT) - d_BxT - 1.0


def masked_token_sum_mean(x_BxT: jax.Array, mask_BxT: jax.Array, num_tokens: jax.Array | int) -> jax.Array:
  """sum(x * mask) / num_tokens, with num_tokens the valid-token count of the whole mini-batch.

  Masked positions are dropped with `where`, so inf/NaN there do not leak into the value. A global
  count of 0 is treated as 1 (the result is then 0).
  """
  total = jnp.sum(jnp.where(mask_BxT.astype(bool), x_BxT, 0.0))
  return total / jnp.maximum(num_tokens, 1)


def grpo_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, ref_logp_BxT: jax.Array | None,
              adv_B: jax.Array, mask_BxT: jax.Array, num_tokens: jax.Array | int, clip_eps: float,
              kl_coef: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped policy loss + kl_coef * k3-KL, each a masked sum over tokens / global `num_tokens`.

  `kl_coef` must be a Python float (static under jit): at 0 the KL term is not computed and
  `ref_logp_BxT` may be None. Returns (loss, aux) with aux scalars aggregated the same way (sum them
  over micro-batches): policy_loss, kl (0.0 when skipped), clip_frac, ratio_mean.
  """
  loss_BxT, clipped_BxT = clipped_policy_loss(logp_BxT, old_logp_BxT, adv_B, clip_eps)

  def token_mean(x_BxT):
    return masked_token_sum_mean(x_BxT, mask_BxT, num_tokens)

  policy_loss = token_mean(loss_BxT)
  if kl_coef == 0.0:
    kl = jnp.zeros((), jnp.float32)
  elif ref_logp_BxT is None:
    raise ValueError(f"kl_coef={kl_coef} needs ref_logp_BxT; pass the reference model's logprobs "
                     "or set kl_coef=0.")
  else:
    kl = token_mean(kl_k3(logp_BxT, ref_logp_BxT))
  aux = {
      "policy_loss": policy_loss,
      "kl": kl,
      "clip_frac": token_mean(clipped_BxT),
      "ratio_mean": token_mean(jnp.exp(logp_BxT - old_logp_BxT)),
  }
  return policy_loss + kl_coef * kl, aux
