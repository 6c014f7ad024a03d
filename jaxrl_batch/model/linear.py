"""Projections: x contracted with the leading axes of a weight stored (in..., out...)."""
import math

import jax

from jaxrl_batch.kernels.platform import current_platform

# Slabs of the contraction a one-row product is split into on CPU (see `linear`).
SPLIT_K = 4


def linear(x, w, contract: int = 1, preferred_element_type=None):
  """(..., *in) x (*in, *out) -> (..., *out): the last `contract` axes of x with the first `contract` axes of w.

  With one row traced for CPU (a concurrency-1 decode step; `kernels.platform`: not a TPU program compiled on a CPU
  host), the contraction is split into SPLIT_K contiguous slabs of w, multiplied as one batched product and summed:
  XLA runs the batch on both cores where its single matrix-vector product scales 1.5x from one core to two. The
  reference decode shape's 57 products took 11.2 instead of 14.4 ms
  (2-core Xeon); at 2 to 32 rows the split was 16-45% slower, so it is not used there.
  """
  batch_shape, in_shape, out_shape = x.shape[:-contract], w.shape[:contract], w.shape[contract:]
  assert x.shape[-contract:] == in_shape, (x.shape, w.shape, contract)
  k, rows = math.prod(in_shape), math.prod(batch_shape)
  if rows == 1 and k % SPLIT_K == 0 and current_platform() == "cpu":
    x_PxMxK = x.reshape(SPLIT_K, 1, k // SPLIT_K)
    w_PxKxN = w.reshape(SPLIT_K, k // SPLIT_K, -1)
    partial_PxMxN = jax.lax.dot_general(x_PxMxK, w_PxKxN, (((2,), (1,)), ((0,), (0,))),
                                        preferred_element_type=preferred_element_type)
    return partial_PxMxN.sum(axis=0).reshape(*batch_shape, *out_shape)
  return jax.lax.dot_general(x, w, ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ())),
                             preferred_element_type=preferred_element_type)
