"""Sampling strategies: a small hashable value (a static jit argument) and the per-step token choice."""
import dataclasses

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the next token is chosen.

  Attributes:
    temperature: softmax temperature; 0 means greedy (argmax).
    top_k: keep only the k most likely tokens (0 = off).
    top_p: nucleus sampling, keep the smallest set with probability >= top_p (1.0 = off).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}.")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p}.")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def scaled_log_probs(logits_BxV: jax.Array, temperature: float) -> jax.Array:
  """log softmax(logits / T) in float32 (T = 1 for greedy): the distribution the trainer scores against."""
  t = temperature if temperature > 0 else 1.0
  return jax.nn.log_softmax(logits_BxV.astype(jnp.float32) / t, axis=-1)


def truncate(logp_BxV: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Sets tokens outside the top-k / top-p set to -inf (log-probs are not renormalised; sampling does not care)."""
  if top_k > 0:
    kth_B1 = jax.lax.top_k(logp_BxV, top_k)[0][:, -1:]
    logp_BxV = jnp.where(logp_BxV < kth_B1, _NEG_INF, logp_BxV)
  if top_p < 1.0:
    sorted_BxV = jnp.sort(logp_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept_BxV = mass_before_BxV < top_p
    threshold_B1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logp_BxV = jnp.where(logp_BxV < threshold_B1, _NEG_INF, logp_BxV)
  return logp_BxV


def choose(logits_BxV: jax.Array, rng: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """Next token and its log-prob under softmax(logits / T) (before truncation). Returns (token_B, logp_B)."""
  logp_BxV = scaled_log_probs(logits_BxV, params.temperature)
  if params.greedy:
    token_B = jnp.argmax(logp_BxV, axis=-1)
  else:
    token_B = jax.random.categorical(rng, truncate(logp_BxV, params.top_k, params.top_p), axis=-1)
  logp_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  return token_B.astype(jnp.int32), logp_B
