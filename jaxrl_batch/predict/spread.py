"""How far above its best execution a run's decode step sits on this CPU, measured on the member's own step.

Why: the CPU's kernel-level rates (`kernel_rates`) are each a best, so `program_time` predicts a program's best
execution. At the sizes of the CPU's 1M-parameter family a run does not live there. Every decode chunk program of a
run of `configs/grpo_reasoning.py`, timed in place, had its median 1.3-1.9x its best; the step run alone on zeros,
one call after another, 1.3-1.5x (its mean). At the ~100M reference shape the run's step was its best within ~10%
(docs/results/2026-12-07-cpu-validation.md). That spread belongs to this shared machine and the step's small
kernels, not to the program's work, and no rate says it. So a CPU prediction measures it on the member's own decode
step (every slot live, on zeros: a decode step's cost does not depend on the values) and takes the rollout's
programs that much above their best. A topology's published rates have none (1).
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_batch.aot import decode_roofline


def zeros(tree):
  """Arrays of zeros (a random key where a key is asked for) of `tree`'s ShapeDtypeStructs, on their shardings."""
  def one(struct):
    if not hasattr(struct, "shape"):
      return struct
    if jnp.issubdtype(struct.dtype, jax.dtypes.prng_key):
      return jax.random.key(0)
    return jax.device_put(jnp.zeros(struct.shape, struct.dtype), struct.sharding)
  return jax.tree.map(one, tree)


# `decode_roofline.step` without donating its slots: the same program, run again and again on the same inputs.
_step = jax.jit(decode_roofline.step.__wrapped__, static_argnames=("graphdef", "p", "sampling", "backend"))


def on_zeros(step, inputs):
  """A call that runs the decode step of `decode_roofline.engine_step`'s (step, inputs) once, on zeros (on the mesh
  the engines decode on, `AbstractStep.engines`)."""
  state, call, step = zeros(inputs["state"]), inputs["call"], step.engines
  return functools.partial(_step, step.models.graphdef, zeros(step.sampler_params), state,
                           jnp.zeros(state.token_S.shape, jnp.int32), zeros(inputs["key"]),
                           p=inputs["prefix"].valid_QxP.shape[1], sampling=call.sampling,
                           backend=call.engine.attention_backend)


def executions(run, count: int, mesh) -> np.ndarray:
  """Wall seconds of `count` calls of `run` under `mesh`, one at a time (each to its result), after one untimed."""
  seconds = []
  with jax.set_mesh(mesh):
    jax.block_until_ready(run())
    for _ in range(count):
      start = time.perf_counter()
      jax.block_until_ready(run())
      seconds.append(time.perf_counter() - start)
  return np.asarray(seconds)


def rollout_spread(step, inputs, count: int = 100) -> float:
  """The mean of `count` executions of the decode step over their best (module docstring)."""
  seconds = executions(on_zeros(step, inputs), count, step.engines.exp.mesh)
  return float(seconds.mean() / seconds.min())
