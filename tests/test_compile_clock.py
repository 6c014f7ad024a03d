"""The compile clock counts the seconds JAX spends making executables, in any thread, and nothing else."""
import threading

import jax
import jax.numpy as jnp

from jaxrl_batch.runtime import compile_clock


def test_compiling_counts_and_running_a_compiled_program_does_not():
  fn = jax.jit(lambda x: jnp.tanh(x) @ x.T)
  x = jnp.ones((8, 13))
  before = compile_clock.seconds()
  fn(x).block_until_ready()
  compiled = compile_clock.seconds()
  assert compiled > before
  for _ in range(3):
    fn(x).block_until_ready()
  assert compile_clock.seconds() == compiled
  fn(jnp.ones((8, 14))).block_until_ready()  # a new shape compiles again
  assert compile_clock.seconds() > compiled


def test_a_compile_in_another_thread_counts():
  before = compile_clock.seconds()
  thread = threading.Thread(target=lambda: jax.jit(lambda x: x * 3 + 1)(jnp.ones((5, 17))).block_until_ready())
  thread.start()
  thread.join()
  assert compile_clock.seconds() > before
