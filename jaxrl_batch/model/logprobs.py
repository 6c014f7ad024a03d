"""Per-token log-probs of a sequence under the policy, aligned with its tokens."""
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.model.masks import layout


def sequence_logits(graphdef, params, tokens_BxT, valid_BxT, segment_ids_BxT=None, positions_BxT=None):
  """Full causal forward over left/right-padded sequences: logits_BxTxV (float32) at every position. Packed rows
  (several sequences per row) pass their segment ids and positions (`masks.layout`)."""
  model = nnx.merge(graphdef, params)
  logits_BxTxV, _ = model(tokens_BxT, *layout(valid_BxT, segment_ids_BxT, positions_BxT))
  return logits_BxTxV


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
