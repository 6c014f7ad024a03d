"""What the compile-only check reports of one step's programs: per program, its memory per chip (`memory_analysis`)
and the compiler's costs (`cost_analysis`), and the aot_check.json contract they are written to (docs/scaling.md
lists every field)."""
import dataclasses
import datetime
import math
import re

import jax
import jax.numpy as jnp


SCHEMA_VERSION = 1
GIB = 2**30


@dataclasses.dataclass
class Memory:
  """Bytes per chip of one compiled program (see the module docstring); headroom_frac = 1 - total / hbm. After an
  out-of-memory compile error only temp_bytes (the compiler's need), resident_bytes and hbm_bytes are known."""
  argument_bytes: int | None
  output_bytes: int | None
  alias_bytes: int | None
  temp_bytes: int
  peak_bytes: int | None
  resident_bytes: int
  total_bytes: int | None
  hbm_bytes: int
  headroom_frac: float | None


@dataclasses.dataclass
class Cost:
  """The compiler's estimates per chip: flops, HBM bytes accessed, and the seconds the program would take at peak
  (`optimal_seconds`); loop bodies counted once (module docstring); None where it gives none."""
  flops: float | None
  bytes_accessed: float | None
  optimal_seconds: float | None


@dataclasses.dataclass
class ProgramReport:
  """One program's outcome. status: fits | does_not_fit | skipped | error; memory and cost are None where the
  program was not compiled (an out-of-memory compile error fills memory.temp_bytes and hbm_bytes from its message)."""
  name: str
  function: str
  status: str
  shape: str = ""
  verdict: str = ""
  knobs: list[str] = dataclasses.field(default_factory=list)
  compile_seconds: float | None = None
  memory: Memory | None = None
  cost: Cost | None = None
  message: str = ""


@dataclasses.dataclass
class Report:
  """The outcome of `check`: the topology, the run's shapes and one `ProgramReport` per program."""
  topology: dict
  mesh: dict
  run: dict
  programs: list[ProgramReport]
  rollout_mesh: dict = None  # The mesh the rollout's programs compile on (rollout_mesh.layout='own'); None: `mesh`.
  rollout_chips: int = 0  # rollout_mesh.devices: the generator's chips (the last ones), not the learner's.
  created: str = dataclasses.field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))

  def __post_init__(self):
    self.rollout_mesh = self.rollout_mesh or self.mesh

  def program(self, name: str) -> ProgramReport:
    return next(p for p in self.programs if p.name == name)

  def to_json(self) -> dict:
    """The aot_check.json contract (docs/scaling.md lists every field)."""
    return dict(schema_version=SCHEMA_VERSION, created=self.created, topology=self.topology, mesh=self.mesh,
                rollout_mesh=self.rollout_mesh, rollout_chips=self.rollout_chips, run=self.run,
                programs=[dataclasses.asdict(p) for p in self.programs])

  def table(self) -> str:
    """A fixed-width table of the programs, sizes in GiB per chip, then one verdict line each."""
    head = ("program", "args", "out", "alias", "temp", "peak", "resid", "HBM", "TFLOP", "GB acc", "opt s",
            "compile s")
    fmt = "{:<10}" + "{:>10}" * (len(head) - 1)
    gib = lambda x: "-" if x is None else f"{x / GIB:.2f}"
    num = lambda x, scale, digits: "-" if x is None else f"{x / scale:.{digits}f}"
    mesh = f"mesh {self.mesh}" + (
        f" (the rollout on {self.rollout_chips} chips of its own: {self.rollout_mesh})" if self.rollout_chips else
        f" (the rollout on {self.rollout_mesh})" if self.rollout_mesh != self.mesh else "")
    if self.topology.get("platform", "tpu") == "tpu":
      title = (f"{self.topology['name']} x {self.topology['num_slices']} slice(s): {self.topology['num_chips']} "
               f"chips ({self.topology['device_kind']}), {mesh}; sizes in GiB per chip")
    else:  # GPU nodes: HBM is the allocator's share of the device; no cost analysis.
      title = (f"{self.topology['name']} x {self.topology['num_slices']} node(s): {self.topology['num_chips']} GPUs "
               f"({self.topology['device_kind']}), {mesh}; sizes in GiB per GPU, HBM = "
               f"{self.topology['memory_fraction']:.0%} of {self.topology['device_memory_bytes'] / GIB:.2f} GiB "
               "(XLA_CLIENT_MEM_FRACTION); no compiler costs on GPU")
    lines = [title, fmt.format(*head)]
    for p in self.programs:
      m = p.memory or Memory(*([None] * 9))
      c = p.cost or Cost(None, None, None)
      lines.append(fmt.format(p.name, gib(m.argument_bytes), gib(m.output_bytes), gib(m.alias_bytes),
                              gib(m.temp_bytes), gib(m.peak_bytes), gib(m.resident_bytes), gib(m.hbm_bytes),
                              num(c.flops, 1e12, 1), num(c.bytes_accessed, 1e9, 1), num(c.optimal_seconds, 1, 3),
                              num(p.compile_seconds, 1, 1)))
    lines.append("")
    for p in self.programs:
      knobs = f" Knobs: {'; '.join(p.knobs)}." if p.knobs else ""
      lines.append(f"{p.name:<10} {p.verdict}{knobs} [{p.shape}]" if p.shape else f"{p.name:<10} {p.verdict}")
    return "\n".join(lines)


def per_chip_bytes(tree) -> int:
  """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
  leaves = [x for x in jax.tree.leaves(tree) if x is not None]
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)


def memory_of(stats, resident: int, hbm: int) -> Memory:
  args, out, alias, temp = (stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                            stats.temp_size_in_bytes)
  peak = args + out - alias + temp
  return Memory(args, out, alias, temp, peak, resident, peak + resident, hbm, 1.0 - (peak + resident) / hbm)


_OOM_PATTERNS = (
    re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
    re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_oom(message: str) -> tuple[int, int] | None:
  """(bytes needed, bytes available) of a TPU compiler's out-of-memory message, or None if it is not one."""
  if "RESOURCE_EXHAUSTED" not in message:
    return None
  for pattern in _OOM_PATTERNS:
    found = pattern.search(message)
    if found:
      need, need_unit, have, have_unit = found.groups()
      return int(float(need) * _UNITS[need_unit]), int(float(have) * _UNITS[have_unit])
  return None


def cost_of(compiled) -> Cost:
  # GPU executables give None: reported as such (`check`'s docstring says why not XLA's generic HLO cost analysis).
  costs = compiled.cost_analysis()
  if isinstance(costs, list | tuple):
    costs = costs[0] if costs else None
  if not costs:
    return Cost(None, None, None)
  # A negative figure is the compiler's "unknown" (optimal_seconds is -42 across slices).
  get = lambda key: None if costs.get(key) is None or costs[key] < 0 else float(costs[key])
  return Cost(get("flops"), get("bytes accessed"), get("optimal_seconds"))
