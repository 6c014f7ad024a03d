"""What the trainer measures of a mixture-of-experts model's routing, and its load-balancing loss.

Per MoE layer l of the trainer's forward over a batch (`model.moe.Routing`, tokens N = B x T, valid ones only):
  load[l, e]: assignments of valid tokens to expert e (k per token);
  expert_load_cv: the coefficient of variation std_e(load[l, e]) / mean_e(load[l, e]), averaged over layers
    (0 = perfectly balanced; sqrt(E / k - 1) when every token goes to the same k experts);
  router_mismatch_frac: over the (token, layer) decisions the sampler recorded (`TrainBatch.experts_BxTxLxK`), the
    fraction whose trainer top-k expert set (from its own router, before any replay) differs from the sampler's:
    the routing disagreement that breaks the importance ratio of MoE RL, and that routing replay removes;
  load-balancing loss (Switch Transformer / `transformers`' `load_balancing_loss_func`, per layer, averaged over
    layers): E x sum_e f_e P_e, f_e = assignments to e per valid token, P_e = mean router probability of e; k at
    perfect balance.
"""
import jax
import jax.numpy as jnp


def _valid_N(valid_BxT):
  return valid_BxT.reshape(-1).astype(jnp.float32)


def expert_load(routings, valid_BxT) -> jax.Array:
  """float32 (L, E): assignments of valid tokens to each expert, per MoE layer."""
  valid_N = _valid_N(valid_BxT)
  return jnp.stack([jnp.zeros(r.probs_NxE.shape[-1]).at[r.experts_NxK].add(
      jnp.broadcast_to(valid_N[:, None], r.experts_NxK.shape)) for r in routings])


def expert_load_cv(load_LxE) -> jax.Array:
  """Coefficient of variation of tokens per expert, averaged over layers (scalar)."""
  mean_L = jnp.mean(load_LxE, axis=-1)
  return jnp.mean(jnp.std(load_LxE, axis=-1) / jnp.maximum(mean_L, 1e-9))


def mismatched(routings, valid_BxT, recorded_BxTxLxK) -> tuple[jax.Array, jax.Array]:
  """(decisions whose trainer top-k set differs from the recorded one, decisions recorded): float32 scalars over
  valid tokens and MoE layers; a decision is recorded when none of its K entries is -1."""
  valid_N = valid_BxT.reshape(-1)
  differ, counted = jnp.zeros(()), jnp.zeros(())
  for layer, r in enumerate(routings):
    k = r.experts_NxK.shape[-1]
    own_NxK = jnp.sort(jax.lax.top_k(r.probs_NxE, k)[1], axis=-1)
    sampler_NxK = jnp.sort(recorded_BxTxLxK[:, :, layer].reshape(-1, k).astype(jnp.int32), axis=-1)
    recorded_N = valid_N & jnp.all(sampler_NxK >= 0, axis=-1)
    differ = differ + jnp.sum(recorded_N & jnp.any(own_NxK != sampler_NxK, axis=-1))
    counted = counted + jnp.sum(recorded_N)
  return differ, counted


def load_balancing_loss(routings, valid_BxT) -> jax.Array:
  """E x sum_e f_e P_e over valid tokens, averaged over MoE layers (scalar; differentiable through P)."""
  valid_N = _valid_N(valid_BxT)
  count = jnp.maximum(jnp.sum(valid_N), 1.0)
  load_LxE = jax.lax.stop_gradient(expert_load(routings, valid_BxT))
  losses = [e * jnp.sum(load_E / count * (valid_N @ r.probs_NxE) / count)
            for load_E, r in zip(load_LxE, routings) for e in [r.probs_NxE.shape[-1]]]
  return jnp.mean(jnp.stack(losses))


def micro_batch_terms(routings, valid_BxT, recorded_BxTxLxK, num_micro) -> dict:
  """A micro-batch's router sums: expert loads, mismatched and recorded decisions (where the sampler recorded its
  routing), and its load-balancing loss / num_micro (so that the micro-batches sum to their mean)."""
  terms = dict(expert_load=expert_load(routings, valid_BxT),
               router_aux_loss=load_balancing_loss(routings, valid_BxT) / num_micro)
  if recorded_BxTxLxK is not None:
    terms["router_mismatched"], terms["router_recorded"] = mismatched(routings, valid_BxT, recorded_BxTxLxK)
  return terms


def logged(aux: dict) -> dict:
  """The update's metrics with the summed router terms replaced by the logged expert_load_cv and
  router_mismatch_frac."""
  aux = dict(aux)
  if "expert_load" in aux:
    aux["expert_load_cv"] = expert_load_cv(aux.pop("expert_load"))
  if "router_recorded" in aux:
    aux["router_mismatch_frac"] = aux.pop("router_mismatched") / jnp.maximum(aux.pop("router_recorded"), 1.0)
  return aux
