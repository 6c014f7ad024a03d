"""The kernels a compiled XLA:CPU program launches, read from its text, and the kernel-level time of a program on
this CPU, each against counts worked out by hand for small programs; the decode check's launcher."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxrl_batch.predict import kernel_rates, kernels
from jaxrl_batch.predict.program_time import Rates, program_time

F32 = jnp.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_a_row_looked_up_in_a_table_reads_the_row_not_the_table():
  table, rows = jax.ShapeDtypeStruct((4096, 64), F32), jax.ShapeDtypeStruct((2,), jnp.int32)
  text = jax.jit(lambda t, i: jnp.take(t, i, axis=0) * 2.0).lower(table, rows).compile().as_text()
  got = kernels.kernels(text)
  assert 0 < got.streamed_bytes + got.transposed_bytes <= 8 * 2 * 64 * 4  # the 2 rows, read and written, and more
  assert got.streamed_bytes + got.transposed_bytes < 4096 * 64 * 4 / 100  # not the table's 1 MiB


def test_a_program_on_this_cpu_is_timed_kernel_by_kernel(monkeypatch):
  monkeypatch.setattr(kernel_rates, "dot_seconds", lambda b, m, k, n, dtype: 1e-3 * b * m * k * n / (32 * 16 * 8))
  compiled = jax.jit(lambda a, b, c: (a @ b).T + c).lower(
      jax.ShapeDtypeStruct((32, 16), F32), jax.ShapeDtypeStruct((16, 8), F32),
      jax.ShapeDtypeStruct((8, 32), F32)).compile()
  run = kernels.kernels(compiled.as_text())
  rates = Rates.measured(dict(matmul_flops_per_s=1e9, bandwidth_bytes_per_s=1e8, launch_s=1e-6,
                              transpose_bytes_per_s=1e7, fresh_bytes_per_s=1e6))
  got = program_time(compiled, rates)
  assert rates.kernel_level and run.launches >= 2
  assert [d.shape for d in run.dots] == [(1, 8, 16, 32, "f32")]  # XLA computes (a b)^T as b^T a^T
  assert got.compute_s == pytest.approx(1e-3)  # the one product, at the rate of its own shape
  assert got.memory_s == pytest.approx(run.streamed_bytes / 1e8 + run.transposed_bytes / 1e7)
  assert run.streamed_bytes == 3 * 4 * 8 * 32  # the sum reads the product and c and writes 8 x 32 floats
  assert got.launch_s == pytest.approx(run.launches * 1e-6)
  assert got.seconds == pytest.approx(got.compute_s + got.memory_s + got.launch_s)


def test_a_programs_temporaries_are_faulted_in_once_an_execution():
  compiled = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b.T).lower(
      jax.ShapeDtypeStruct((256, 128), F32), jax.ShapeDtypeStruct((128, 512), F32)).compile()
  temps = compiled.memory_analysis().temp_size_in_bytes
  assert temps >= 256 * 512 * 4  # tanh(a b) lives between the two products
  rates = Rates.measured(dict(matmul_flops_per_s=1e9, bandwidth_bytes_per_s=1e8, launch_s=1e-6,
                              transpose_bytes_per_s=1e7, fresh_bytes_per_s=1e6))
  got = program_time(compiled, rates)
  assert got.setup_s == temps / 1e6
  assert got.running(2, 5) == pytest.approx(2 * got.setup_s + 5 * got.seconds)  # once an execution, not a trip
  assert program_time(compiled, Rates.measured(dict(matmul_flops_per_s=1e9, bandwidth_bytes_per_s=1e8))).setup_s == 0


def test_this_cpus_kernel_rates_are_measured():
  launch = kernel_rates.launch_seconds()
  assert 0 <= launch < 1e-3
  small, large = kernel_rates.dot_seconds(1, 16, 128, 128, "f32"), kernel_rates.dot_seconds(1, 256, 256, 256, "f32")
  assert 0 < small < large  # 64x the flops take longer
  assert kernel_rates.fresh_bytes_per_s(16 << 20) > 0
  assert kernel_rates.transpose_bytes_per_s() > 0


@pytest.mark.slow
def test_the_decode_check_predicts_and_measures_each_concurrency(tmp_path):
  """`launch.decode_roofline --topology=cpu`: the decode step of each concurrency compiled for this CPU, its
  kernel-level prediction beside its measured time (both positive; their ratio is the check, not asserted)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-m", "launch.decode_roofline", "--config=configs/grpo_gsm8k_qwen.py:"
                         "model=tiny_random", "--config.model.num_layers=1", "--topology=cpu", "--concurrency=1,4",
                         "--prompt_tokens=8", "--response_tokens=8", "--repeats=2", f"--out={tmp_path}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads((tmp_path / "decode_roofline.json").read_text())
  assert got["topology"] == "cpu" and got["rates"]["launch_s"] > 0
  assert [p["concurrency"] for p in got["points"]] == [1, 4]
  for p in got["points"]:
    assert p["predicted_s"] > 0 and p["measured_s"] > 0 and p["ratio"] == p["predicted_s"] / p["measured_s"]
    assert p["predicted_s"] == pytest.approx(p["setup_s"] + p["products_s"] + p["bytes_s"] + p["launches_s"])
  assert "pred/meas" in proc.stdout
