"""A compiled program's roofline: the collectives read from HLO text (each replica-group form, async pairs counted
once, loop bodies marked), their ring costs, and the seconds at a chip's rates, on hand-written HLO, XLA:CPU
programs and (where libtpu loads) compile-only TPU programs."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_batch.predict.program_time import Collective, Rates, collectives, program_time
from jaxrl_batch.runtime import topologies

# One f32[256] is 1 KiB. The module's 8 chips; a fusion called from the loop body holds an all-reduce. The mesh form
# over two axes is written as libtpu prints one (`mesh['axis_0'=2,...] {'axis_0'}`), with the axes listed.
HLO = """HloModule m, replica_count=1, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  ROOT %ar.loop = f32[256]{0:T(256)} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
}

%body (t: (s32[], f32[256])) -> (s32[], f32[256]) {
  %t = (s32[], f32[256]) parameter(0)
  %v = f32[256]{0} get-tuple-element(%t), index=1
  %f = f32[256]{0} fusion(%v), kind=kLoop, calls=%inner
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %out = (s32[], f32[256]) tuple(%i, %f)
}

%cond (t: (s32[], f32[256])) -> pred[] {
  %t = (s32[], f32[256]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[256], b: bf16[64,8]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %b = bf16[64,8]{1,0} parameter(1)
  %ar = (f32[256]{0}, bf16[64,8]{1,0:T(8,128)(2,1)}) all-reduce(%a, %b), replica_groups=[4,2]<=[8], to_apply=%add
  %ags = (f32[32]{0:S(1)}, f32[256]{0}) all-gather-start(%a), replica_groups=mesh['x'=2,'y'=4] {'x','y'}, dimensions={0}
  %agd = f32[256]{0} all-gather-done(%ags)
  %rs = f32[32]{0} reduce-scatter(%a), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %ars = f32[256]{0} all-reduce-start(%a), replica_groups={}, to_apply=%add
  %ard = f32[256]{0} all-reduce-done(%ars)
  %cps = (f32[256]{0}, f32[256]{0}, u32[]{:S(2)}, u32[]) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[256]{0} collective-permute-done(%cps)
  %a2a = f32[256]{0} all-to-all(%a), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %a2m = f32[256]{0} all-to-all(%a), replica_groups=mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'x'}, dimensions={0}
  %w = (s32[], f32[256]) while(%t0), condition=%cond, body=%body
  ROOT %r = f32[256]{0} add(%agd, %ard)
}
"""


def test_collectives_of_hand_written_hlo_with_each_group_form_and_ring_cost():
  kib = 1024
  expected = [
      Collective("all-reduce", kib, 4, 2 * 3 / 4 * kib, True),  # in %inner, a fusion of the loop body
      Collective("all-reduce", 2 * kib, 2, 2 * 1 / 2 * 2 * kib, False),  # f32[256] + bf16[64,8], groups of 2
      Collective("all-gather", kib, 8, 7 / 8 * kib, False),  # the start's result, not its f32[32] operand
      Collective("reduce-scatter", 8 * 128, 8, 7 / 8 * 8 * 128, False),  # operand: 8 x the f32[32] result
      Collective("all-reduce", kib, 8, 2 * 7 / 8 * kib, False),  # {}: all 8 partitions
      Collective("collective-permute", kib, 2, kib, False),  # u32[] contexts and the operand left out
      Collective("all-to-all", kib, 4, 3 / 4 * kib, False),
      Collective("all-to-all", kib, 2, 1 / 2 * kib, False),  # the mesh form with device_ids
  ]
  assert collectives(HLO) == expected


def test_an_unknown_replica_group_form_is_an_error_not_a_guess():
  with pytest.raises(ValueError, match="replica_groups"):
    collectives(HLO.replace("replica_groups=[4,2]<=[8]", "replica_groups=somewhere(new)"))


def test_rates_from_a_chip_send_at_half_its_bidirectional_interconnect():
  rates = Rates.from_chip(topologies.CHIPS["v5p"])
  assert (rates.matmul_flops_per_s, rates.memory_bytes_per_s, rates.interconnect_bytes_per_s) == (459e12, 2765e9,
                                                                                                   600e9)
  for chip in (*topologies.CHIPS.values(), *topologies.GPUS.values()):
    assert chip.interconnect_bytes_per_s > 0, chip.name


def test_a_cpu_matmul_is_timed_from_the_compilers_cost_at_measured_rates():
  n = 64
  compiled = jax.jit(lambda a, b: a @ b).lower(*[jax.ShapeDtypeStruct((n, n), jnp.float32)] * 2).compile()
  rates = Rates.measured(dict(matmul_flops_per_s=1e9, bandwidth_bytes_per_s=1e8), "cpu")
  got = program_time(compiled, rates)
  assert got.flops == 2 * n**3 and got.bytes_accessed >= 3 * n * n * 4
  assert got.compute_s == got.flops / 1e9 and got.memory_s == got.bytes_accessed / 1e8
  assert got.collectives == () and got.collective_s == 0.0
  assert got.seconds == max(got.compute_s, got.memory_s)
  assert got.peak_bytes == 3 * n * n * 4  # two float32 arguments and the result, no temporaries


def test_a_program_that_sends_needs_an_interconnect_rate():
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  x = jax.ShapeDtypeStruct((4, 256), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  compiled = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P())).lower(x).compile()
  assert [c.op for c in collectives(compiled.as_text())] == ["all-reduce"]
  with pytest.raises(ValueError, match="no interconnect rate"):
    program_time(compiled, Rates.measured(dict(matmul_flops_per_s=1e9, bandwidth_bytes_per_s=1e8)))


def test_a_compiled_tpu_program_collectives_bytes_and_seconds(compile_only_tpu):
  topo = compile_only_tpu("v5p:2x2x1")
  mesh = Mesh(np.array(topo.devices).reshape(2, 2), ("a", "b"))
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"), check_vma=False)
  def f(x_32x128):  # 16 KiB per chip
    looped = jax.lax.fori_loop(0, x_32x128[0, 0].astype(jnp.int32), lambda _, c: jax.lax.psum(c, "b"), x_32x128)
    gathered = jax.lax.all_gather(x_32x128, "a", tiled=True)  # 32 KiB
    return looped + gathered[:32] + jax.lax.ppermute(x_32x128, "a", [(0, 1), (1, 0)])

  compiled = jax.jit(f).lower(x).compile()
  kib = 1024
  found = sorted(collectives(compiled.as_text()), key=lambda c: c.op)
  assert found == [Collective("all-gather", 32 * kib, 2, 16 * kib, False),
                   Collective("all-reduce", 16 * kib, 2, 16 * kib, True),
                   Collective("collective-permute", 16 * kib, 2, 16 * kib, False)]
  got = program_time(compiled, Rates.from_chip(topo.chip))
  assert got.collective_bytes == 48 * kib and got.collective_s == 48 * kib / 600e9
  assert got.collectives_in_loops == 1 and got.optimal_seconds > 0
  assert got.seconds == max(got.flops / 459e12, got.bytes_accessed / 2765e9) + got.collective_s
