"""The kernels an optimized HLO module runs, read from its text: how many it launches and the matrix products in them.

Why: on a host-driven backend (XLA:CPU's thunks, a GPU's kernel launches) every kernel costs a fixed launch time
besides its flops and bytes, and a small matrix product runs far below the rate of a large square one; at the sizes
of a small model these, not the roofline's flops and bytes, are most of a program's time. The aggregate cost analysis
says neither, so the module's text is read: a kernel is an instruction of a computation the runtime steps through
(the entry, a while loop's body and condition, a conditional's branches, a called computation), not one fused into
another (fusion bodies, reducers, comparators); parameters, constants, tuples, get-tuple-element and bitcasts launch
nothing. A while loop whose trip count XLA knows (`known_trip_count`) runs its body that many times; one it does not
know runs it once here (the caller multiplies, as `program_time` does for the update's micro-batch loop).
"""
import collections
import dataclasses
import math
import re

from jaxrl_batch.runtime import hlo_text as hlo

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_PARAM = re.compile(r"([\w.\-]+): ((?:\w+\[[^\]]*\])|\w+\[\]|\([^)]*\))")
_NO_KERNEL = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                        "opt-barrier", "partition-id", "replica-id"))
_STEPPED = re.compile(r"\b(body|condition|true_computation|false_computation|to_apply)=%?([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CONTROL = frozenset(("while", "call", "conditional", "async-start", "async-done", "async-update"))
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Dot:
  """One matrix product: `batch` independent (m, k) x (k, n) products in `dtype`, run `times` times a program."""
  batch: int
  m: int
  k: int
  n: int
  dtype: str
  times: int

  @property
  def shape(self) -> tuple[int, int, int, int, str]:
    return self.batch, self.m, self.k, self.n, self.dtype

  @property
  def flops(self) -> float:
    """2 b m k n, one run."""
    return 2.0 * self.batch * self.m * self.k * self.n

  @property
  def bytes(self) -> float:
    """Its operands and result, one run."""
    return float(sum(hlo.elements_bytes(self.dtype, self.batch * size)
                     for size in (self.m * self.k, self.k * self.n, self.m * self.n)))


@dataclasses.dataclass(frozen=True)
class Kernels:
  """What a module launches: `launches` (kernels run, loop bodies times their known trips), its `dots`, and the
  bytes the other kernels read and write (operands + result, times run): `transposed_bytes` those of kernels that
  change an array's layout (a transpose or a copy in them: strided access), `streamed_bytes` the rest."""
  launches: int
  dots: tuple[Dot, ...]
  streamed_bytes: float = 0.0
  transposed_bytes: float = 0.0


def _computations(hlo_text: str) -> dict[str, tuple[dict[str, str], list[tuple[str, str, str, str]]]]:
  """name -> ({value name: its type text}, [(name, type text, opcode, the rest of the line)]) per computation."""
  out, current = {}, None
  for line in hlo_text.splitlines():
    if (header := _HEADER.match(line)):
      current = header.group(1)
      out[current] = ({name: type_ for name, type_ in _PARAM.findall(header.group(2))}, [])
    elif current is not None and (m := hlo.INSTRUCTION.match(line)):
      types, lines = out[current]
      name, type_, op, rest = m.groups()
      types[name] = type_
      lines.append((name, type_, op, rest))
  return out


def _entry(hlo_text: str) -> str:
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY ") and (header := _HEADER.match(line)):
      return header.group(1)
  raise ValueError("The HLO text has no ENTRY computation.")


def _dot(types: dict[str, str], type_: str, rest: str, times: int) -> Dot:
  """The Dot of `dot(lhs, rhs), lhs_contracting_dims=..., ...` (its operands' types from `types`)."""
  operands = re.findall(r"%?([\w.\-]+)", rest.split(")", 1)[0])[:2]
  (dtype, lhs), (_, rhs) = (_shape(types[name]) for name in operands)
  contract, batch_dims = _dims("lhs_contracting_dims", rest), _dims("lhs_batch_dims", rest)
  rhs_contract, rhs_batch = _dims("rhs_contracting_dims", rest), _dims("rhs_batch_dims", rest)
  size = lambda dims, keep: math.prod(d for i, d in enumerate(dims) if i in keep)
  free = lambda dims, *used: math.prod(d for i, d in enumerate(dims) if not any(i in u for u in used))
  return Dot(size(lhs, batch_dims), free(lhs, contract, batch_dims), size(lhs, contract),
             free(rhs, rhs_contract, rhs_batch), dtype, times)


def _dims(name: str, rest: str) -> list[int]:
  """The dimension numbers of attribute `name` (e.g. lhs_contracting_dims={1}) of an instruction; [] if absent."""
  m = re.search(rf"\b{name}=\{{([\d,]*)\}}", rest)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _shape(type_: str) -> tuple[str, list[int]]:
  dtype, dims = re.match(r"(\w+)\[([^\]]*)\]", type_).groups()
  return dtype, [int(d.lstrip("<=")) for d in dims.split(",") if d]


def _stepped(comps, entry: str) -> collections.Counter:
  """(computation, looped) -> the times it runs, for each computation the runtime steps through (module docstring);
  looped: inside a while loop whose trip count XLA does not know."""
  runs, todo = collections.Counter(), [(entry, 1, False)]
  while todo:
    name, times, looped = todo.pop()
    runs[name, looped] += times
    for _, _, op, rest in comps[name][1]:
      trips = (int(m.group(1)) if (m := _TRIPS.search(rest)) else None) if op == "while" else 1
      for role, called in _STEPPED.findall(rest):
        if role != "to_apply" or op == "call":  # a reducer's or a comparator's body runs inside its kernel
          body = role in ("body", "condition")
          todo.append((called, times * (trips or 1 if body else 1), looped or (body and trips is None)))
      for branches in _BRANCHES.findall(rest):
        todo += [(b.strip().lstrip("%"), times, looped) for b in branches.split(",")]
  return runs


def _fused(comps, op: str, rest: str) -> list[tuple[dict, str, str, str]]:
  """(types, type, opcode, rest) of each instruction a fusion runs, its nested fusions' too (none for other ops)."""
  out, todo = [], [m.group(1)] if op == "fusion" and (m := _CALLS.search(rest)) else []
  while todo:
    types, lines = comps[todo.pop()]
    out += [(types, *line[1:]) for line in lines]
    todo += [m.group(1) for _, _, o, r in lines if o == "fusion" and (m := _CALLS.search(r))]
  return out


def kernels(hlo_text: str, looped: bool | None = None) -> Kernels:
  """The kernels `hlo_text` (`compiled.as_text()`) launches, the matrix products they hold and the bytes the others
  move (module docstring): all of them, or (`looped`) only those inside a while loop of unknown trip count (run once
  here: a caller that knows the trips multiplies them), or (not `looped`) only the others, run once per execution."""
  comps = _computations(hlo_text)
  launches, dots, streamed, transposed = 0, [], 0.0, 0.0
  for (name, in_loop), times in _stepped(comps, _entry(hlo_text)).items():
    if looped is not None and in_loop != looped:
      continue
    types, lines = comps[name]
    for _, type_, op, rest in lines:
      if op in _NO_KERNEL:
        continue
      launches += times
      inside = [(types, type_, op, rest)] + _fused(comps, op, rest)
      found = [_dot(t, ty, r, times) for t, ty, o, r in inside if o == "dot"]
      if found or op in _CONTROL:
        dots += found
        continue
      moved = times * (sum(hlo.array_bytes(type_)) + _read(comps, types, type_, op, rest))
      if any(o in ("transpose", "copy") for _, _, o, _ in inside):
        transposed += moved
      else:
        streamed += moved
  return Kernels(launches, tuple(dots), streamed, transposed)


def _read(comps, types: dict, type_: str, op: str, rest: str) -> int:
  """Bytes a kernel reads: each operand whole, but one it only slices (a dynamic-slice or gather of it: an
  embedding row, a cache row) at the slices' bytes, and an in-place dynamic-update-slice only its update."""
  held = [sum(hlo.array_bytes(types.get(o, ""))) for o in hlo.operands(rest)]
  if op in ("dynamic-slice", "gather"):
    return sum(hlo.array_bytes(type_)) + sum(held[1:])
  if op == "dynamic-update-slice":
    return sum(held[1:])
  sliced = hlo.sliced_reads(comps[m.group(1)][1]) if op == "fusion" and (m := _CALLS.search(rest)) else {}
  return sum(min(sliced.get(i, math.inf), size) for i, size in enumerate(held))
