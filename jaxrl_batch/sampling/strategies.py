"""Sampling strategies: a small hashable value (a static jit argument) and the per-step token choice."""
import dataclasses

import jax
import jax.numpy as jnp

_NEG_INF = -1e30
# Passes over the vocabulary go by chunks of _CHUNK tokens: one vectorised reduction per chunk, then work within
# one chunk per row. XLA's CPU argmax (a (value, index) reduction) and cumsum over 32k tokens are 10-30x slower.
_CHUNK = 128


@dataclasses.dataclass(frozen=True)
class Strategy:
  """How the next token is chosen; hashable, the static argument of `choose` and of the engines' programs. How
  the engine runs (`engine_settings.EngineSettings`) is apart: the same strategy gives the same tokens on each.

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
  """log softmax(logits / T) in float32, T > 0: the distribution the trainer scores against (greedy's is T = 1,
  taken straight from the logits by `choose`)."""
  return jax.nn.log_softmax(logits_BxV.astype(jnp.float32) / temperature, axis=-1)


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


def _chunks(x_BxV: jax.Array, fill: float) -> jax.Array:
  """x padded with `fill` to whole chunks of _CHUNK tokens: (B, C, _CHUNK)."""
  b, v = x_BxV.shape
  c = -(-v // _CHUNK)
  return jnp.pad(x_BxV, ((0, 0), (0, c * _CHUNK - v)), constant_values=fill).reshape(b, c, _CHUNK)


def _chunk_of(x_BxCxW: jax.Array, chunk_B: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x_BxCxW, chunk_B[:, None, None], axis=1)[:, 0]


def _last_positive(x_BxN: jax.Array) -> jax.Array:
  """Index of the last positive entry of each row (0 if none)."""
  return jnp.max(jnp.where(x_BxN > 0, jnp.arange(x_BxN.shape[-1]), 0), axis=-1)


def argmax(x_BxV: jax.Array) -> jax.Array:
  """jnp.argmax(x, -1), the first maximum: each chunk's maximum, then the argmax within the best chunk."""
  x_BxCxW = _chunks(x_BxV, -jnp.inf)
  chunk_B = jnp.argmax(x_BxCxW.max(axis=-1), axis=-1)
  return chunk_B * _CHUNK + jnp.argmax(_chunk_of(x_BxCxW, chunk_B), axis=-1)


def _uniform_Bx1(rng: jax.Array, rows: int) -> jax.Array:
  """U[0, 1) draws, one per row: from one key, or from a batch of keys (one per row, shape (B,))."""
  if rng.ndim == 1:
    return jax.vmap(jax.random.uniform)(rng)[:, None]
  return jax.random.uniform(rng, (rows, 1))


def sample(logp_BxV: jax.Array, rng: jax.Array) -> jax.Array:
  """One token per row from softmax(logp) (log-probs, normalised or not), by inverting the CDF at one uniform draw:
  the chunk from the cumulative chunk masses, then the token within it. Zero-probability tokens are never chosen.
  `rng`: one key for the batch, or one key per row (shape (B,)), which makes a row's token independent of the
  rows beside it."""
  p_BxCxW = jnp.exp(_chunks(logp_BxV, -jnp.inf))
  mass_BxC = p_BxCxW.sum(axis=-1)
  cum_BxC = jnp.cumsum(mass_BxC, axis=-1)
  u_Bx1 = _uniform_Bx1(rng, logp_BxV.shape[0]) * cum_BxC[:, -1:]
  chunk_B = jnp.minimum(jnp.sum(cum_BxC <= u_Bx1, axis=-1), _last_positive(mass_BxC))
  p_BxW = _chunk_of(p_BxCxW, chunk_B)
  before_Bx1 = jnp.take_along_axis(cum_BxC - mass_BxC, chunk_B[:, None], axis=-1)
  cum_BxW = before_Bx1 + jnp.cumsum(p_BxW, axis=-1)
  return chunk_B * _CHUNK + jnp.minimum(jnp.sum(cum_BxW <= u_Bx1, axis=-1), _last_positive(p_BxW))


def _whole_chunks_per_shard(logits_BxV: jax.Array) -> jax.Array:
  """The logits padded (-inf: probability 0, never chosen) so that each of the ambient mesh's `tensor` shards of the
  vocabulary holds whole chunks. At qwen2.5-1.5b's 151,936 tokens over 4 chips a shard ended inside a chunk and the
  TPU compiler gathered every row's float32 probabilities onto each chip (64 rows on v5p: the choice accessed
  652 MB, 134 MB padded; docs/results/2026-12-06-decode-roofline.md). Unpadded without a tensor axis, where the
  chunks are the same."""
  mesh = jax.sharding.get_abstract_mesh()
  whole = _CHUNK * (1 if mesh.empty else mesh.shape.get("tensor", 1))
  if whole == _CHUNK or logits_BxV.shape[-1] % whole == 0:
    return logits_BxV
  return jnp.pad(logits_BxV, ((0, 0), (0, -logits_BxV.shape[-1] % whole)), constant_values=-jnp.inf)


def choose(logits_BxV: jax.Array, rng: jax.Array, strategy: Strategy) -> tuple[jax.Array, jax.Array]:
  """Next token and its log-prob under softmax(logits / T) (before truncation); `rng` as `sample`'s. Returns
  (token_B, logp_B)."""
  logits_BxV = _whole_chunks_per_shard(logits_BxV)
  if strategy.greedy:
    logits_BxV = logits_BxV.astype(jnp.float32)
    token_B = argmax(logits_BxV)
    chosen_B = jnp.take_along_axis(logits_BxV, token_B[:, None], axis=-1)[:, 0]
    return token_B.astype(jnp.int32), chosen_B - jax.nn.logsumexp(logits_BxV, axis=-1)
  logp_BxV = scaled_log_probs(logits_BxV, strategy.temperature)
  token_B = sample(truncate(logp_BxV, strategy.top_k, strategy.top_p), rng)
  logp_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  return token_B.astype(jnp.int32), logp_B
