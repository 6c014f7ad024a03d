"""Device mesh and logical-axis sharding: parameters are created already sharded.

Mesh axes are `data`, `fsdp`, `expert` and `tensor`. Each parameter dimension carries a logical name (`embed`,
`mlp`, `expert`, ...); `rules` map logical names to mesh axes, e.g. `(("embed", "fsdp"), ("mlp", "tensor"))`.
The batch is split over `data`, `fsdp` and `expert` (outside the MoE layers the expert axis is data parallelism);
MoE experts are split over `expert` (`model.moe`).
"""
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")

# Logical axis -> mesh axis (or tuple of axes, or None for replicated).
DEFAULT_RULES = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("norm", None),
)


def mesh_sizes(text: str, sep: str = "x") -> dict[str, int]:
  """{data, fsdp, tensor, expert} of `text`, 3 or 4 integer sizes joined by `sep` ('1x-1x1', '1,-1,1,8'); expert
  defaults to 1."""
  sizes = text.split(sep)
  if len(sizes) not in (3, 4):
    raise ValueError(f"mesh {text!r}: write data{sep}fsdp{sep}tensor[{sep}expert], e.g. 1{sep}-1{sep}1 or "
                     f"1{sep}-1{sep}1{sep}8.")
  try:
    values = [int(n) for n in sizes] + [1] * (4 - len(sizes))
  except ValueError:
    raise ValueError(f"mesh {text!r}: each size must be an integer (-1 takes the remaining devices).") from None
  return dict(zip(("data", "fsdp", "tensor", "expert"), values))


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None,
              expert: int = 1) -> Mesh:
  """A (data, fsdp, expert, tensor) mesh over `devices` (default: all); one axis may be -1 to take the remaining
  devices."""
  devices = list(jax.devices() if devices is None else devices)
  shape = [data, fsdp, expert, tensor]
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh (data, fsdp, expert, tensor) = {tuple(shape)}: each size must be positive, and at most "
                     "one may be -1 (fill with the remaining devices).")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if len(devices) % known:
      raise ValueError(f"Cannot fill mesh {tuple(shape)} with {len(devices)} devices: {len(devices)} is not a "
                       f"multiple of {known}.")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh (data, fsdp, expert, tensor) = {tuple(shape)} needs {math.prod(shape)} devices but "
                     f"{len(devices)} are available; set config.mesh so the product equals the device count "
                     "(or use -1 for one axis).")
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def dividing_axes(mesh, axes, size: int) -> tuple[str, ...]:
  """The prefix-greedy subset of `axes` (those in the mesh with size > 1) whose product divides `size`."""
  kept, prod = [], 1
  for a in axes:
    if a in mesh.shape and mesh.shape[a] > 1 and size % (prod * mesh.shape[a]) == 0:
      kept.append(a)
      prod *= mesh.shape[a]
  return tuple(kept)


def constrain_rows(x):
  """`x` with its leading (batch or token) dimension laid out over the batch axes of the ambient mesh that divide it,
  its other dimensions left to the partitioner. Activations stay split like the batch, so that a matmul with
  fsdp-sharded weights gathers the weights rather than every device's rows (the GPU compiler chose the rows: a
  micro-batch's whole MLP activations on every device). A no-op without a mesh or where no batch axis divides."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  axes = dividing_axes(mesh, BATCH_AXES, x.shape[0])
  if not axes:
    return x
  return jax.lax.with_sharding_constraint(x, P(axes, *([P.UNCONSTRAINED] * (x.ndim - 1))))


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], rules, mesh: Mesh) -> P:
  """PartitionSpec for one array. A mesh axis is dropped where it does not divide the dimension or is taken."""
  table = dict(rules)
  used, spec = set(), []
  for name, dim in zip(names, shape, strict=True):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"No sharding rule for logical axis {name!r}; add it to config.sharding_rules "
                       f"(known: {sorted(table)}).")
    target = table[name]
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    kept = []
    for axis in axes:
      size = mesh.shape[axis]
      if axis not in used and dim % (size * math.prod(mesh.shape[a] for a in kept)) == 0:
        kept.append(axis)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*spec)


def _variable_sharding(variable: nnx.Variable, mesh: Mesh, rules) -> NamedSharding:
  names = variable.get_metadata().get("out_sharding")
  shape = variable.get_value().shape
  if names is None:
    return NamedSharding(mesh, P())
  return NamedSharding(mesh, logical_to_spec(names, shape, rules, mesh))


def abstract_sharded(module_fn, mesh: Mesh, rules):
  """(graphdef, params) where params are `jax.ShapeDtypeStruct`s carrying each parameter's NamedSharding.

  Nothing is allocated: use it as the target of a checkpoint restore or of `create_sharded`.
  """
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(module_fn)
  graphdef, state = nnx.split(abstract)
  specs = jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                     sharding=_variable_sharding(v, mesh, rules)),
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return graphdef, nnx.to_pure_dict(specs)


def create_sharded(module_fn, mesh: Mesh, rules, select=None):
  """Builds `module_fn()` (an nnx.Module factory) with every parameter created directly in its sharding.

  Returns (graphdef, params): params is a plain nested dict of arrays, usable with `nnx.merge(graphdef, params)`.
  `select` (a function of such a dict returning part of it): only that part is created (the rest is never
  allocated), e.g. a model's adapters for base weights loaded elsewhere.
  """
  select = select or (lambda tree: tree)
  graphdef, abstract = abstract_sharded(module_fn, mesh, rules)
  abstract = select(abstract)

  def init():
    with nnx.use_eager_sharding(False):
      return select(nnx.to_pure_dict(nnx.state(module_fn())))

  with jax.set_mesh(mesh):
    params = jax.jit(init, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))()
  return graphdef, params


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading (batch) dimension split over data, fsdp and expert; the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways the batch is split: every batch size must be a multiple of this."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array (scalars, index vectors)."""
  return NamedSharding(mesh, P())
