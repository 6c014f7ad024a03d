"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018), and its split into an
inter-prompt and an intra-prompt part, from squared norms of gradients the update computes anyway.

Model: prompts are independent and the rollouts of one prompt exchangeable, so the gradients x_b have mean G,
tr Cov(x_b, x_b') = A for two rollouts of one prompt (the inter-prompt part: how much prompts differ, plus the
covariance the group shares, which GRPO's group baseline makes negative: A < 0 is possible) and
tr Var(x_b) = A + C (C, the intra-prompt part: how much samples of one prompt differ). The loss gradient is
g = sum_b u_b x_b, u_b the rollout's share of the loss weights (sum_t w_bt). For any signs s_b in {+1, -1}:
  E|sum_b s_b u_b x_b|^2 = |G|^2 (sum_b s_b u_b)^2 + A sum_p (sum_{b in p} s_b u_b)^2 + C sum_b u_b^2,
an equation linear in (|G|^2, A, C) whose coefficients the batch gives exactly, whatever the weights.

- `from_micro_batches`: g and the micro-batch parts g_i (sum_i |g_i|^2): |G|^2 and the per-rollout trace
  tr = A * (sum_p U_p^2) / (sum_b u_b^2) + C (= G A + C for groups of G with equal weights), so B_simple = tr / |G|^2
  in rollouts. Exact when each micro-batch holds whole groups (padded micro-batches of a batch in group order);
  packed micro-batches split groups, which biases |G|^2 by a part of A.
- `from_signed_gradients` (`rl.noise_split`): g, and g with the signs of the sample's parity in its group and of
  its prompt's parity: |G|^2, A and C. B_inter = A / |G|^2 in prompts, B_intra = C / |G|^2 in rollouts; with G
  samples per prompt the batch's noise is A / P + C / (P G), so B_simple = G B_inter + B_intra rollouts.

The per-update estimates are unbiased but noisy; the ratios are taken after exponential moving averages, as the
paper recommends.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp


def _safe_div(num, den):
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.nan)


def from_micro_batches(grad_sq, micro_grad_sq_sum, micro_weight_sq_sum, weight_sum, weight_sq_sum) -> dict:
  """Unbiased (|G|^2, per-rollout trace) from |g|^2 and sum_i |g_i|^2 over micro-batches of loss weights U_i
  (sum_i U_i^2 = micro_weight_sq_sum, sum_b u_b = weight_sum, sum_b u_b^2 = weight_sq_sum); NaN with one
  micro-batch."""
  signal_sq = _safe_div(grad_sq - micro_grad_sq_sum, weight_sum**2 - micro_weight_sq_sum)
  trace = _safe_div(grad_sq - signal_sq * weight_sum**2, weight_sq_sum)
  return dict(noise_signal_sq=signal_sq, noise_trace=trace)


def signs(prompt_B, sample_B) -> jax.Array:
  """(B, 2) float32 signs of each rollout: (-1)^sample index in its group, (-1)^prompt index."""
  return jnp.stack([1.0 - 2.0 * (sample_B % 2), 1.0 - 2.0 * (prompt_B % 2)], axis=1).astype(jnp.float32)


def from_signed_gradients(sq_3, u_B, prompt_B, sample_B) -> dict:
  """Unbiased (|G|^2, A, C) from the squared norms sq_3 of g, g with sample-parity signs and g with prompt-parity
  signs (in that order), rollout weights u_B and each rollout's prompt id and index in its group; NaN where the
  system is singular (a batch of one sample per prompt, or of one prompt)."""
  s_Bx3 = jnp.concatenate([jnp.ones_like(u_B)[:, None], signs(prompt_B, sample_B)], axis=1)
  su_Bx3 = s_Bx3 * u_B[:, None]
  per_prompt_Px3 = jax.ops.segment_sum(su_Bx3, prompt_B, num_segments=u_B.shape[0])
  coef_3x3 = jnp.stack([jnp.sum(su_Bx3, axis=0)**2, jnp.sum(per_prompt_Px3**2, axis=0),
                        jnp.full((3,), jnp.sum(u_B**2))], axis=1)
  det = jnp.linalg.det(coef_3x3)
  scale = jnp.prod(jnp.max(jnp.abs(coef_3x3), axis=0))
  signal_sq, inter, intra = jnp.where(jnp.abs(det) > 1e-6 * scale, jnp.linalg.solve(coef_3x3, sq_3), jnp.nan)
  return dict(noise_signal_sq=signal_sq, noise_inter_trace=inter, noise_intra_trace=intra)


@dataclasses.dataclass
class NoiseScale:
  """Running noise scales: EMAs (decay `decay`) of the per-update estimates, folded in once per step; a NaN estimate
  (one micro-batch, a singular split) is skipped. The EMAs' bias corrections are equal and cancel in the ratios."""

  decay: float = 0.95
  signal_sq: float = 0.0
  trace: float = 0.0
  inter: float = 0.0
  intra: float = 0.0
  seen: bool = False

  def update(self, estimates: dict, group_size: int) -> dict:
    """Folds in one step's `from_micro_batches` or `from_signed_gradients` estimates; returns the row fields
    noise_scale (B_simple, rollouts) and, from a split, noise_inter (prompts) and noise_intra (rollouts), each
    None while there is no estimate or the |G|^2 EMA is not positive."""
    split = "noise_inter_trace" in estimates
    values = [estimates["noise_signal_sq"]] + ([estimates["noise_inter_trace"], estimates["noise_intra_trace"]]
                                               if split else [estimates["noise_trace"]])
    if all(math.isfinite(v) for v in values):
      self.seen = True
      ema = lambda old, new: self.decay * old + (1 - self.decay) * new
      self.signal_sq = ema(self.signal_sq, values[0])
      if split:
        self.inter, self.intra = ema(self.inter, values[1]), ema(self.intra, values[2])
      else:
        self.trace = ema(self.trace, values[1])
    ok = self.seen and self.signal_sq > 0
    ratio = lambda x: x / self.signal_sq if ok else None
    if not split:
      return dict(noise_scale=ratio(self.trace))
    inter, intra = ratio(self.inter), ratio(self.intra)
    return dict(noise_scale=None if inter is None else group_size * inter + intra, noise_inter=inter,
                noise_intra=intra)
