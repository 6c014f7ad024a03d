"""This machine's cost of launching a kernel and its matrix-product rate at a given shape, measured.

Why: `kernels` says how many kernels a program launches and which products it runs; what they cost here is
measured, each the best of several runs inside one compiled loop (a Python call per run would time the dispatch,
not the kernel):
- launch_s: the seconds one more kernel adds. A loop of `depth` steps, each an elementwise kernel fenced by
  `optimization_barrier` so that nothing fuses, is timed at two depths; the slope per kernel `kernels` counts in
  the two programs is the launch cost (it includes the loop's own step, shared evenly).
- transpose_bytes_per_s: what a kernel that changes an array's layout reads and writes per second.
- dot seconds at a shape: a loop of `reps` products of that shape, on operands taken in turn from a pool larger
  than the caches, each feeding the next one's operand through a scalar (so none is hoisted or merged), minus the
  same loop without the product.
- fresh_bytes_per_s: the rate at which the cores, all at once, touch memory fresh from the system for the first time
  (4 KiB pages faulted in). XLA:CPU allocates a program's temporaries anew for each execution and the system maps
  them page by page as its kernels first write them: 2.5 GB/s on this machine's 2 cores, so a program of 189 MB of
  temporaries pays ~75 ms an execution before any kernel's own cost.
"""
import functools
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_batch.predict import kernels

_POOL_BYTES = 32 << 20  # Operands of the product loop: more than the caches hold.
_DTYPES = dict(f32=jnp.float32, bf16=jnp.bfloat16, f16=jnp.float16, f64=jnp.float64, s32=jnp.int32, s8=jnp.int8)


def _best(fn, *args, repeats: int = 7) -> float:
  """Best wall seconds of `fn(*args)` over `repeats` runs, after one untimed run (it compiles)."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def _chain(depth: int):
  """A jitted loop of 64 steps, each `depth` elementwise kernels that cannot fuse (a barrier between each)."""
  def body(_, x):
    for _ in range(depth):
      x = x * 1.0001 + jnp.sum(x) * 1e-6  # a reduction then its use: two kernels XLA cannot fuse
    return x
  return jax.jit(lambda x: lax.fori_loop(0, 64, body, x))


def launch_seconds() -> float:
  """Seconds one kernel launch costs on the default device (module docstring)."""
  x = jnp.ones((8,), jnp.float32)
  shallow, deep = _chain(4), _chain(36)
  count = lambda fn: kernels.kernels(fn.lower(x).compile().as_text()).launches
  extra = count(deep) - count(shallow)
  if extra <= 0:
    raise ValueError(f"The launch probe added {extra} kernels: XLA fused the fenced chain.")
  return max(_best(deep, x) - _best(shallow, x), 0.0) / extra


@functools.cache
def dot_seconds(batch: int, m: int, k: int, n: int, dtype: str, reps: int = 0) -> float:
  """Seconds of one (batch, m, k) x (batch, k, n) product in HLO dtype `dtype` on the default device (module
  docstring), its operands read from memory, not from a cache (as a program's weights and activations are: each
  product of the loop takes the next of a pool of operands larger than the caches, 32 MiB or 64 pairs); `reps`
  products per loop (0: enough for ~1e9 flops, between 4 and 256)."""
  reps = reps or int(min(max(1e9 / (2.0 * batch * m * k * n), 4), 256))
  dt = _DTYPES.get(dtype, jnp.float32)
  pool = int(min(max(_POOL_BYTES / (jnp.dtype(dt).itemsize * batch * min(m * k, k * n)), 1), 64))
  a, b = jnp.ones((pool, batch, m, k), dt), jnp.ones((pool, batch, k, n), dt)
  dims = (((2,), (1,)), ((0,), (0,)))

  def loop(with_dot: bool):
    def body(i, s):
      x, y = a[i % pool] * s.astype(dt), b[i % pool]  # the scalar makes each product depend on the last
      return (lax.dot_general(x, y, dims) if with_dot else x)[0, 0, 0].astype(jnp.float32) * 0 + s
    return jax.jit(lambda s: lax.fori_loop(0, reps, body, s))

  s = jnp.float32(1.0)
  return max(_best(loop(True), s) - _best(loop(False), s), 0.0) / reps


def transpose_bytes_per_s(dtype=jnp.float32, side: int = 512) -> float:
  """Bytes read + written per second by a kernel that transposes a `side` x `side` matrix (1 MiB of float32 by
  default: strided reads run far below a stream's bandwidth), in a loop of 16 (each feeding the next)."""
  x = jnp.ones((side, side), dtype)
  loop = lambda reps: jax.jit(lambda x: lax.fori_loop(0, reps, lambda _, y: y.T * 1.0001, x))
  seconds = (_best(loop(17), x) - _best(loop(1), x)) / 16
  return 2.0 * x.nbytes / max(seconds, 1e-12)


def fresh_bytes_per_s(size: int = 256 << 20, page: int = 4096) -> float:
  """Bytes per second at which this machine's cores together fault in fresh memory (module docstring): `size` bytes
  of a new anonymous mapping, one write per `page`, split over os.cpu_count() threads; the best of 3."""
  threads = os.cpu_count() or 1
  parts = np.array_split(np.arange(0, size, page), threads)

  def touch(memory, pages):
    memory[pages[0]:pages[-1] + 1:page] = 1

  def once() -> float:
    mapped = mmap.mmap(-1, size)
    memory = np.frombuffer(mapped, np.uint8)
    with ThreadPoolExecutor(threads) as pool:
      start = time.perf_counter()
      list(pool.map(functools.partial(touch, memory), parts))
      seconds = time.perf_counter() - start
    del memory  # the view goes before its mapping closes
    mapped.close()
    return seconds

  return size / min(once() for _ in range(3))
