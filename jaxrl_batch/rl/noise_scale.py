"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018), and its split into an
inter-prompt and an intra-prompt part, from squared norms of gradients the update computes anyway.

Model: prompts are independent and the rollouts of one prompt exchangeable, so the gradients x_b have mean G,
tr Cov(x_b, x_b') = A for two rollouts of one prompt (the inter-prompt part: how much prompts differ, plus the
covariance the group shares, which GRPO's group baseline makes negative: A < 0 is possible) and
tr Var(x_b) = A + C (C, the intra-prompt part: how much samples of one prompt differ). The loss gradient is
g = sum_b u_b x_b, u_b the rollout's share of the loss weights (sum_t w_bt). For any signs s_b in {+1, -1} and any
subset i of the rows (a micro-batch; U_{p,i} = sum of u_b over the rows of prompt p in i):
  E|sum_{b in i} s_b u_b x_b|^2 = |G|^2 (sum s_b u_b)^2 + A sum_p (sum_{b in p, i} s_b u_b)^2 + C sum u_b^2,
an equation linear in (|G|^2, A, C) whose coefficients the batch gives exactly, whatever the weights. A group is
the rows of one prompt that the mini-batch holds (with rl.mini_batches > 1, a part of the prompt's samples).

- `from_micro_batches` / `from_split_micro_batches`: from g and the micro-batch parts g_i, |G|^2 and the
  mini-batch's per-rollout trace tr = A * (sum_p U_p^2) / (sum_b u_b^2) + C (= G A + C for groups of G with equal
  weights), so that B_simple = tr / |G|^2 in rollouts. Exact (unbiased) in every configuration where |G|^2 is
  identifiable: where each micro-batch holds whole groups (one mini-batch in group order, micro-batches a multiple
  of the group size, no packing), `from_micro_batches` from |g|^2 and sum_i |g_i|^2; where micro-batches may split
  groups (rl.mini_batches > 1, micro-batches not a multiple of the group size, rl.packing),
  `from_split_micro_batches` by least squares over the equations of each |g_i|^2 and of |g|^2 - sum_i |g_i|^2,
  whose A coefficients differ. NaN with one micro-batch or where the split leaves |G|^2 unidentifiable. With
  groups split, the micro-batches identify |G|^2 only through how unevenly they split groups: exact, but noisier
  (two micro-batches: ~10x the whole-groups standard deviation; four or more sorted ones: about the same). The
  learner keeps each mini-batch's rows in batch order, so that few groups are split.
- `from_signed_gradients` (`rl.noise_split`): g, and g with the signs of the sample's parity in its group and of
  its prompt's parity: |G|^2, A and C, exact for any micro-batches, packing and mini-batches (NaN where the system
  is singular). B_inter = A / |G|^2 in prompts, B_intra = C / |G|^2 in rollouts; with G samples per prompt the
  batch's noise is A / P + C / (P G), so B_simple = G B_inter + B_intra rollouts.

The per-update estimates are unbiased but noisy; the ratios are taken after exponential moving averages, as the
paper recommends (`NoiseScale`, whose `row` gives a step's row fields).

The update meets all of this through one `Estimator` (`estimator(cfg, ids, train_actor)`): which of the three
applies (none while the actor is frozen), the loss weights' signed variant, each micro-batch's gradients and its
parts of the estimate, and the estimates at the end. `needs_ids` says where the update must get prompt ids.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from jaxrl_batch.rl import objective as objective_lib
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.objective import LossWeights, Terms
from jaxrl_batch.rl.packing import Packing


def _safe_div(num, den):
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.nan)


def dense_ids(ids_B) -> jax.Array:
  """The ids renumbered 0..n-1 (n distinct ids; order kept: ids 0..n-1 stay themselves), so that per-id sums fit
  B segments whatever the ids (a mini-batch's prompts are numbered over the whole batch)."""
  return jnp.unique(ids_B, size=ids_B.shape[0], fill_value=-1, return_inverse=True)[1].reshape(ids_B.shape)


def from_micro_batches(grad_sq, micro_grad_sq_sum, micro_weight_sq_sum, weight_sum, weight_sq_sum) -> dict:
  """Unbiased (|G|^2, per-rollout trace) from |g|^2 and sum_i |g_i|^2 where each micro-batch holds whole groups
  (each row its own prompt, or micro-batches of whole groups), with sum_i U_i^2 = micro_weight_sq_sum,
  sum_b u_b = weight_sum, sum_b u_b^2 = weight_sq_sum; NaN with one micro-batch."""
  signal_sq = _safe_div(grad_sq - micro_grad_sq_sum, weight_sum**2 - micro_weight_sq_sum)
  trace = _safe_div(grad_sq - signal_sq * weight_sum**2, weight_sq_sum)
  return dict(noise_signal_sq=signal_sq, noise_trace=trace)


def micro_batch_design(u_B, prompt_B, micro_B, num_micro: int) -> tuple[jax.Array, jax.Array]:
  """(coef_Mx3 of E|g_i|^2 per micro-batch i, coef_3 of E|g|^2): the coefficients of (|G|^2, A, C), from each
  row's weight u_B, prompt id and micro-batch index (rows of micro-batch num_micro or beyond are left out)."""
  b = u_B.shape[0]
  prompt_B = dense_ids(prompt_B)
  pair_B = dense_ids(micro_B * b + prompt_B)  # (micro-batch, prompt) pairs
  pair_u = jax.ops.segment_sum(u_B, pair_B, num_segments=b)
  pair_micro = jax.ops.segment_max(micro_B, pair_B, num_segments=b)
  micro_sum = lambda x: jax.ops.segment_sum(x, micro_B, num_segments=num_micro)
  coef_Mx3 = jnp.stack([micro_sum(u_B)**2, jax.ops.segment_sum(pair_u**2, pair_micro, num_segments=num_micro),
                        micro_sum(u_B**2)], axis=1)
  coef_3 = jnp.stack([jnp.sum(u_B)**2, jnp.sum(jax.ops.segment_sum(u_B, prompt_B, num_segments=b)**2),
                      jnp.sum(u_B**2)])
  return coef_Mx3, coef_3


def _split_groups_signal(grad_sq, micro_grad_sq_M, coef_Mx3, coef_3):
  """Unbiased |G|^2 by least squares over the equations of |g_i|^2 and of |g|^2 - sum_i |g_i|^2 (no C term);
  NaN where |G|^2 is not in the row space of the coefficients (not identifiable)."""
  coef_Kx3 = jnp.concatenate([(coef_3 - jnp.sum(coef_Mx3, axis=0))[None], coef_Mx3]).at[0, 2].set(0.0)
  y_K = jnp.concatenate([(grad_sq - jnp.sum(micro_grad_sq_M))[None], micro_grad_sq_M])
  scale_3 = jnp.max(jnp.abs(coef_Kx3), axis=0)
  scale_3 = jnp.where(scale_3 > 0, scale_3, 1.0)
  pinv_3xK = jnp.linalg.pinv(coef_Kx3 / scale_3, rtol=1e-5)
  identifiable = jnp.abs((pinv_3xK @ (coef_Kx3 / scale_3))[0, 0] - 1.0) < 1e-3
  return jnp.where(identifiable, (pinv_3xK @ y_K)[0] / scale_3[0], jnp.nan)


def from_split_micro_batches(grad_sq, micro_grad_sq_M, micro_weight_M, u_B, prompt_B, micro_B) -> dict:
  """Unbiased (|G|^2, per-rollout trace) of a mini-batch whose micro-batches may split groups, from |g|^2, the
  micro-batches' |g_i|^2 and weight sums U_i (M of each; micro-batches past those that hold rows are 0), and each
  row's weight u_B, prompt id (any integers) and micro-batch index: `from_micro_batches` where each micro-batch
  holds whole groups, otherwise the least squares of `_split_groups_signal`; NaN with one micro-batch."""
  sq_sum = micro_weight_sq_sum = 0.0
  for i in range(micro_grad_sq_M.shape[0]):  # in micro-batch order, as the update accumulates its gradient
    sq_sum, micro_weight_sq_sum = sq_sum + micro_grad_sq_M[i], micro_weight_sq_sum + micro_weight_M[i]**2
  weight_sum, weight_sq_sum = jnp.sum(u_B), jnp.sum(u_B**2)
  whole = from_micro_batches(grad_sq, sq_sum, micro_weight_sq_sum, weight_sum, weight_sq_sum)
  prompt_B, num_micro = dense_ids(prompt_B), micro_grad_sq_M.shape[0]
  weighted_B = u_B != 0
  first = jax.ops.segment_min(jnp.where(weighted_B, micro_B, num_micro), prompt_B, num_segments=u_B.shape[0])
  last = jax.ops.segment_max(jnp.where(weighted_B, micro_B, -1), prompt_B, num_segments=u_B.shape[0])
  groups_whole = jnp.all((last < 0) | (first == last))
  signal_sq = _split_groups_signal(grad_sq, micro_grad_sq_M, *micro_batch_design(u_B, prompt_B, micro_B, num_micro))
  split = dict(noise_signal_sq=signal_sq, noise_trace=_safe_div(grad_sq - signal_sq * weight_sum**2, weight_sq_sum))
  return {k: jnp.where(groups_whole, whole[k], split[k]) for k in whole}


def signs(prompt_B, sample_B) -> jax.Array:
  """(B, 2) float32 signs of each rollout: (-1)^sample index in its group, (-1)^prompt index."""
  return jnp.stack([1.0 - 2.0 * (sample_B % 2), 1.0 - 2.0 * (prompt_B % 2)], axis=1).astype(jnp.float32)


def from_signed_gradients(sq_3, u_B, prompt_B, sample_B) -> dict:
  """Unbiased (|G|^2, A, C) from the squared norms sq_3 of g, g with sample-parity signs and g with prompt-parity
  signs (in that order), rollout weights u_B and each rollout's prompt id (any integers: a mini-batch's are
  numbered over the whole batch) and index in its group; NaN where the system is singular (a batch of one sample
  per prompt, or of one prompt)."""
  s_Bx3 = jnp.concatenate([jnp.ones_like(u_B)[:, None], signs(prompt_B, sample_B)], axis=1)
  su_Bx3 = s_Bx3 * u_B[:, None]
  per_prompt_Px3 = jax.ops.segment_sum(su_Bx3, dense_ids(prompt_B), num_segments=u_B.shape[0])
  coef_3x3 = jnp.stack([jnp.sum(su_Bx3, axis=0)**2, jnp.sum(per_prompt_Px3**2, axis=0),
                        jnp.full((3,), jnp.sum(u_B**2))], axis=1)
  det = jnp.linalg.det(coef_3x3)
  scale = jnp.prod(jnp.max(jnp.abs(coef_3x3), axis=0))
  signal_sq, inter, intra = jnp.where(jnp.abs(det) > 1e-6 * scale, jnp.linalg.solve(coef_3x3, sq_3), jnp.nan)
  return dict(noise_signal_sq=signal_sq, noise_inter_trace=inter, noise_intra_trace=intra)


def needs_ids(cfg: AlgoConfig, group_size: int, mini_batch_size: int, num_micro: int, packing: Packing | None) -> bool:
  """Whether the update gets each row's prompt and sample index (`rl.update.update`'s ids_Bx2): for rl.noise_split,
  and where micro-batches may split groups (shuffled mini-batches, packing, micro-batches not a multiple of the group
  size), which the estimate must know; elsewhere each micro-batch holds whole groups."""
  return bool(cfg.noise_split or cfg.mini_batches > 1 or packing or (mini_batch_size // num_micro) % group_size)


def signed_losses(terms: Terms, weights: LossWeights, kl_coef, cfg: AlgoConfig) -> list[jax.Array]:
  """The two signed variants of the loss (`rl.objective` under `weights.signed_BxTx2`) whose gradients' norms split
  the noise scale: the rollouts' terms with signed weights, without the load-balancing loss (not a sum over
  rollouts)."""
  terms = terms._replace(router_aux=None)
  return [objective_lib.objective(terms, weights.signed_BxTx2[..., k], kl_coef, cfg)[0] for k in range(2)]


WHOLE_GROUPS, SPLIT_GROUPS, SIGNED = "whole_groups", "split_groups", "signed"


@dataclasses.dataclass(frozen=True)
class Estimator:
  """The estimate one update makes: `from_micro_batches` (WHOLE_GROUPS), `from_split_micro_batches` (SPLIT_GROUPS:
  micro-batches may split groups, `ids_Bx2[:, 0]` the prompt ids) or `from_signed_gradients` (SIGNED:
  rl.noise_split); kind None (the actor frozen) makes none. The update weights its loss by `weights`,
  differentiates each micro-batch by `micro_batch` and sums what it returns, and adds `metrics` to its own."""

  kind: str | None
  ids_Bx2: jax.Array | None = None  # int32 prompt id and index in its group of each row

  def weights(self, weights: LossWeights) -> LossWeights:
    """`weights` with, for SIGNED, w_t times the two `signs` of the token's rollout (signed_BxTx2)."""
    if self.kind != SIGNED:
      return weights
    return weights._replace(signed_BxTx2=weights.loss_BxT[:, :, None] * signs(*self.ids_Bx2.T)[:, None, :])

  def micro_batch(self, loss_fn, trainable, weights: LossWeights, i, num_slots: int) -> tuple[tuple, tuple]:
    """((loss, aux, grads) of `loss_fn(trainable)`, parts) for micro-batch i of num_slots, `weights` its weights;
    both summed over the micro-batches. parts: WHOLE_GROUPS its actor |g_i|^2 and U_i^2 (U_i: its weight sum),
    SPLIT_GROUPS |g_i|^2 and U_i at slot i of num_slots, SIGNED the signed actor gradients (2, ...), else none."""
    if self.kind == SIGNED:
      loss_3, vjp_fn, aux = jax.vjp(loss_fn, trainable, has_aux=True)
      # One backward pass per cotangent: jit(vmap(vjp_fn)) miscomputed the signed rows on XLA:CPU (jax 0.10.2).
      (grads,), *signed = [vjp_fn(e) for e in jnp.eye(3, dtype=loss_3.dtype)]
      return (loss_3[0], aux, grads), jax.tree.map(lambda *g: jnp.stack(g), *(ct[0][0] for ct in signed))
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    if self.kind is None:
      return (loss, aux, grads), ()
    sq, u = optax.tree.norm(grads[0], squared=True), jnp.sum(weights.loss_BxT)
    if self.kind == SPLIT_GROUPS:
      return (loss, aux, grads), tuple(jnp.zeros((num_slots,), x.dtype).at[i].set(x) for x in (sq, u))
    return (loss, aux, grads), (sq, u**2)

  def metrics(self, grad_sq, parts, weights: LossWeights, micro_B) -> dict:
    """The update's estimates from the actor's |g|^2, the summed `micro_batch` parts, the mini-batch's weights and
    each row's micro-batch index."""
    u_B = weights.loss_BxT.sum(axis=1)
    if self.kind == SIGNED:
      signed_sq = [optax.tree.norm(jax.tree.map(lambda g: g[k], parts), squared=True) for k in (0, 1)]
      return from_signed_gradients(jnp.stack([grad_sq, *signed_sq]), u_B, *self.ids_Bx2.T)
    if self.kind == SPLIT_GROUPS:
      return from_split_micro_batches(grad_sq, *parts, u_B, self.ids_Bx2[:, 0], micro_B)
    if self.kind == WHOLE_GROUPS:
      return from_micro_batches(grad_sq, *parts, jnp.sum(u_B), jnp.sum(u_B**2))
    return {}


def estimator(cfg: AlgoConfig, ids_Bx2, train_actor: bool) -> Estimator:
  """The update's `Estimator`: none while the actor is frozen, SIGNED with rl.noise_split (which needs `ids_Bx2`),
  SPLIT_GROUPS with prompt ids (`needs_ids`: micro-batches may split groups), else WHOLE_GROUPS."""
  if not train_actor:
    return Estimator(None)
  if cfg.noise_split:
    if ids_Bx2 is None:
      raise ValueError("rl.noise_split needs each row's prompt id and index in its group (ids_Bx2).")
    return Estimator(SIGNED, ids_Bx2)
  return Estimator(WHOLE_GROUPS if ids_Bx2 is None else SPLIT_GROUPS, ids_Bx2)


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

  def row(self, metrics: dict, group_size: int, split: bool) -> dict:
    """The row's fields of a step's fetched metrics: noise_scale and, with `split` (rl.noise_split), noise_inter and
    noise_intra as `update` gives them; each None where the step made no estimate (the actor frozen)."""
    if "noise_signal_sq" not in metrics:
      return dict.fromkeys(("noise_scale", "noise_inter", "noise_intra") if split else ("noise_scale",))
    return self.update(metrics, group_size)
