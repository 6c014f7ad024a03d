"""Mixture-of-experts SwiGLU (Qwen3-MoE): a softmax router picks k of E experts per token.

Dropless: every (token, expert) assignment is computed. Assignments are sorted into expert groups and run through
grouped matmuls (`jax.lax.ragged_dot`), so the work is k expert MLPs per token whatever the routing. When a call
has no more assignments than experts (a decode step of a few rows), a loop over the chosen experts runs instead
(`looped_swiglu`) on GPU and CPU: the step reads only the experts its tokens chose, each once, as the decode cost
model (`sampling.roofline`) counts; TPU's grouped matmul kernel reads only those already. On CPU the loop serves
every call: JAX lowers `ragged_dot` there to a masked dense product over every expert (65-75 ms for one token at
E = 16 experts of 768 x 1024, where the loop takes 2.2 ms; 190 against 57 ms at 128 tokens).

Under a mesh the block runs as one `shard_map` over every mesh axis: tokens are split over the batch axes (`data`,
`fsdp`, `expert`, those that divide the batch), experts over `expert`, each expert's hidden width over `tensor`.
A device all-gathers the tokens of its `expert` group, runs its own experts on the assignments routed to them, and
the partial outputs are summed back to the tokens' owners with a reduce-scatter. This moves (ep - 1) / ep of the
group's tokens each way, as much as an all-to-all of k copies does when k >= ep (Qwen3-30B-A3B: k = 8), and needs
no capacity factor.

With the LoRA target "experts" (`model.lora`) each expert of each stack has its own adapter, a (E, in, r) and
b (E, r, out), held with its expert: every path adds an assignment's low-rank update through its own expert's
factors, x a_e b_e, computed as the base product is (grouped matmuls over the same groups, or inside the loop), so
the output is the merged weights' (`lora.merged`). `adapters` below: the (a, b * scale) pairs of w_gate, w_up and
w_down in the compute dtype, or () without adapters (the programs are then those of a model without LoRA).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl_batch.model.layers import fan_in_normal, sharded_param
from jaxrl_batch.model.linear import linear
from jaxrl_batch.model.lora import SUFFIX, LoRAConfig
from jaxrl_batch.runtime import sharding

# Mesh axes tokens may be split over, outermost first (`runtime.sharding.MESH_AXES` minus `tensor`).
TOKEN_AXES = ("data", "fsdp", "expert")
# The expert stacks, in the order the expert computations take them.
STACKS = ("w_gate", "w_up", "w_down")


class Routing(NamedTuple):
  """One MoE layer's routing of N tokens.

  experts_NxK: int32 chosen experts, by decreasing router probability (unless replayed).
  weights_NxK: float32 mixing weights of the chosen experts (renormalised to sum 1 if `norm_topk_prob`).
  probs_NxE: float32 router softmax over all experts (load-balancing loss and statistics).
  """

  experts_NxK: jax.Array
  weights_NxK: jax.Array
  probs_NxE: jax.Array


def route(logits_NxE, k: int, norm_topk_prob: bool, replay_NxK=None) -> Routing:
  """Softmax over experts in float32, then the top k, or for tokens whose `replay_NxK` row is recorded (no entry
  < 0) those experts (routing replay: the sampler's choice).

  Replayed experts still take their weights from this router's probabilities, so the router gets gradients.
  """
  probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
  experts_NxK = jax.lax.top_k(probs_NxE, k)[1]
  if replay_NxK is not None:
    recorded_N = jnp.all(replay_NxK >= 0, axis=-1)
    experts_NxK = jnp.where(recorded_N[:, None], replay_NxK.astype(jnp.int32), experts_NxK)
  weights_NxK = jnp.take_along_axis(probs_NxE, experts_NxK, axis=-1)
  if norm_topk_prob:
    weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
  return Routing(experts_NxK, weights_NxK, probs_NxE)


def stacked_experts(routings: tuple[Routing, ...], batch: int, length: int):
  """The experts each of `batch` x `length` tokens went to in each MoE layer: int16 (B, T, L, K), as the engines
  record them for routing replay; None for a dense model (no routings)."""
  if not routings:
    return None
  return jnp.stack([r.experts_NxK.reshape(batch, length, -1) for r in routings], axis=2).astype(jnp.int16)


def _product(dot, x, w, adapter):
  """dot(x, w), plus with an adapter (a, b) its low-rank update dot(dot(x, a), b): one projection of the experts."""
  y = dot(x, w)
  return y if adapter is None else y + dot(dot(x, adapter[0]), adapter[1])


def grouped_swiglu(x_NxD, experts_NxK, weights_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, first_expert=0,
                   adapters=()):
  """sum_k weights[n, k] * SwiGLU_{experts[n, k]}(x[n]) for the experts first_expert..first_expert+E-1 held here;
  assignments to other experts contribute 0. Returns (N, D) in x's dtype."""
  n, k = experts_NxK.shape
  e = w_gate_ExDxF.shape[0]
  local_M = experts_NxK.reshape(-1) - first_expert
  held_M = (local_M >= 0) & (local_M < e)
  group_M = jnp.where(held_M, local_M, e)  # assignments held elsewhere sort last and fall in no group
  order_M = jnp.argsort(group_M, stable=True)
  sizes_E = jnp.bincount(group_M, length=e + 1)[:e].astype(jnp.int32)
  x_MxD = jnp.take(x_NxD, order_M // k, axis=0)
  gate, up, down = adapters or (None,) * 3
  dot = lambda x, w: jax.lax.ragged_dot(x, w, sizes_E)  # an adapter's x_MxD a -> (M, r) -> b, grouped alike
  h_MxF = jax.nn.silu(_product(dot, x_MxD, w_gate_ExDxF, gate)) * _product(dot, x_MxD, w_up_ExDxF, up)
  y_MxD = _product(dot, h_MxF, w_down_ExFxD, down)
  y_MxD = jnp.zeros_like(y_MxD).at[order_M].set(y_MxD, unique_indices=True)
  mix_NxK = jnp.where(held_M.reshape(n, k), weights_NxK, 0.0).astype(y_MxD.dtype)
  return jnp.einsum("nkd,nk->nd", y_MxD.reshape(n, k, -1), mix_NxK)


def looped_swiglu(x_NxD, experts_NxK, weights_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, first_expert=0,
                  adapters=()):
  """`grouped_swiglu`'s sum as a loop over the E experts held here that runs only those some token chose, each on
  all N tokens (its mixing weight 0 for the others): a call reads each chosen expert's weights once and no other
  expert's. The decode path (a few tokens a step): its cost follows the distinct experts chosen, E (1 - (1 - k/E)^N)
  under uniform routing (`sampling.roofline`), at up to E / k times the grouped FLOPs. Returns (N, D)."""
  local_NxK = experts_NxK - first_expert
  gate, up, down = adapters or (None,) * 3

  def expert(j, y_NxD):
    chosen_NxK = local_NxK == j
    mix_N = jnp.sum(jnp.where(chosen_NxK, weights_NxK, 0.0), axis=-1).astype(y_NxD.dtype)

    def run(y_NxD):
      dot = lambda x, w: x @ w[j]
      h_NxF = jax.nn.silu(_product(dot, x_NxD, w_gate_ExDxF, gate)) * _product(dot, x_NxD, w_up_ExDxF, up)
      return y_NxD + _product(dot, h_NxF, w_down_ExFxD, down) * mix_N[:, None]

    return jax.lax.cond(jnp.any(chosen_NxK), run, lambda y: y, y_NxD)

  return jax.lax.fori_loop(0, w_gate_ExDxF.shape[0], expert, jnp.zeros_like(x_NxD))


def expert_swiglu(x_NxD, experts_NxK, weights_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, first_expert=0,
                  adapters=()):
  """The MoE MLP of N tokens over the E experts held here, the same sum by platform (chosen when the program is
  lowered, `jax.lax.platform_dependent`):
    TPU  the grouped matmuls of `grouped_swiglu` always: XLA's TPU ragged dot is a Mosaic kernel whose grid runs over
         the groups with rows only (its compiled code, `aot.decode_roofline.grouped_kernels_skip_empty_groups`),
         so a decode step reads the chosen experts' weights, each once, without a loop's step per expert;
    GPU  `looped_swiglu` when the N k assignments are no more than E (decode), else the grouped matmuls;
    CPU  the loop always: JAX's `ragged_dot` is a masked product over every expert there (k times the loop's FLOPs).
  """
  n, k = experts_NxK.shape
  args = (x_NxD, experts_NxK, weights_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, first_expert, adapters)
  if n * k <= w_gate_ExDxF.shape[0]:
    return jax.lax.platform_dependent(*args, tpu=grouped_swiglu, default=looped_swiglu)
  return jax.lax.platform_dependent(*args, cpu=looped_swiglu, default=grouped_swiglu)


def chunked_swiglu(x_NxD, experts_NxK, weights_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, first_expert=0,
                   chunk: int = 0, adapters=()):
  """`expert_swiglu` of the N tokens `chunk` at a time (all at once if chunk is 0 or N <= chunk): each token's output
  depends on its own row only, so the sum is the same, while the sorted assignments (N k rows of D) exist for one
  chunk at a time; the backward pass recomputes each chunk's. Padding tokens route to no expert. Returns (N, D)."""
  n, d = x_NxD.shape
  args = (w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, first_expert, adapters)
  if not chunk or n <= chunk:
    return expert_swiglu(x_NxD, experts_NxK, weights_NxK, *args)
  pad = -n % chunk
  x_CxSxD = jnp.pad(x_NxD, ((0, pad), (0, 0))).reshape(-1, chunk, d)
  experts_CxSxK = jnp.pad(experts_NxK, ((0, pad), (0, 0)), constant_values=-1)
  weights_CxSxK = jnp.pad(weights_NxK, ((0, pad), (0, 0)))
  k = experts_NxK.shape[-1]
  run = jax.checkpoint(lambda xs: expert_swiglu(*xs, *args))
  y_CxSxD = jax.lax.map(run, (x_CxSxD, experts_CxSxK.reshape(-1, chunk, k), weights_CxSxK.reshape(-1, chunk, k)))
  return y_CxSxD.reshape(-1, d)[:n]


def sharded_swiglu(x_BxTxD, routing: Routing, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, chunk: int = 0, adapters=()):
  """`grouped_swiglu` of (B, T, D) tokens under the current mesh (see the module docstring), `chunk` tokens of a
  device at a time (`chunked_swiglu`); (B, T, D)."""
  mesh = jax.sharding.get_abstract_mesh()
  b, t, d = x_BxTxD.shape
  k = routing.experts_NxK.shape[-1]
  experts_BxTxK, weights_BxTxK = (a.reshape(b, t, k) for a in routing[:2])
  if mesh.empty or mesh.size == 1:
    return chunked_swiglu(x_BxTxD.reshape(b * t, d), *(a.reshape(b * t, k) for a in (experts_BxTxK, weights_BxTxK)),
                          w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, chunk=chunk, adapters=adapters).reshape(b, t, d)
  e, _, f = w_gate_ExDxF.shape
  ep = mesh.shape.get("expert", 1)
  if e % ep:
    raise ValueError(f"model.num_experts={e} is not a multiple of the mesh's expert axis ({ep}); set mesh.expert "
                     "to a divisor of the expert count.")
  tokens = sharding.dividing_axes(mesh, TOKEN_AXES, b)
  tp = sharding.dividing_axes(mesh, ("tensor",), f)
  rows = P(tokens or None)
  experts = "expert" if ep > 1 else None
  stack_DxF, stack_FxD = P(experts, None, tp or None), P(experts, tp or None)
  # An adapter's a (E, in, r) and b (E, r, out) are split like its stack's in and out axes: the partial sums of
  # w_down's adapter over `tensor` are summed with the base product's.
  adapter_specs = ((P(experts), stack_DxF), (P(experts), stack_DxF), (stack_FxD, P(experts))) if adapters else ()
  in_specs = (rows, rows, rows, stack_DxF, stack_DxF, stack_FxD, adapter_specs)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=in_specs, out_specs=rows, check_vma=False)
  def local(x, experts_, weights_, w_gate, w_up, w_down, adapters_):
    gathered = "expert" in tokens
    if gathered:
      x, experts_, weights_ = (jax.lax.all_gather(a, "expert", tiled=True) for a in (x, experts_, weights_))
    bl = x.shape[0]
    first = jax.lax.axis_index("expert") * w_gate.shape[0] if experts else 0
    y = chunked_swiglu(x.reshape(bl * t, d), experts_.reshape(bl * t, k), weights_.reshape(bl * t, k), w_gate, w_up,
                       w_down, first, chunk, adapters_).reshape(bl, t, d)
    if tp:
      y = jax.lax.psum(y, tp)
    if gathered:
      return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
    return jax.lax.psum(y, "expert") if experts else y

  return local(x_BxTxD, experts_BxTxK, weights_BxTxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, adapters)


class ExpertAdapter(nnx.Module):
  """`lora.Adapter` of each expert of a stack stored (E, in, out): a (E, in, r), b (E, r, out), float32, b zero at
  start, with logical axes ("expert", in, None) and ("expert", None, out) so they shard with their experts."""

  def __init__(self, weight: nnx.Param, cfg: LoRAConfig, rngs: nnx.Rngs):
    (e, fan_in, fan_out), (expert, in_name, out_name) = weight[...].shape, weight.get_metadata()["out_sharding"]
    self.scale = cfg.scale
    init_a = nnx.initializers.normal(stddev=fan_in**-0.5)
    self.a = nnx.Param(init_a(rngs.params(), (e, fan_in, cfg.rank), jnp.float32), out_sharding=(expert, in_name, None))
    self.b = nnx.Param(jnp.zeros((e, cfg.rank, fan_out), jnp.float32), out_sharding=(expert, None, out_name))

  def factors(self, dtype):
    """(a, b * scale) in `dtype`, as the expert computations take an adapter."""
    return self.a[...].astype(dtype), self.b[...].astype(dtype) * self.scale


class MoE(nnx.Module):
  """Router (D, E) and E stacked SwiGLU experts of hidden width `cfg.moe_d_ff`.

  Logical axes: router ("embed", None); w_gate, w_up ("expert", "embed", "mlp"); w_down ("expert", "mlp", "embed").
  With the LoRA target "experts", each stack has an `ExpertAdapter` `<stack>_lora` beside it.
  """

  def __init__(self, cfg, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
    d, e, f, dt = cfg.d_model, cfg.num_experts, cfg.moe_d_ff, cfg.weight_dtype
    self.cfg = cfg
    self.router = sharded_param(rngs, fan_in_normal(d), (d, e), ("embed", None), dt)
    self.w_gate = sharded_param(rngs, fan_in_normal(d), (e, d, f), ("expert", "embed", "mlp"), dt)
    self.w_up = sharded_param(rngs, fan_in_normal(d), (e, d, f), ("expert", "embed", "mlp"), dt)
    out_scale = (2 * cfg.num_layers) ** -0.5
    self.w_down = sharded_param(rngs, fan_in_normal(f, out_scale), (e, f, d), ("expert", "mlp", "embed"), dt)
    if lora is not None and lora.adapts("experts"):
      for name in STACKS:
        setattr(self, name + SUFFIX, ExpertAdapter(getattr(self, name), lora, rngs))

  def __call__(self, x_BxTxD, replay_BxTxK=None, live_BxT=None):
    """(y_BxTxD, Routing of the B*T tokens, row-major); `replay_BxTxK` forces each token's experts. Tokens where
    `live_BxT` is False (a decode step's finished or free slots, whose tokens are discarded) go to no expert and get
    y = 0, so a step reads only the experts its live rows chose; their routing is returned as the router chose."""
    dt = self.cfg.compute_dtype
    b, t, d = x_BxTxD.shape
    logits_NxE = linear(x_BxTxD.reshape(b * t, d), self.router[...].astype(dt), preferred_element_type=jnp.float32)
    replay = None if replay_BxTxK is None else replay_BxTxK.reshape(b * t, -1)
    routing = route(logits_NxE, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob, replay)
    computed = routing
    if live_BxT is not None:
      computed = routing._replace(experts_NxK=jnp.where(live_BxT.reshape(-1, 1), routing.experts_NxK, -1))
    adapted = hasattr(self, STACKS[0] + SUFFIX)
    adapters = tuple(getattr(self, name + SUFFIX).factors(dt) for name in STACKS) if adapted else ()
    y = sharded_swiglu(x_BxTxD, computed, *(getattr(self, name)[...].astype(dt) for name in STACKS),
                       chunk=self.cfg.moe_chunk, adapters=adapters)
    return y, routing
