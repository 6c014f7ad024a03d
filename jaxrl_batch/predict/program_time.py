"""The seconds one compiled program takes on a chip, by a roofline: the compiler's flops and bytes accessed against
the chip's matmul rate and memory bandwidth, plus the bytes its collectives send over the interconnect.

Why: a step's time on hardware we do not have follows from the programs `aot` compiles for it. Collectives
are read from the optimized HLO text (`compiled.as_text()`), each with the bytes one chip sends by the ring costs
(n chips per replica group): all-reduce 2 (n - 1) / n x its bytes, all-gather (n - 1) / n x the result's,
reduce-scatter (n - 1) / n x the operand's, all-to-all (n - 1) / n x its bytes, collective-permute its bytes. A
loop's body appears once in the text: its collectives are counted once and marked `in_loop` (no trip counts guessed).

On this machine's CPU (`Rates.kernel_level`) a program is not timed by that roofline but kernel by kernel, as
XLA:CPU runs it (one kernel after another): its matrix products (`kernels`) each at the rate measured at its own
shape (`kernel_rates.dot_seconds`), the other kernels' bytes at the memory bandwidth (those that transpose at
`kernel_rates.transpose_bytes_per_s`), and each kernel launched at `kernel_rates.launch_seconds`; besides, once an
execution (not once a trip of a loop), its temporaries faulted in fresh (`setup_s`: `memory_analysis`'s temporary
bytes at `kernel_rates.fresh_bytes_per_s`). At the sizes of the CPU's models a small product runs at a fraction of a
large square one's rate, which the chip roofline cannot see.
"""
import dataclasses
import math
import re

from jaxrl_batch.predict import kernel_rates, kernels
from jaxrl_batch.runtime import hlo_text as hlo
from jaxrl_batch.runtime.topologies import Chip
from jaxrl_batch import aot

_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=(%?[\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"\bcondition=(%?[\w.\-]+), body=(%?[\w.\-]+)")
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Rates:
  """What one chip does per second: matmul FLOPs, memory bytes, and interconnect bytes it sends (one direction),
  named, with where the figures come from. `launch_s` > 0 (this machine's CPU): programs are timed kernel by kernel
  (module docstring), each kernel launched at that cost, transposes at `transpose_bytes_per_s`, temporaries faulted
  in at `fresh_bytes_per_s` (0: not counted)."""
  name: str
  matmul_flops_per_s: float
  memory_bytes_per_s: float
  interconnect_bytes_per_s: float
  source: str
  launch_s: float = 0.0
  transpose_bytes_per_s: float = 0.0
  fresh_bytes_per_s: float = 0.0

  @property
  def kernel_level(self) -> bool:
    return self.launch_s > 0

  @classmethod
  def from_chip(cls, chip: Chip) -> "Rates":
    """A chip's published figures (`topologies.CHIPS`/`GPUS`); it sends at half its bidirectional interconnect rate."""
    return cls(chip.name, chip.peak_bf16_flops, chip.hbm_bytes_per_s, chip.interconnect_bytes_per_s / 2,
               "published (runtime.topologies)")

  @classmethod
  def measured(cls, machine: dict[str, float], name: str = "this machine") -> "Rates":
    """Rates measured by `sampling.roofline.measure_machine` (one device: no interconnect); kernel by kernel where
    `machine` holds `launch_s`, `transpose_bytes_per_s` and `fresh_bytes_per_s` (`kernel_rates`)."""
    return cls(name, machine["matmul_flops_per_s"], machine["bandwidth_bytes_per_s"], 0.0,
               "measured (sampling.roofline.measure_machine, predict.kernel_rates)", machine.get("launch_s", 0.0),
               machine.get("transpose_bytes_per_s", machine["bandwidth_bytes_per_s"]),
               machine.get("fresh_bytes_per_s", 0.0))


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a program: `op` (an async -start form named as its op), `bytes` (per chip: the array of an
  all-reduce, all-to-all or collective-permute, the result of an all-gather, the operand of a reduce-scatter),
  `group_size` n (chips per replica group; 2 for a collective-permute: each pair), `sent_bytes` (what one chip sends
  by the ring costs) and `in_loop` (inside a while loop's body or condition: counted once here)."""
  op: str
  bytes: int
  group_size: int
  sent_bytes: float
  in_loop: bool


def _all_devices(hlo_text: str) -> int:
  """Chips of a replica group that names none: every partition x replica of the module (its header line)."""
  header, chips = hlo_text.split("\n", 1)[0], 1
  for key in ("num_partitions", "replica_count"):
    if (m := re.search(rf"\b{key}=(\d+)", header)):
      chips *= int(m.group(1))
  return chips


def _computation(line: str) -> str | None:
  """The name a computation's header line opens (`%name (params) -> type {`, ENTRY first), else None."""
  if line and not line[0].isspace() and line.rstrip().endswith("{"):
    return line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
  return None


# The mesh form of replica groups: mesh['a'=2,'b'=4], optionally device_ids=([4,2]T(1,0)), then the axes {'b'}.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}")


def _group_size(line: str, hlo_text: str) -> int:
  """n, the chips of each replica group: `{{0,1,2,3}}`, the iota form `[groups,n]<=[...]`, or the mesh form
  `mesh['a'=2,'b'=4] {'b'}` (a `device_ids=(...)` between them); no groups (or `{}`) means every chip."""
  if (m := re.search(r"replica_groups=\{\{([\d,\s]*)\}", line)):
    return len([x for x in m.group(1).split(",") if x.strip()])
  if (m := re.search(r"replica_groups=\[([\d,]+)\]<=", line)):
    return int(m.group(1).split(",")[-1])
  if (m := _MESH_GROUPS.search(line)):
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[axis]) for axis in re.findall(r"'([^']+)'", m.group(2)))
  if "replica_groups=" in line and not re.search(r"replica_groups=\{\}", line):
    raise ValueError(f"unknown replica_groups form in: {line.strip()[:300]}")
  return _all_devices(hlo_text)


def _loop_computations(hlo_text: str) -> set[str]:
  """Names of the computations run inside a while loop: bodies and conditions, and what they call."""
  calls, current, roots = {}, None, []
  for line in hlo_text.splitlines():
    if (name := _computation(line)):
      current, calls[name] = name, set()
    elif current is not None and line[:1].isspace():
      called = _CALLED.findall(line) + [b for m in _BRANCHES.findall(line) for b in m.split(",")]
      calls[current].update(name.strip().lstrip("%") for name in called)
      if (loop := _WHILE.search(line)):
        roots += [name.lstrip("%") for name in loop.groups()]
  inside, todo = set(), list(roots)
  while todo:
    name = todo.pop()
    if name not in inside:
      inside.add(name)
      todo += calls.get(name, ())
  return inside


def collectives(hlo_text: str) -> list[Collective]:
  """The collectives of an optimized HLO module's text, in order (the -done halves of async pairs skipped)."""
  loops, current, out = _loop_computations(hlo_text), None, []
  for line in hlo_text.splitlines():
    current = _computation(line) or current
    m = hlo.INSTRUCTION.match(line)
    if not m or m.group(3).removesuffix("-start") not in _OPS:
      continue
    op, start = m.group(3).removesuffix("-start"), m.group(3).endswith("-start")
    if start and op != "all-reduce":  # (operands, results[, u32[] contexts]): the results
      sizes = hlo.array_bytes(re.sub(r"\bu32\[\]", "", m.group(2)))
      size = sum(sizes[len(sizes) // 2:])
    else:
      size = sum(hlo.array_bytes(m.group(2)))
    if op == "collective-permute":
      out.append(Collective(op, size, 2, float(size), current in loops))
      continue
    n = _group_size(line, hlo_text)
    if op == "reduce-scatter":
      size *= n
    share = (n - 1) / n
    out.append(Collective(op, size, n, (2 * share if op == "all-reduce" else share) * size, current in loops))
  return out


@dataclasses.dataclass(frozen=True)
class ProgramTime:
  """A program's roofline on one chip: flops and bytes accessed (the compiler's cost analysis), the bytes its
  collectives send, the seconds each takes at `rates`, the compiler's own optimal_seconds (None where absent), and
  its peak bytes per chip (`memory_analysis`: arguments + outputs - aliases + temporaries; None where absent), so a
  prediction says whether the member's programs fit besides how long they take."""
  flops: float
  bytes_accessed: float
  collective_bytes: float
  compute_s: float
  memory_s: float
  collective_s: float
  optimal_seconds: float | None
  collectives: tuple[Collective, ...]
  rates: Rates
  peak_bytes: int | None = None
  launch_s: float = 0.0
  setup_s: float = 0.0

  @property
  def seconds(self) -> float:
    """max(compute, memory) + collectives: compute and memory overlap; collectives are taken as not overlapped.
    Kernel by kernel (`rates.kernel_level`): compute (the products) + memory (the other kernels' bytes) + launches
    + collectives, one after another; the temporaries' setup (`setup_s`, once an execution) apart (`running`)."""
    if self.rates.kernel_level:
      return self.compute_s + self.memory_s + self.launch_s + self.collective_s
    return max(self.compute_s, self.memory_s) + self.collective_s

  def running(self, executions: float, trips: float) -> float:
    """Seconds of `executions` runs of the program doing `trips` runs of its body in all (a loop's trips, a chunk's
    decode steps): the setup (`setup_s`: its temporaries faulted in) once an execution, `seconds` once a trip."""
    return executions * self.setup_s + trips * self.seconds

  @property
  def collectives_in_loops(self) -> int:
    """Collectives inside a loop, counted once although they run once per iteration."""
    return sum(c.in_loop for c in self.collectives)


def program_time(compiled, rates: Rates) -> ProgramTime:
  """The roofline of a compiled executable (`jax.jit(...).lower(...).compile()`) at `rates`. Raises ValueError
  where the compiler gives no bytes (XLA's GPU executables report no cost analysis); no flops are 0 flops (a
  program that only moves data, as the reshard)."""
  cost = aot.cost_of(compiled)
  if cost.bytes_accessed is None:
    raise ValueError(f"{rates.name}: the compiler reports no cost analysis (flops, bytes accessed) for this program.")
  cost = dataclasses.replace(cost, flops=cost.flops or 0.0)
  found = tuple(collectives(compiled.as_text()))
  sent = sum(c.sent_bytes for c in found)
  if sent and not rates.interconnect_bytes_per_s:
    raise ValueError(f"{rates.name} has no interconnect rate, but the program sends {sent:.0f} bytes.")
  compute_s, memory_s = cost.flops / rates.matmul_flops_per_s, cost.bytes_accessed / rates.memory_bytes_per_s
  launch_s = setup_s = 0.0
  if rates.kernel_level:
    run = kernels.kernels(compiled.as_text())
    compute_s = sum(kernel_rates.dot_seconds(*d.shape) * d.times for d in run.dots)
    stats = compiled.memory_analysis()
    if rates.fresh_bytes_per_s and stats is not None:
      setup_s = stats.temp_size_in_bytes / rates.fresh_bytes_per_s
    memory_s = run.streamed_bytes / rates.memory_bytes_per_s + run.transposed_bytes / rates.transpose_bytes_per_s
    launch_s = run.launches * rates.launch_s
  return ProgramTime(
      flops=cost.flops, bytes_accessed=cost.bytes_accessed, collective_bytes=sent, compute_s=compute_s,
      memory_s=memory_s, collective_s=sent / rates.interconnect_bytes_per_s if sent else 0.0,
      optimal_seconds=cost.optimal_seconds, collectives=found, rates=rates, peak_bytes=_peak_bytes(compiled),
      launch_s=launch_s, setup_s=setup_s)


def _peak_bytes(compiled) -> int | None:
  """Arguments + outputs - aliases + temporaries per chip, as `aot` counts a program's peak."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
          + stats.temp_size_in_bytes)
