"""Reading XLA's compiled HLO text (`compiled.as_text()`): the bytes of an array type, an instruction's parts, and what
a fused computation reads of its parameters. Why: `kernels`, `program_time` and `aot.decode_roofline` all count bytes
from that text; one reader keeps their counts the same.
"""
import base64
import json
import math
import re

# Bits of one element of each HLO element type.
_BITS = dict(pred=8, s2=2, u2=2, s4=4, u4=4, f4e2m1fn=4, s8=8, u8=8, f8e3m4=8, f8e4m3=8, f8e4m3fn=8, f8e4m3b11fnuz=8,
             f8e4m3fnuz=8, f8e5m2=8, f8e5m2fnuz=8, f8e8m0fnu=8, bf16=16, f16=16, s16=16, u16=16, f32=32, s32=32,
             u32=32, f64=64, s64=64, u64=64, c64=64, c128=128)
# One array of a type: element type, dimensions (`<=n`: a dynamic one of bound n), layout where printed (`{1,0:S(1)}`).
ARRAY = re.compile(r"\b(" + "|".join(_BITS) + r")\[([^\]]*)\](\{[^}]*\})?")
# One instruction's line: its name (no %), result type, opcode, and the rest of the line after the opcode's "(".
INSTRUCTION = re.compile(r"\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_SLICING = ("dynamic-slice", "gather")


def elements_bytes(dtype: str, count: int) -> int:
  """Bytes of `count` elements of HLO element type `dtype`, packed and rounded up to a whole byte (s4[3]: 2), as
  XLA lays out a sub-byte array (`E(4)` in its layout)."""
  return -(-count * _BITS[dtype] // 8)


def array_bytes(type_text: str) -> list[int]:
  """Bytes of each array of an HLO type (a tuple's in order; a dynamic dimension `<=n` at its bound n)."""
  return [elements_bytes(dtype, math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d))
          for dtype, dims, _ in ARRAY.findall(type_text)]


def operands(rest: str) -> list[str]:
  """The operands' names (no %) of an instruction, from the rest of its line (`INSTRUCTION`'s last group)."""
  return _OPERAND.findall(rest.split(")", 1)[0])


def sliced_reads(instructions: list[tuple[str, str, str, str]]) -> dict[int, int]:
  """Of a fused computation's parameters, those read only as the sliced operand of dynamic-slice or gather (an
  embedding row, a cache row): parameter number -> the bytes of the slices read. `instructions`: the computation's
  (name, type, opcode, rest), as `INSTRUCTION` reads its lines."""
  number = {name: int(re.match(r"\s*(\d+)", rest).group(1)) for name, _, op, rest in instructions if op == "parameter"}
  reads = {}
  for _, type_, op, rest in instructions:
    for position, operand in enumerate(operands(rest)):
      if operand in number:
        reads.setdefault(operand, []).append(sum(array_bytes(type_)) if op in _SLICING and position == 0 else None)
  return {number[name]: sum(sizes) for name, sizes in reads.items() if None not in sizes}


def mosaic_body(rest: str) -> str:
  """The Mosaic MLIR module of a `tpu_custom_call` instruction (its backend config's base64 `body`), from the rest of
  its line; "" where there is none."""
  config = re.search(r"backend_config=(\{.*\})\s*$", rest)
  if not config:
    return ""
  body = json.loads(config.group(1)).get("custom_call_config", {}).get("body", "")
  return base64.b64decode(body).decode(errors="replace") if body else ""
