"""Per-token loss terms of GRPO/PPO and the global-count aggregation that combines them.

Every per-token term is reduced as sum_t(w_t * x_t) with weights from `token_weights`, computed on the whole
mini-batch before it is split into micro-batches: summing the micro-batch losses or gradients then gives exactly
the mini-batch value, whatever the micro-batch size or device count.
"""
import jax
import jax.numpy as jnp

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
TIS_MODES = ("truncate", "mask")


def masked_token_sum_mean(x_BxT: jax.Array, mask_BxT: jax.Array, num_tokens: jax.Array | int) -> jax.Array:
  """sum(x * mask) / num_tokens, num_tokens counted over the whole mini-batch (0 is treated as 1).

  Masked positions are dropped with `where`, so inf/NaN there do not leak into the value.
  """
  total = jnp.sum(jnp.where(mask_BxT.astype(bool), x_BxT, 0.0))
  return total / jnp.maximum(num_tokens, 1)


def token_weights(mask_BxT: jax.Array, aggregation: str, constant: float = 1.0) -> jax.Array:
  """Weights w_BxT (0 off the mask) such that the aggregated loss is sum(w * loss_BxT).

  With n_i the loss tokens of sequence i, N_tok = sum_i n_i and N_seq the sequences with n_i > 0:
    token_mean:           w = 1 / N_tok                (every token counts the same)
    seq_mean_token_mean:  w = 1 / (N_seq * n_i)        (every sequence counts the same)
    seq_mean_token_sum:   w = 1 / N_seq
    constant:             w = 1 / (N_seq * constant)   (Dr.GRPO: a fixed length normaliser, e.g. max tokens)
  Call on the whole mini-batch: the counts are global.
  """
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"Unknown loss aggregation {aggregation!r}; use one of {AGGREGATIONS}.")
  mask_BxT = mask_BxT.astype(jnp.float32)
  n_B = mask_BxT.sum(axis=1)
  num_seqs = jnp.maximum(jnp.sum(n_B > 0), 1)
  if aggregation == "token_mean":
    return mask_BxT / jnp.maximum(n_B.sum(), 1.0)
  if aggregation == "seq_mean_token_mean":
    return mask_BxT / (num_seqs * jnp.maximum(n_B, 1.0))[:, None]
  if aggregation == "seq_mean_token_sum":
    return mask_BxT / num_seqs
  return mask_BxT / (num_seqs * constant)


def weighted_sum(x_BxT: jax.Array, weights_BxT: jax.Array) -> jax.Array:
  """sum(w * x), with x ignored (even inf/NaN) where w == 0."""
  return jnp.sum(jnp.where(weights_BxT != 0, x_BxT * weights_BxT, 0.0))


def log_ratio(logp_BxT: jax.Array, old_logp_BxT: jax.Array, mask_BxT: jax.Array, level: str,
              segment_ids_BxT: jax.Array | None = None) -> jax.Array:
  """log(pi / pi_old) per token, 0 off the mask.

  level="token": the token's own log-ratio (PPO/GRPO). level="sequence" (GSPO, Zheng et al. 2025): every token of
  sequence i carries the sequence's mean log-ratio (1/n_i) sum_t log(pi/pi_old), so clipping acts on whole
  sequences; aggregate with seq_mean_token_mean to get GSPO's per-sequence objective. A sequence is a row, or in
  packed rows (`segment_ids_BxT` given) the tokens of one segment.
  """
  d_BxT = jnp.where(mask_BxT, logp_BxT - old_logp_BxT, 0.0)
  if level == "token":
    return d_BxT
  if level != "sequence":
    raise ValueError(f"Unknown ratio level {level!r}; use 'token' or 'sequence'.")
  if segment_ids_BxT is None:
    n_Bx1 = jnp.maximum(mask_BxT.sum(axis=1, keepdims=True), 1)
    return jnp.broadcast_to(d_BxT.sum(axis=1, keepdims=True) / n_Bx1, d_BxT.shape)
  same_BxTxT = (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]).astype(jnp.float32)
  n_BxT = jnp.maximum(jnp.einsum("bts,bs->bt", same_BxTxT, mask_BxT.astype(jnp.float32)), 1)
  return jnp.einsum("bts,bs->bt", same_BxTxT, d_BxT) / n_BxT


def policy_loss(log_ratio_BxT: jax.Array, adv_BxT: jax.Array, clip_low: float, clip_high: float,
                dual_clip: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """PPO surrogate per token with clip-higher and dual-clip.

  ratio = exp(log_ratio); loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A); with
  `dual_clip` = c > 1, tokens with A < 0 have their loss capped at -c * A (Ye et al. 2020).
  Returns (loss_BxT, clipped_low_BxT, clipped_high_BxT): float 0/1 indicators that the clip (not the ratio) sets
  the loss because ratio < 1 - clip_low with A < 0, or ratio > 1 + clip_high with A > 0 (no gradient there).
  """
  ratio_BxT = jnp.exp(log_ratio_BxT)
  unclipped_BxT = -ratio_BxT * adv_BxT
  clipped_BxT = -jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high) * adv_BxT
  loss_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)
  if dual_clip > 0:
    loss_BxT = jnp.where(adv_BxT < 0, jnp.minimum(loss_BxT, -dual_clip * adv_BxT), loss_BxT)
  low_BxT = (ratio_BxT < 1.0 - clip_low) & (adv_BxT < 0)
  high_BxT = (ratio_BxT > 1.0 + clip_high) & (adv_BxT > 0)
  return loss_BxT, low_BxT.astype(jnp.float32), high_BxT.astype(jnp.float32)


def behaviour_weight(prox_logp_BxT: jax.Array, behav_logp_BxT: jax.Array, cap: float,
                     mode: str) -> tuple[jax.Array, jax.Array]:
  """Importance weight of each token from the behaviour policy (the sampler's) to the proximal one (the trainer's
  before this step's updates), w = pi_prox / pi_behav, bounded by `cap`:
    truncate: min(w, cap)            (truncated IS; Yao et al. 2025)
    mask:     w if w <= cap, else 0  (the decoupled PPO objective's weight; AReaL, Fu et al. 2025: a token that
                                      far off-policy leaves the loss)
  Returns (weight_BxT, capped_BxT: float 0/1, w > cap)."""
  w_BxT = jnp.exp(prox_logp_BxT - behav_logp_BxT)
  capped_BxT = w_BxT > cap
  if mode == "truncate":
    return jnp.minimum(w_BxT, cap), capped_BxT.astype(jnp.float32)
  if mode != "mask":
    raise ValueError(f"Unknown rl.tis_mode {mode!r}; use one of {TIS_MODES}.")
  return jnp.where(capped_BxT, 0.0, w_BxT), capped_BxT.astype(jnp.float32)


def kl_penalty(logp_BxT: jax.Array, ref_logp_BxT: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi || pi_ref) from samples of pi, with r = logp - ref_logp (Schulman 2020):
  k1 = r (unbiased, signed), k2 = r^2 / 2, k3 = exp(-r) + r - 1 (unbiased, >= 0)."""
  r_BxT = logp_BxT - ref_logp_BxT
  if estimator == "k1":
    return r_BxT
  if estimator == "k2":
    return 0.5 * r_BxT**2
  if estimator == "k3":
    return jnp.exp(-r_BxT) + r_BxT - 1.0
  raise ValueError(f"Unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}.")


def value_loss(values_BxT: jax.Array, old_values_BxT: jax.Array, returns_BxT: jax.Array,
               clip: float) -> jax.Array:
  """Clipped value loss per token: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2); c = 0 disables
  the clipped branch."""
  unclipped_BxT = (values_BxT - returns_BxT) ** 2
  if clip <= 0:
    return 0.5 * unclipped_BxT
  clipped_BxT = (old_values_BxT + jnp.clip(values_BxT - old_values_BxT, -clip, clip) - returns_BxT) ** 2
  return 0.5 * jnp.maximum(unclipped_BxT, clipped_BxT)


def explained_variance(values_BxT: jax.Array, returns_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """1 - Var(R - V) / Var(R) over masked tokens (1 = perfect critic, 0 = no better than a constant)."""
  m_BxT = mask_BxT.astype(jnp.float32)
  n = jnp.maximum(m_BxT.sum(), 1.0)

  def var(x_BxT):
    mean = jnp.sum(x_BxT * m_BxT) / n
    return jnp.sum(((x_BxT - mean) * m_BxT) ** 2) / n

  return 1.0 - var(returns_BxT - values_BxT) / jnp.maximum(var(returns_BxT), 1e-8)
