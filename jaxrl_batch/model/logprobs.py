"""Per-token log-probs of a sequence under the policy, aligned with its tokens.

`token_stats` is what every training and scoring forward calls (update, old and reference log-probs, SFT): it
turns final hidden states into log-probs (and entropies) `model.logits_chunk` positions at a time, so that float32
logits never exist for the whole (B, T, V) at once. `sequence_logprobs` keeps the whole logits: the dense form the
chunked one is tested against.
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.model.masks import layout, training_layout


def sequence_logits(graphdef, params, tokens_BxT, valid_BxT, segment_ids_BxT=None, positions_BxT=None):
  """Full causal forward over left/right-padded sequences: logits_BxTxV (float32) at every position. Packed rows
  (several sequences per row) pass their segment ids and positions (`masks.layout`)."""
  model = nnx.merge(graphdef, params)
  logits_BxTxV, _ = model(tokens_BxT, *layout(valid_BxT, segment_ids_BxT, positions_BxT))
  return logits_BxTxV


def policy_logprobs(graphdef, params, tokens_BxT, valid_BxT, temperature: float = 1.0, segment_ids_BxT=None,
                    positions_BxT=None):
  """logp_BxT as `sequence_logprobs`, computed by `token_stats` (chunked logits; no entropy)."""
  model = nnx.merge(graphdef, params)
  hidden_BxTxD, _, _ = model.forward(tokens_BxT, *training_layout(model.cfg.attention, valid_BxT, segment_ids_BxT,
                                                                   positions_BxT))
  return token_stats(model, hidden_BxTxD, tokens_BxT, temperature)[0]


def token_stats(model, hidden_BxTxD, tokens_BxT, temperature: float = 1.0, entropy: bool = False):
  """(logp_BxT, entropy_BxT or None) under softmax(model.logits(hidden) / temperature), aligned with the tokens:
  entry t is log p(token t | prefix) and the entropy of the distribution it was drawn from; entry 0 is 0.

  Sequences longer than `model.cfg.logits_chunk` positions go through a scan over chunks of positions whose body
  is rematerialised: only one chunk's (B, chunk, V) logits are live, forward or backward. Equal to the dense form.
  """
  logits_fn = lambda h: model.logits(h) / temperature
  chunk = model.cfg.logits_chunk
  if not chunk or hidden_BxTxD.shape[1] - 1 <= chunk:
    logits_BxTxV = logits_fn(hidden_BxTxD)[:, :-1]
    stats = _stats(logits_BxTxV, tokens_BxT[:, 1:], entropy)
  else:
    stats = _chunked_stats(logits_fn, hidden_BxTxD[:, :-1], tokens_BxT[:, 1:], chunk, entropy)
  return tuple(None if x is None else jnp.pad(x, ((0, 0), (1, 0))) for x in stats)


def _stats(logits_BxCxV, targets_BxC, entropy: bool):
  """(log p(target), entropy or None) per position of float32-able logits."""
  logp_BxC = token_logprobs(logits_BxCxV, targets_BxC)
  return logp_BxC, entropy_from_logits(logits_BxCxV) if entropy else None


def _chunked_stats(logits_fn, hidden_BxTxD, targets_BxT, chunk: int, entropy: bool):
  """`_stats` of logits_fn(hidden) computed `chunk` positions at a time in a scan with a rematerialised body."""
  b, t, d = hidden_BxTxD.shape
  n = math.ceil(t / chunk)
  pad = ((0, 0), (0, n * chunk - t))
  hidden_NxBxCxD = jnp.pad(hidden_BxTxD, pad + ((0, 0),)).reshape(b, n, chunk, d).swapaxes(0, 1)
  targets_NxBxC = jnp.pad(targets_BxT, pad).reshape(b, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one(hidden_BxCxD, targets_BxC):
    logp_BxC, entropy_BxC = _stats(logits_fn(hidden_BxCxD), targets_BxC, entropy)
    return logp_BxC, jnp.zeros_like(logp_BxC) if entropy_BxC is None else entropy_BxC

  _, (logp_NxBxC, entropy_NxBxC) = jax.lax.scan(lambda c, xs: (c, one(*xs)), None, (hidden_NxBxCxD, targets_NxBxC))
  unchunk = lambda x_NxBxC: x_NxBxC.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return unchunk(logp_NxBxC), unchunk(entropy_NxBxC) if entropy else None


def entropy_from_logits(logits_BxTxV: jax.Array) -> jax.Array:
  """Entropy of the next-token distribution in nats, float32. Returns ent_BxT."""
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)


def token_logprobs(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
  """log p(target) per token, float32, computed as logit[target] - logsumexp(logits). Returns logp_BxT."""
  logits_BxTxV = logits_BxTxV.astype(jnp.float32)
  target_logit_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
  return target_logit_BxT - jax.nn.logsumexp(logits_BxTxV, axis=-1)


def sequence_logprobs(graphdef, params, tokens_BxT, valid_BxT, temperature: float = 1.0, segment_ids_BxT=None,
                      positions_BxT=None):
  """(logp_BxT, logits_BxTxV): log-prob of each token given its prefix, under softmax(logits / temperature).

  logp_BxT[:, 0] is 0 (the first token has no prefix); logits_BxTxV[:, t] predicts token t + 1. In packed rows the
  first token of each sequence is scored from the previous sequence's last logits: it is never a loss token.
  """
  logits_BxTxV = sequence_logits(graphdef, params, tokens_BxT, valid_BxT, segment_ids_BxT, positions_BxT)
  logits_BxTxV = logits_BxTxV / temperature
  return shifted_logprobs(logits_BxTxV, tokens_BxT), logits_BxTxV


def shifted_logprobs(logits_BxTxV, tokens_BxT):
  """logp_BxT aligned with the tokens: entry t = log p(token t | logits at t - 1); entry 0 is 0."""
  return jnp.pad(token_logprobs(logits_BxTxV[:, :-1], tokens_BxT[:, 1:]), ((0, 0), (1, 0)))
