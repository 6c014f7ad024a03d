"""TPU slices and GPU nodes you do not have: compile-only devices for a topology name, and the chips' figures.

`compile_only("v5p:2x2x1")` returns abstract TPU devices (nothing runs on them): a mesh built over them lowers and
compiles real TPU executables on any machine where libtpu is installed (`pip install "jax[tpu]"`), even one that
runs JAX on its CPU (`JAX_PLATFORMS=cpu`). `aot` compiles the trainer's programs this way.

GPU nodes the same way: `compile_only("h100:8", num_slices=2)` (or `compile_only_gpu("h100", 8, num_nodes=2)`)
returns compile-only CUDA devices of 2 nodes of 8 H100s, from the JAX CUDA plugin (`pip install -e '.[cuda_aot]'`,
or the full `.[cuda]`) and the chip's description shipped in `gpu_specs/<chip>.txtpb` (XLA's GpuTargetConfigProto):
XLA's GPU compiler builds PTX and runs ptxas on it, with no GPU and no CUDA driver. A GPU topology's slices are its
nodes (each its own NVLink domain).
"""
import dataclasses
import glob
import os

import jax
import jax.numpy as jnp
from jax.experimental import topologies as jax_topologies


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's or GPU's figures per chip (one JAX device per chip).

  Attributes:
    name: the generation as topology names spell it ("v5e", "v5p", "v6e"; "h100", "h200", "a100").
    device_kind: `jax.Device.device_kind` of its devices.
    hbm_bytes: TPU: HBM the compiler may plan with: the "available HBM" of its out-of-memory message (libtpu 0.0.42.1,
      measured 2026-12-05), a little below the nominal capacity. GPU: the device memory the CUDA driver reports (the
      target description's device_memory_size), of which a JAX process allocates a fraction (`Topology.hbm_bytes`).
    hbm_bytes_per_s: nominal HBM bandwidth.
    peak_bf16_flops: nominal peak dense bfloat16 matmul throughput (FLOP/s).
    accelerator_type: TPU: a TPU_ACCELERATOR_TYPE of this generation, set (where no TPU is attached) only so that
      libtpu's start-up finds host bounds instead of printing warnings; it does not shape the topology. GPU: "".
    platform: "tpu", or "cuda" for an NVIDIA GPU (whose devices report `platform` "gpu").
    interconnect_bytes_per_s: nominal chip-to-chip bandwidth per chip, both directions together, as the vendors
      publish it (TPU: ICI; GPU: NVLink within a node); a chip sends at half of it while it receives.
  """
  name: str
  device_kind: str
  hbm_bytes: int
  hbm_bytes_per_s: float
  peak_bf16_flops: float
  accelerator_type: str
  platform: str = "tpu"
  interconnect_bytes_per_s: float = 0.0


GIB = 2**30
# Interconnect: "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip)" of Google Cloud's system
# architecture pages https://cloud.google.com/tpu/docs/v5e (400 GBps), .../tpu/docs/v5p (1200 GBps; its older
# "4800 Gbps" is one direction), .../tpu/docs/v6e (800 GBps).
CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", int(15.75 * GIB), 819e9, 197e12, "v5litepod-4",  # nominal 16 GiB
                interconnect_bytes_per_s=400e9),
    "v5p": Chip("v5p", "TPU v5", int(95.74 * GIB), 2765e9, 459e12, "v5p-8",  # nominal 95 GB
                interconnect_bytes_per_s=1200e9),
    "v6e": Chip("v6e", "TPU v6 lite", int(31.25 * GIB), 1640e9, 918e12, "v6e-4",  # nominal 32 GB
                interconnect_bytes_per_s=800e9),
}
HOST_BOUNDS = (2, 2, 1)  # libtpu's default chips per host: a topology smaller than this passes its own bounds.
# GPUs, the SXM parts of 8-GPU nodes (HGX/DGX). Memory: the device_memory_size of gpu_specs/<name>.txtpb (tested equal).
# Bandwidth and dense bf16 flops: NVIDIA's datasheets (H100 SXM: 3.35 TB/s, 989 TFLOP/s, i.e. 1,979 "with sparsity";
# H200 SXM: 4.8 TB/s, the same GH100 compute; A100 SXM4 80GB: 2,039 GB/s, 312 TFLOP/s). NVLink per GPU, both
# directions, from the same datasheets (https://www.nvidia.com/en-us/data-center/h100/, .../h200/, .../a100/):
# H100 and H200 SXM 900 GB/s (fourth-generation NVLink), A100 SXM 600 GB/s (third generation).
GPUS = {
    "h100": Chip("h100", "NVIDIA H100 80GB HBM3", 84_942_979_072, 3352e9, 989e12, "", "cuda",  # 79.1 GiB
                 interconnect_bytes_per_s=900e9),
    "h200": Chip("h200", "NVIDIA H200", 151_397_597_184, 4800e9, 989e12, "", "cuda",  # 141 GiB
                 interconnect_bytes_per_s=900e9),
    "a100": Chip("a100", "NVIDIA A100-SXM4-80GB", 85_100_068_864, 2039e9, 312e12, "", "cuda",  # 79.3 GiB
                 interconnect_bytes_per_s=600e9),
}
GPU_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")
# JAX's GPU client allocates this fraction of each device's memory (XLA_CLIENT_MEM_FRACTION, formerly
# XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75: `jaxlib.xla_client.generate_pjrt_gpu_plugin_options`), preallocated
# or not; the rest is for the CUDA context, cuBLAS/cuDNN workspaces and other processes.
DEFAULT_GPU_MEMORY_FRACTION = 0.75
_CUDA_INSTALL = "pip install -e '.[cuda_aot]'"


@dataclasses.dataclass(frozen=True)
class Topology:
  """A (multi-)slice of one chip generation: `num_slices` x the chips `name` describes, as compile-only devices
  ordered slice by slice (so a mesh's leading axis, `data`, spans the slices). GPUs: `name` is '<chip>:<gpus per
  node>', a slice is a node, and `memory_fraction` the share of each device's memory JAX allocates."""
  name: str
  chip: Chip
  num_slices: int
  devices: tuple
  memory_fraction: float = 1.0

  @property
  def num_chips(self) -> int:
    return len(self.devices)

  @property
  def platform(self) -> str:
    return self.chip.platform

  @property
  def hbm_bytes(self) -> int:
    """Bytes per chip a program may use: TPU: the chip's HBM as its compiler plans with it; GPU: the driver's device
    memory x JAX's memory fraction (its allocator's limit)."""
    return int(self.chip.hbm_bytes * self.memory_fraction)


def parse(name: str) -> tuple[Chip, tuple[int, ...]]:
  """(chip, chips along each axis) of a topology name such as 'v5p:2x2x1' or 'v5e:4x4'."""
  generation, _, shape = name.partition(":")
  if generation not in CHIPS:
    raise ValueError(f"topology {name!r}: unknown chip {generation!r}; use one of {sorted(CHIPS)}, e.g. v5p:2x2x1 "
                     f"or v5e:2x2 (GPU nodes: one of {sorted(GPUS)} with GPUs per node, e.g. h100:8).")
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
  """The compile-only devices of `num_slices` slices of topology `name` (libtpu must be installed); for a GPU name
  ('h100:8': 8 GPUs per node) `num_slices` nodes of them (`compile_only_gpu`)."""
  generation, _, gpus = name.partition(":")
  if generation in GPUS:
    if not gpus.isdigit():
      raise ValueError(f"topology {name!r}: write <gpu>:<GPUs per node>, e.g. {generation}:8.")
    return compile_only_gpu(generation, int(gpus), num_nodes=num_slices)
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


def gpu_memory_fraction() -> float:
  """The fraction of each GPU's memory a JAX process started with this environment would allocate
  (DEFAULT_GPU_MEMORY_FRACTION says how JAX reads it)."""
  value = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  return float(value) if value else DEFAULT_GPU_MEMORY_FRACTION


def gpu_target_config(name: str) -> str:
  """The text of `gpu_specs/<name>.txtpb`: XLA's GpuTargetConfigProto for GPU `name`."""
  if name not in GPUS:
    raise ValueError(f"unknown GPU {name!r}; use one of {sorted(GPUS)} (their descriptions are in {GPU_SPECS}).")
  with open(os.path.join(GPU_SPECS, f"{name}.txtpb")) as f:
    return f.read()


def compile_only_gpu(name: str, gpus_per_node: int = 8, num_nodes: int = 1,
                     memory_fraction: float | None = None) -> Topology:
  """Compile-only CUDA devices of `num_nodes` nodes of `gpus_per_node` GPUs `name` ("h100", "h200", "a100"), ordered
  node by node, from the JAX CUDA plugin (jax-cuda12-plugin, and ptxas: `pip install -e '.[cuda_aot]'`).

  memory_fraction: the share of each device's memory the run's JAX allocates (`Topology.hbm_bytes`); None = as this
  environment's XLA_CLIENT_MEM_FRACTION / XLA_PYTHON_CLIENT_MEM_FRACTION say, else JAX's default 0.75.
  """
  text = gpu_target_config(name)
  chip = GPUS[name]
  if gpus_per_node < 1 or num_nodes < 1:
    raise ValueError(f"{gpus_per_node} GPUs per node x {num_nodes} nodes: both must be >= 1.")
  fraction = gpu_memory_fraction() if memory_fraction is None else memory_fraction
  if not 0 < fraction <= 1:
    raise ValueError(f"GPU memory fraction {fraction} must be in (0, 1] (XLA_CLIENT_MEM_FRACTION).")
  # partitions x hosts x devices: each node its own NVLink domain, one process per node.
  try:
    devices = jax_topologies.get_topology_desc(platform="cuda", target_config=text,
                                               topology=f"{num_nodes}x1x{gpus_per_node}").devices
  except NotImplementedError:  # No CUDA PJRT plugin: "topology not implemented for cuda".
    raise ValueError(f"Compiling for {name} GPUs needs the JAX CUDA plugin: {_CUDA_INSTALL} (or '.[cuda]', "
                     "the whole CUDA build).") from None
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(f"The JAX CUDA plugin refused {name} x {gpus_per_node} x {num_nodes} node(s) "
                     f"(gpu_specs/{name}.txtpb): {e}") from None
  kinds = {d.device_kind for d in devices}
  if kinds != {chip.device_kind}:
    raise ValueError(f"{name} gave {sorted(kinds)} devices, expected {chip.device_kind!r}; update GPUS.")
  _check_ptx_compiler(name, devices[0])
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  return Topology(f"{name}:{gpus_per_node}", chip, num_nodes, tuple(devices), fraction)


_PTX_CHECKED = set()


def _check_ptx_compiler(name: str, device) -> None:
  """Compiles a one-element program for `device` (once per GPU name and process): XLA's GPU compiler needs ptxas (the
  nvidia-cuda-nvcc-cu12 wheel, or a CUDA toolkit), which it looks for only when it compiles; without it every program
  would fail the same way."""
  if name in _PTX_CHECKED:
    return
  x = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
  try:
    jax.jit(lambda v: v + 1).lower(x).compile()
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(f"XLA cannot compile for {name} here ({str(e).split('. ')[0][:200]}): it needs ptxas: "
                     f"{_CUDA_INSTALL} (nvidia-cuda-nvcc-cu12), or a CUDA toolkit.") from None
  _PTX_CHECKED.add(name)
