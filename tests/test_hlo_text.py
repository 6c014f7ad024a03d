"""`runtime.hlo_text` against hand counts on small literal HLO snippets."""
from jaxrl_batch.runtime import hlo_text

_FUSED = """
  %p0 = f32[1024,4]{1,0} parameter(0)
  %p1 = f32[1024,4]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %row = f32[1,4]{1,0} dynamic-slice(%p0, %p2, %z), dynamic_slice_sizes={1,4}
  %rows = f32[2,4]{1,0} dynamic-slice(%p0, %p2, %z), dynamic_slice_sizes={2,4}
  %other = f32[1,4]{1,0} dynamic-slice(%p1, %p2, %z), dynamic_slice_sizes={1,4}
  %whole = f32[1024,4]{1,0} exponential(%p1)
  ROOT %out = f32[1,4]{1,0} add(%row, %other)
"""


def _instructions(text: str) -> list[tuple[str, str, str, str]]:
  return [m.groups() for line in text.splitlines() if (m := hlo_text.INSTRUCTION.match(line))]


def test_array_bytes_of_a_tuple_in_order_with_a_dynamic_dimension_at_its_bound():
  assert hlo_text.array_bytes("(f32[2,3]{1,0}, bf16[<=4,8])") == [2 * 3 * 4, 4 * 8 * 2]
  assert hlo_text.array_bytes("(s32[], pred[5]{0}, c64[2]{0:S(1)})") == [4, 5, 2 * 8]
  assert hlo_text.array_bytes("token[]") == []


def test_sub_byte_arrays_are_packed_and_rounded_up_to_a_whole_byte():
  assert hlo_text.array_bytes("(s4[8]{0:E(4)}, u4[3], s2[5])") == [4, 2, 2]
  assert hlo_text.elements_bytes("f4e2m1fn", 1) == 1 and hlo_text.elements_bytes("bf16", 3) == 6


def test_instruction_parts_and_operands():
  name, type_, op, rest = hlo_text.INSTRUCTION.match(
      "  ROOT %ds.2 = f32[1,4]{1,0} dynamic-slice(%p0, %i.1, %z), dynamic_slice_sizes={1,4}").groups()
  assert (name, type_, op) == ("ds.2", "f32[1,4]{1,0}", "dynamic-slice")
  assert hlo_text.operands(rest) == ["p0", "i.1", "z"]


def test_sliced_reads_counts_a_parameter_only_sliced_at_its_slices():
  # p0 is only dynamic-sliced (1 row and 2 rows of 4 floats: 48 bytes); p1 is sliced but also read whole
  # (exponential), p2 is an index: both are read whole, so neither is listed.
  assert hlo_text.sliced_reads(_instructions(_FUSED)) == {0: (1 + 2) * 4 * 4}
