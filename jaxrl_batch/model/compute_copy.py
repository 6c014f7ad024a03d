"""The policy as its forward reads it: every weight in the compute dtype, cast once instead of at every use.

The layers cast each weight to `ModelConfig.compute_dtype` before using it (`w[...].astype(dt)`), so with float32
master weights under bfloat16 compute (the MoE recipe) a decode step reads 4 bytes a parameter to use 2. The decode
engines and the frozen reference policy take `compute_copy(params, dtype)` instead: the forward computes the same
values (casting a weight already in the compute dtype is the identity), reads half the bytes, and the copy takes
half the master weights' memory. RMSNorm scales are kept as they are: the norm reads them in float32.
"""
import jax
import jax.numpy as jnp

# Parameter names the model reads in float32 whatever the compute dtype: RMSNorm's scales (`layers.RMSNorm`).
READ_IN_FLOAT32 = frozenset({"scale"})


def is_cast(path, x, dtype) -> bool:
  """Whether the leaf `x` at tree path `path` is cast to the compute dtype `dtype` (x: an array or a struct)."""
  name = getattr(path[-1], "key", None) if path else None
  return name not in READ_IN_FLOAT32 and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.dtype(dtype)


def compute_copy(params, dtype, copy: bool = False):
  """`params` with every weight the model casts to `dtype` cast once (placed as before); the other leaves are the
  same arrays, or with copy=True copies (a policy that must outlive the next update's donation of `params`). A tree
  of ShapeDtypeStructs gives the structs of the copy (shardings kept; the other leaves the same): the compile-only
  check's."""
  def leaf(path, x):
    if is_cast(path, x, dtype):
      abstract = isinstance(x, jax.ShapeDtypeStruct)
      return jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=x.sharding) if abstract else x.astype(dtype)
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    return jnp.copy(x) if copy else x
  return jax.tree_util.tree_map_with_path(leaf, params)
