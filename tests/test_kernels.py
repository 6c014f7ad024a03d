"""The kernels a compiled XLA:CPU program launches, read from its text, and the kernel-level time of a program on
this CPU, each against counts worked out by hand for small programs."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxrl_batch.predict import kernel_rates, kernels
from jaxrl_batch.predict.program_time import Rates, program_time

F32 = jnp.float32


def _text(fn, *shapes):
  return jax.jit(fn).lower(*[jax.ShapeDtypeStruct(s, F32) for s in shapes]).compile().as_text()


def test_a_batched_product_is_read_with_its_shape():
  # (3, 5, 7) x (3, 7, 11) contracted over 7, batched over 3: 3 products of (5, 7) x (7, 11).
  got = kernels.kernels(_text(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), (3, 5, 7), (3, 7, 11)))
  assert [d.shape for d in got.dots] == [(3, 5, 7, 11, "f32")]
  dot, = got.dots
  assert dot.flops == 2 * 3 * 5 * 7 * 11 and dot.bytes == 4 * 3 * (5 * 7 + 7 * 11 + 5 * 11) and dot.times == 1


def test_a_transposed_operand_keeps_the_contracted_size():
  # x (6, 4) contracted with w (9, 4) over its last axis: (6, 4) x (4, 9).
  got = kernels.kernels(_text(lambda x, w: x @ w.T, (6, 4), (9, 4)))
  assert [d.shape for d in got.dots] == [(1, 6, 4, 9, "f32")]


@pytest.mark.parametrize("fn, launched", [(lambda x: x * 2.0, 1), (lambda x: jnp.sum(x * 2.0), 1),
                                           (jnp.sort, 1)])
def test_a_reducer_or_comparator_runs_inside_its_kernel(fn, launched):
  assert kernels.kernels(_text(fn, (64, 128))).launches == launched


def test_a_loop_of_known_trips_runs_its_kernels_that_many_times():
  def looped(trips):
    return lambda a, b: lax.fori_loop(0, trips, lambda _, x: jnp.tanh(x @ b), a)

  once, many = (kernels.kernels(_text(looped(t), (8, 8), (8, 8))) for t in (2, 7))
  assert [d.times for d in once.dots] == [2] and [d.times for d in many.dots] == [7]
  # Only the body's kernels scale with the trips: 5 more trips add 5 x the body's launches.
  assert (many.launches - once.launches) % 5 == 0 and many.launches > once.launches


def test_a_loop_of_unknown_trips_runs_its_body_once():
  got = kernels.kernels(_text(lambda a, n: lax.fori_loop(0, n[0].astype(jnp.int32), lambda _, x: x @ x, a),
                              (8, 8), (1,)))
  assert [d.times for d in got.dots] == [1]


def test_a_transpose_is_counted_apart_from_streamed_bytes():
  n = 64
  transposed = kernels.kernels(_text(lambda x: x.T * 2.0, (n, 2 * n)))
  streamed = kernels.kernels(_text(lambda x: x * 2.0, (n, 2 * n)))
  size = 4 * n * 2 * n  # read once, written once
  assert (transposed.transposed_bytes, transposed.streamed_bytes) == (2 * size, 0)
  assert (streamed.transposed_bytes, streamed.streamed_bytes) == (0, 2 * size)
  assert transposed.dots == streamed.dots == ()


def test_a_program_on_this_cpu_is_timed_kernel_by_kernel(monkeypatch):
  monkeypatch.setattr(kernel_rates, "dot_seconds", lambda b, m, k, n, dtype: 1e-3 * b * m * k * n / (32 * 16 * 8))
  compiled = jax.jit(lambda a, b, c: (a @ b).T + c).lower(
      jax.ShapeDtypeStruct((32, 16), F32), jax.ShapeDtypeStruct((16, 8), F32),
      jax.ShapeDtypeStruct((8, 32), F32)).compile()
  run = kernels.kernels(compiled.as_text())
  rates = Rates.measured(dict(matmul_flops_per_s=1e9, bandwidth_bytes_per_s=1e8, launch_s=1e-6,
                              transpose_bytes_per_s=1e7))
  got = program_time(compiled, rates)
  assert rates.kernel_level and run.launches >= 2
  assert [d.shape for d in run.dots] == [(1, 8, 16, 32, "f32")]  # XLA computes (a b)^T as b^T a^T
  assert got.compute_s == pytest.approx(1e-3)  # the one product, at the rate of its own shape
  assert got.memory_s == pytest.approx(run.streamed_bytes / 1e8 + run.transposed_bytes / 1e7)
  assert run.streamed_bytes == 3 * 4 * 8 * 32  # the sum reads the product and c and writes 8 x 32 floats
  assert got.launch_s == pytest.approx(run.launches * 1e-6)
  assert got.seconds == pytest.approx(got.compute_s + got.memory_s + got.launch_s)


def test_this_cpus_kernel_rates_are_measured():
  launch = kernel_rates.launch_seconds()
  assert 0 <= launch < 1e-3
  small, large = kernel_rates.dot_seconds(1, 16, 128, 128, "f32"), kernel_rates.dot_seconds(1, 256, 256, 256, "f32")
  assert 0 < small < large  # 64x the flops take longer
  assert kernel_rates.transpose_bytes_per_s() > 0
