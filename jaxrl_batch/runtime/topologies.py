"""TPU slices you do not have: libtpu's compile-only devices for a topology name, and the chips' figures.

`compile_only("v5p:2x2x1")` returns abstract TPU devices (nothing runs on them): a mesh built over them lowers and
compiles real TPU executables on any machine where libtpu is installed (`pip install "jax[tpu]"`), even one that
runs JAX on its CPU (`JAX_PLATFORMS=cpu`). `train.aot` compiles the trainer's programs this way.
"""
import dataclasses
import glob
import os

import jax
from jax.experimental import topologies as jax_topologies


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's figures per chip (one JAX device per chip on these generations).

  Attributes:
    name: the generation as topology names spell it ("v5e", "v5p", "v6e").
    device_kind: `jax.Device.device_kind` of its devices.
    hbm_bytes: HBM the compiler may plan with: the "available HBM" of its out-of-memory message (libtpu 0.0.42.1,
      measured 2026-12-05), a little below the nominal capacity.
    hbm_bytes_per_s: nominal HBM bandwidth.
    peak_bf16_flops: nominal peak bfloat16 matmul throughput (FLOP/s).
    accelerator_type: a TPU_ACCELERATOR_TYPE of this generation, set (where no TPU is attached) only so that
      libtpu's start-up finds host bounds instead of printing warnings; it does not shape the topology.
  """
  name: str
  device_kind: str
  hbm_bytes: int
  hbm_bytes_per_s: float
  peak_bf16_flops: float
  accelerator_type: str


GIB = 2**30
CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", int(15.75 * GIB), 819e9, 197e12, "v5litepod-4"),  # nominal 16 GiB
    "v5p": Chip("v5p", "TPU v5", int(95.74 * GIB), 2765e9, 459e12, "v5p-8"),  # nominal 95 GB
    "v6e": Chip("v6e", "TPU v6 lite", int(31.25 * GIB), 1640e9, 918e12, "v6e-4"),  # nominal 32 GB
}
HOST_BOUNDS = (2, 2, 1)  # libtpu's default chips per host: a topology smaller than this passes its own bounds.


@dataclasses.dataclass(frozen=True)
class Topology:
  """A (multi-)slice of one chip generation: `num_slices` x the chips `name` describes, as compile-only devices
  ordered slice by slice (so a mesh's leading axis, `data`, spans the slices)."""
  name: str
  chip: Chip
  num_slices: int
  devices: tuple

  @property
  def num_chips(self) -> int:
    return len(self.devices)


def parse(name: str) -> tuple[Chip, tuple[int, ...]]:
  """(chip, chips along each axis) of a topology name such as 'v5p:2x2x1' or 'v5e:4x4'."""
  generation, _, shape = name.partition(":")
  if generation not in CHIPS:
    raise ValueError(f"topology {name!r}: unknown chip {generation!r}; use one of {sorted(CHIPS)}, e.g. v5p:2x2x1 "
                     "or v5e:2x2.")
  try:
    dims = tuple(int(d) for d in shape.split("x"))
  except ValueError:
    dims = ()
  if len(dims) not in (2, 3) or min(dims) < 1:
    raise ValueError(f"topology {name!r}: write <chip>:<X>x<Y>[x<Z>] with positive chip counts, e.g. v5p:2x2x1.")
  return CHIPS[generation], dims


def _quiet_libtpu(chip: Chip) -> None:
  """Environment defaults for loading libtpu on a machine without a TPU: an accelerator type and a worker host (else
  it prints warnings about both) and no lock file (else a second process compiling at the same time is refused).
  Nothing is set where a TPU is attached: there libtpu must see the real machine."""
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", chip.accelerator_type)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def compile_only(name: str, num_slices: int = 1) -> Topology:
  """The compile-only devices of `num_slices` slices of topology `name` (libtpu must be installed)."""
  chip, dims = parse(name)
  if num_slices < 1:
    raise ValueError(f"num_slices={num_slices} must be >= 1.")
  _quiet_libtpu(chip)
  dims3 = dims + (1,) * (3 - len(dims))
  kwargs = dict(num_slices=num_slices)
  if any(d < h for d, h in zip(dims3, HOST_BOUNDS)):  # e.g. v5e:1x1, a single chip (Colab's v5e-1).
    kwargs["chips_per_host_bounds"] = tuple(min(d, h) for d, h in zip(dims3, HOST_BOUNDS))
  try:
    devices = jax_topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs).devices
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(f"libtpu refused topology {name!r} x {num_slices} slice(s): {e}") from None
  kinds = {d.device_kind for d in devices}
  if kinds != {chip.device_kind}:
    raise ValueError(f"topology {name!r} gave {sorted(kinds)} devices, expected {chip.device_kind!r}; update CHIPS.")
  devices = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0), d.id))
  return Topology(name, chip, num_slices, tuple(devices))
