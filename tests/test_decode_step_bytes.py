"""The decode step's bytes on a TPU slice (issue 36): the token choice over a vocabulary split over `tensor` stays
split (`strategies.choose`), and `aot.decode_roofline.hbm_bytes` counts an operand a fusion only slices as the
slices read, so the per-row cache write's loop and the embedding lookup count the rows they touch, not the whole
layer or table; and a mixture of experts' grouped matmuls (XLA's TPU ragged dot) at the experts the step's tokens
choose, where the compiled kernels say they read only the groups with rows."""
import base64
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_batch.model import KVCache
from jaxrl_batch.model import moe
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling import Strategy
from jaxrl_batch.sampling.strategies import choose
from jaxrl_batch.aot import decode_roofline
from tests.close import assert_close

_SLICING_HLO = """HloModule m

%slice_select (p0: f32[1,4], p1: f32[1024,4], p2: s32[], p3: pred[]) -> f32[1,4] {
  %p0 = f32[1,4]{1,0} parameter(0)
  %p1 = f32[1024,4]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %p3 = pred[] parameter(3)
  %z = s32[] constant(0)
  %ds = f32[1,4]{1,0} dynamic-slice(%p1, %p2, %z), dynamic_slice_sizes={1,4}
  %m = pred[1,4]{1,0} broadcast(%p3), dimensions={}
  ROOT %s = f32[1,4]{1,0} select(%m, %p0, %ds)
}

%lookup (q0: f32[1024,4], q1: s32[2]) -> f32[2,4] {
  %q0 = f32[1024,4]{1,0} parameter(0)
  %q1 = s32[2]{0} parameter(1)
  ROOT %g = f32[2,4]{1,0} gather(%q0, %q1), slice_sizes={1,4}
}

%whole (r0: f32[1024,4], r1: s32[]) -> f32[1024,4] {
  %r0 = f32[1024,4]{1,0} parameter(0)
  %r1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,4]{1,0} dynamic-slice(%r0, %r1, %z), dynamic_slice_sizes={1,4}
  %e = f32[1024,4]{1,0} exponential(%r0)
  ROOT %u = f32[1024,4]{1,0} dynamic-update-slice(%e, %ds, %r1, %z)
}

ENTRY %main (a: f32[1024,4], b: f32[1,4], i: s32[], j: s32[2], c: pred[]) -> f32[1,4] {
  %a = f32[1024,4]{1,0} parameter(0)
  %b = f32[1,4]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %j = s32[2]{0} parameter(3)
  %c = pred[] parameter(4)
  %f = f32[1,4]{1,0} fusion(%b, %a, %i, %c), kind=kLoop, calls=%slice_select
  %g = f32[2,4]{1,0} fusion(%a, %j), kind=kLoop, calls=%lookup
  %h = f32[1024,4]{1,0} fusion(%a, %i), kind=kLoop, calls=%whole
}
"""


def test_hbm_bytes_counts_what_a_fusion_slices_of_an_operand():
  # %f reads b (16), one row of a (16), i (4), c (1) and writes 16; %g reads two rows of a (32) and j (8), writes 32;
  # %h reads a whole (an exponential of it, besides its slice) and i, and writes a whole.
  assert decode_roofline.hbm_bytes(_SLICING_HLO) == (16 + 16 + 4 + 1 + 16) + (32 + 8 + 32) + (16384 + 4 + 16384)


def test_compiled_per_row_cache_write_counts_the_rows_written(compile_only_tpu):
  topology = compile_only_tpu("v5p:2x2x1")
  mesh = jax.sharding.Mesh(topology.devices[:1], ("x",))
  one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rows, heads, width, slots = 64, 1, 128, 4096
  struct = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
  cache = KVCache((struct((rows, heads, width, slots)),), (struct((rows, heads, slots, width)),))

  def write(cache, k_Bx1xKxH, v_Bx1xKxH, slot_B):
    return cache.write(0, slot_B, k_Bx1xKxH, v_Bx1xKxH)

  new = struct((rows, 1, heads, width))
  compiled = jax.jit(write, donate_argnums=0).lower(cache, new, new, struct((rows,), jnp.int32)).compile()
  layer = rows * heads * width * slots * 2
  # The engine's write (a loop over rows, each slicing its old key/value to keep it where its slot is out of range)
  # touches a few bytes per row; counted whole, each loop body's slice read the layer.
  assert decode_roofline.hbm_bytes(compiled.as_text()) < 0.01 * layer


def _sharded_choice(mesh, rows: int, vocab: int, sampling: Strategy, choice):
  """`choice` of `rows` tokens from float32 logits with the vocabulary over `tensor`, compiled for `mesh`."""
  logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=NamedSharding(mesh, P(None, "tensor")))
  keys = jax.ShapeDtypeStruct((rows,), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                              sharding=NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    return jax.jit(lambda l, k: choice(l, k, sampling)).lower(logits, keys).compile()


def test_token_choice_over_a_split_vocabulary_stays_split(compile_only_tpu):
  topology = compile_only_tpu("v5p:2x2x1")
  mesh = sharding.make_mesh(1, 1, 4, devices=topology.devices)
  rows, vocab = 64, 151_936  # qwen2.5-1.5b's vocabulary: 37,984 tokens a chip, not whole chunks of 128
  logits_per_chip = rows * vocab * 4 // 4
  for sampling in (Strategy(), Strategy(temperature=0.0)):
    compiled = _sharded_choice(mesh, rows, vocab, sampling, choose)
    # Gathered onto each chip, the probabilities were read and written many times over (43x the logits sampling).
    assert decode_roofline.hbm_bytes(compiled.as_text()) < 8 * logits_per_chip, sampling


def test_padded_choice_gives_the_tokens_and_log_probs_of_the_unpadded_one():
  mesh = sharding.make_mesh(2, 1, 4)
  logits_BxV = jax.random.normal(jax.random.key(0), (16, 300)) * 3  # 300 tokens: padded to 512 on tensor = 4
  keys_B = jax.random.split(jax.random.key(1), 16)
  for sampling in (Strategy(), Strategy(temperature=0.7, top_k=20), Strategy(top_p=0.9), Strategy(temperature=0.0)):
    token_B, logp_B = choose(logits_BxV, keys_B, sampling)
    with jax.set_mesh(mesh):
      padded = jax.jit(choose, static_argnums=2)(
          jax.device_put(logits_BxV, NamedSharding(mesh, P(None, "tensor"))), keys_B, sampling)
    np.testing.assert_array_equal(np.asarray(padded[0]), np.asarray(token_B))
    assert_close(np.asarray(padded[1]), np.asarray(logp_B), 5e-6)


def _grouped_step(compile_only_tpu, experts: int = 16, d: int = 2048, f: int = 768, tokens: int = 8, k: int = 2):
  """The optimized HLO of `moe.grouped_swiglu` (three ragged dots) for one v5p chip, and its weights' bytes (50 MB a
  stack: read by the kernels from HBM; the compiler copies small ones whole into on-chip memory first)."""
  topology = compile_only_tpu("v5p:2x2x1")
  one = NamedSharding(jax.sharding.Mesh(topology.devices[:1], ("x",)), P())
  struct = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
  args = (struct((tokens, d)), struct((tokens, k), jnp.int32), struct((tokens, k), jnp.float32),
          struct((experts, d, f)), struct((experts, d, f)), struct((experts, f, d)))
  text = jax.jit(moe.grouped_swiglu).lower(*args).compile().as_text()
  return text, 3 * experts * d * f * 2


def test_tpu_grouped_matmuls_read_only_groups_with_rows(compile_only_tpu):
  text, weights = _grouped_step(compile_only_tpu)
  # The compiled kernels: the metadata gives an empty group no tiles, the matmul's grid runs over those tiles.
  assert decode_roofline.grouped_kernels_skip_empty_groups(text)
  whole, quarter = decode_roofline.hbm_bytes(text), decode_roofline.hbm_bytes(text, groups_read=0.25)
  assert whole > weights
  assert_close(whole - quarter, 0.75 * weights, 1e-6)
  # Kernels that would visit every group: a grid of fixed bound, or metadata giving empty groups tiles. Their
  # weights count whole whatever is asked.
  for old, new in (("-9223372036854775808", "16"), ("arith.cmpi eq", "arith.cmpi ne")):
    visiting = _edit_kernels(text, old, new)
    assert visiting != text
    assert not decode_roofline.grouped_kernels_skip_empty_groups(visiting)
    assert decode_roofline.hbm_bytes(visiting, groups_read=0.25) == whole


def _edit_kernels(text: str, old: str, new: str) -> str:
  """`text` with `old` replaced by `new` in the Mosaic code (base64) of its kernels."""
  def edit(match):
    body = base64.b64decode(match.group(1)).decode().replace(old, new)
    return '"body":"' + base64.b64encode(body.encode()).decode() + '"'
  return re.sub(r'"body":"([^"]+)"', edit, text)
