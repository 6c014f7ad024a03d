"""Token-level returns: discounted reward-to-go and generalised advantage estimation (GAE), as reverse scans.

Per-token arrays follow `TrainBatch`'s alignment: entry t is the action "emit token t"; `mask_BxT` marks the
response tokens (contiguous per row). Values are V(state before token t). The episode ends after the last
response token, so its bootstrap value is 0.
"""
import jax
import jax.numpy as jnp


def _reverse_scan(step, init, *xs_BxT):
  """Runs `step(carry, x_t...) -> (carry, y_t)` from t = T-1 down to 0 over time-major copies; returns y_BxT."""
  _, y_TxB = jax.lax.scan(lambda carry, xs: step(carry, *xs), init, tuple(x.T for x in xs_BxT), reverse=True)
  return y_TxB.T


def discounted_returns(rewards_BxT: jax.Array, mask_BxT: jax.Array, gamma: float) -> jax.Array:
  """G_t = r_t + gamma * G_{t+1} over the masked tokens (0 elsewhere). Returns returns_BxT float32."""
  m_BxT = mask_BxT.astype(jnp.float32)

  def step(g_B, r_B, m_B):
    g_B = m_B * (r_B + gamma * g_B)
    return g_B, g_B

  return _reverse_scan(step, jnp.zeros(rewards_BxT.shape[0]), rewards_BxT * m_BxT, m_BxT)


def gae(rewards_BxT: jax.Array, values_BxT: jax.Array, mask_BxT: jax.Array, gamma: float,
        lam: float) -> tuple[jax.Array, jax.Array]:
  """GAE (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}.

  V_{t+1} and A_{t+1} are 0 past the last response token. Returns (adv_BxT, returns_BxT = adv + V), 0 off the mask.
  """
  m_BxT = mask_BxT.astype(jnp.float32)
  v_BxT = values_BxT.astype(jnp.float32) * m_BxT
  zeros_B = jnp.zeros(rewards_BxT.shape[0])

  def step(carry, r_B, v_B, m_B):
    next_v_B, next_a_B = carry
    a_B = m_B * (r_B + gamma * next_v_B - v_B + gamma * lam * next_a_B)
    # Off the mask (padding after the response) the carry resets to 0: nothing follows the episode's end.
    return (m_B * v_B, a_B), a_B

  adv_BxT = _reverse_scan(step, (zeros_B, zeros_B), rewards_BxT * m_BxT, v_BxT, m_BxT)
  return adv_BxT, (adv_BxT + v_BxT) * m_BxT
