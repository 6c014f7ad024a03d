"""One decode step of the continuous engine, compiled for a TPU slice, against its HBM roofline per chip.

Decode is bandwidth-bound: a step of B rows must read, on each chip, the weights it holds and the keys and values of
the rows it attends. `roofline_bytes` counts exactly that, for the run's mesh:
  weights  every parameter's shard on the chip as the engine reads it (`AbstractStep.sampler_params`: cast to the
           compute dtype where held wider), but of an untied embedding table only the B rows gathered, and of a
           mixture-of-experts layer only the experts its tokens are routed to (uniform routing:
           `sampling.roofline.expected_distinct_experts` of the chip's experts);
  cache    rows per chip (B over the batch axes) x the live length x layers x (keys + values) x head width x the
           kv heads the chip's query heads read: K / tensor when the tensor axis divides K, else one.
Seconds are bytes over the chip's nominal HBM bandwidth (`runtime.topologies.CHIPS`).

Two readings of the compiled step: the compiler's `bytes accessed` and `optimal_seconds`, which also count the
copies of operands into on-chip memory (memory space S(1), VMEM) that the TPU compiler makes before a fusion reads
them (at one row, the weights staged into VMEM count about three times: read, written, read again), and
`hbm_bytes`, the bytes each instruction of the optimized program reads and writes in HBM (`hbm_bytes`: operands and
results outside on-chip memory, each counted whole; the body of a loop or branch once; a mixture of experts' grouped
matmuls, whose TPU kernels fetch only the experts with rows, at the roofline's expected fraction of the experts).

The program compiled is `step`: what `continuous.decode_chunk` runs per token (`continuous.decode_token`: the model's
cached one-token step over the slots' spans, then the token choice), without admission, which the engine runs once
per chunk. Its slots and params are laid out as the trainer's (`engine_inputs`), the cache at its
longest, so the compiler's `bytes accessed` and `optimal_seconds` are one step's, comparable with the roofline.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxrl_batch.aot.abstract_step import AbstractStep, abstract_experiment
from jaxrl_batch.aot.engine_inputs import engine_inputs
from jaxrl_batch.aot.report import cost_of, per_chip_bytes
from jaxrl_batch.model import ModelConfig
from jaxrl_batch.runtime import hlo_text as hlo
from jaxrl_batch.runtime import sharding, topologies
from jaxrl_batch.sampling.engine_settings import resolved_backend
from jaxrl_batch.sampling.roofline import expected_distinct_experts
from jaxrl_batch.sampling import continuous
from jaxrl_batch.sampling.strategies import Strategy
from jaxrl_batch.train import placement


@functools.partial(jax.jit, static_argnames=("graphdef", "p", "sampling", "backend"), donate_argnums=(2,))
def step(graphdef, params, slots: continuous.Slots, uid_S, key, *, p: int, sampling: Strategy, backend: str):
  """One decode step of the slots, as `continuous.decode_chunk` runs it per token (`continuous.decode_token`): (cache,
  token_S, logp_S)."""
  model = nnx.merge(graphdef, params)
  cache, token_S, logp_S, _ = continuous.decode_token(model, slots, uid_S, key, p=p, sampling=sampling,
                                                      backend=resolved_backend(backend))
  return cache, token_S, logp_S


@dataclasses.dataclass
class Point:
  """One concurrency: the compiler's figures for one step and the roofline's, per chip."""
  concurrency: int
  cache_length: int
  bytes_accessed: float | None
  optimal_seconds: float | None
  flops: float | None
  weight_bytes: float
  cache_bytes: float
  roofline_seconds: float
  cache_bytes_held: int  # per chip, as the engine lays the cache out
  hbm_bytes: float | None = None
  groups_read: float = 1.0  # of a chip's experts, as the roofline and `hbm_bytes` count them; 1 for a dense model
  slots: int = 0  # compiled; more than `concurrency` below the data-parallel size, the others finished
  error: str = ""

  @property
  def ratio(self) -> float | None:
    """optimal_seconds over the roofline's seconds (1 = at the roofline)."""
    return None if self.optimal_seconds is None else self.optimal_seconds / self.roofline_seconds


def roofline_bytes(step_: AbstractStep, rows: int, length: int) -> tuple[float, float]:
  """(weight bytes, cache bytes) one chip must read for a decode step of `rows` rows at `length` live slots
  (module docstring)."""
  exp = step_.exp
  cfg, mesh = exp.model_cfg, exp.mesh
  params = step_.sampler_params
  weights = 0.0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    held = per_chip_bytes(leaf)
    if "embedding" in jax.tree_util.keystr(path) and not cfg.tie_embeddings:
      held *= min(1.0, rows / leaf.shape[0])
    elif cfg.num_experts and leaf.ndim == 3 and leaf.shape[0] == cfg.num_experts:
      held *= experts_read(cfg, rows)
    weights += held
  tensor = mesh.shape.get("tensor", 1)
  heads = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else 1
  rows_per_chip = -(-rows // sharding.data_parallel_size(mesh))
  cache = 2 * cfg.num_layers * rows_per_chip * length * heads * cfg.head_dim * cfg.compute_dtype.itemsize
  return weights, float(cache)


def experts_read(cfg: ModelConfig, rows: int) -> float:
  """The fraction of each chip's experts a step of `rows` tokens is expected to read under uniform routing
  (`sampling.roofline.expected_distinct_experts`); 1 for a dense model."""
  if not cfg.num_experts:
    return 1.0
  return expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, rows) / cfg.num_experts


def engine_step(config: ml_collections.ConfigDict, devices, prompt_len: int, response_len: int, slots: int):
  """(the step of `config` (`AbstractStep`) with its rollout on the continuous engine's `slots` slots per
  data-parallel shard, that engine's inputs): what the decode step and the prefill compile against; the inputs are
  the reason (a str) where the engine cannot be laid out. `config` is not changed."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.sampling.engine, config.sampling.slots = "continuous", slots
  step_ = AbstractStep.build(abstract_experiment(config, devices, prompt_len, response_len), devices)
  return step_, engine_inputs(step_, False)


def measure(config: ml_collections.ConfigDict, topology: str, concurrencies, prompt_len: int,
            response_len: int) -> tuple[dict, list[Point]]:
  """Compiles `step` for each concurrency (slots decoding at once on the slice: `sampling.slots` x the data-parallel
  size) on compile-only `topology` chips and returns (the topology's figures, one `Point` per concurrency; a point
  that cannot compile holds the reason in `error`). A concurrency below the data-parallel size is the engine at its
  fewest slots (one a shard) with that many live, as at the tail of a rollout: the same program, whose kernels read
  the live rows' experts and cache spans; the roofline and `hbm_bytes` count those (the busiest chip's one row).
  With rollout_mesh.layout='own' the engine decodes on rollout_mesh's shape over the same chips (`train.decode_layout`),
  and the figures are that mesh's."""
  layout = config.rollout_mesh.layout
  if placement.own_layout(config):
    config = placement.generation_config(config)
  topo = topologies.compile_only(topology)
  mesh = sharding.make_mesh(**config.mesh, devices=topo.devices)
  data_parallel = sharding.data_parallel_size(mesh)
  points = []
  for concurrency in concurrencies:
    if concurrency > data_parallel and concurrency % data_parallel:
      points.append(Point(concurrency, 0, None, None, None, 0.0, 0.0, 0.0, 0,
                          error=f"not a multiple of the mesh's {data_parallel} data-parallel shards"))
      continue
    step_, inputs = engine_step(config, topo.devices, prompt_len, response_len, -(-concurrency // data_parallel))
    if isinstance(inputs, str):
      points.append(Point(concurrency, 0, None, None, None, 0.0, 0.0, 0.0, 0, error=inputs))
      continue
    state = inputs["state"]
    length = state.cache.length
    weights, cache_read = roofline_bytes(step_, concurrency, length)
    held = per_chip_bytes(state.cache)
    point = Point(concurrency, length, None, None, None, weights, cache_read,
                  (weights + cache_read) / topo.chip.hbm_bytes_per_s, held,
                  groups_read=experts_read(step_.exp.model_cfg, concurrency), slots=state.token_S.shape[0])
    try:
      compiled = compile_step(step_, inputs)
      cost = cost_of(compiled)
      point.bytes_accessed, point.optimal_seconds, point.flops = cost.bytes_accessed, cost.optimal_seconds, cost.flops
      point.hbm_bytes = hbm_bytes(compiled.as_text(), point.groups_read)
    except Exception as e:  # pylint: disable=broad-except  # Reported per concurrency: the others still compile.
      point.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    points.append(point)
  chip = dict(topology=topo.name, chip=topo.chip.name, hbm_bytes_per_s=topo.chip.hbm_bytes_per_s,
              mesh={k: int(v) for k, v in mesh.shape.items()}, layout=layout,
              model_params=ModelConfig.from_config(config.model).num_params(),
              attention_backend=resolved_backend_for(mesh, config.sampling.attention_backend))
  return chip, points


def lower_step(step_: AbstractStep, inputs: dict):
  """`step` lowered for the engine's slots as `engine_inputs` lays them out (every slot live, the cache at its
  longest bucket), on the mesh the engines decode on (`AbstractStep.engines`)."""
  state, call, step_ = inputs["state"], inputs["call"], step_.engines
  uid_S = jax.ShapeDtypeStruct(state.token_S.shape, jnp.int32, sharding=state.token_S.sharding)
  with jax.set_mesh(step_.exp.mesh):
    return step.lower(step_.models.graphdef, step_.sampler_params, state, uid_S, inputs["key"],
                      p=inputs["prefix"].valid_QxP.shape[1], sampling=call.sampling,
                      backend=call.engine.attention_backend)


def compile_step(step_: AbstractStep, inputs: dict):
  """`lower_step` compiled."""
  with jax.set_mesh(step_.engines.exp.mesh):
    return lower_step(step_, inputs).compile()


def resolved_backend_for(mesh, backend: str) -> str:
  """`backend` ("auto" too) as the engine resolves it on the chips of `mesh`."""
  with jax.set_mesh(mesh):
    return resolved_backend(backend)


_NO_TRAFFIC = ("tuple", "bitcast", "parameter", "constant", "get-tuple-element", "partition-id", "after-all",
               "copy-done")


def _hbm_arrays(text: str) -> list[int]:
  """Bytes of each array type in `text` that lives in HBM (its layout names no memory space S(n))."""
  return [sum(hlo.array_bytes(array.group())) for array in hlo.ARRAY.finditer(text)
          if not re.search(r"S\(\d+\)", array.group(3) or "")]


# MLIR's kDynamic: a Mosaic grid bound known only when the kernel runs.
_DYNAMIC_BOUND = str(-(2**63))
# A grouped matmul's group metadata kernel giving an empty group no tiles: `tiles = select(size == 0, 0, ...)`.
_EMPTY_GROUP_NO_TILES = re.compile(r"(%\w+) = arith\.cmpi eq, %\w+, (%c0_i32\w*) : i32\s+%\w+ = arith\.select \1, \2,")


def grouped_kernels_skip_empty_groups(hlo_text: str) -> bool:
  """Whether the grouped matmuls of an optimized TPU program (XLA's ragged dot, a Mosaic kernel marked
  `ragged_dot_tiling`) read only the groups that have rows, as their compiled code says: the group metadata kernel
  gives an empty group no tiles, and each matmul's grid runs over the metadata's tiles (a bound known at run time),
  one group's weights a step. False where the program has none or any kernel reads otherwise."""
  kernels = metadata = 0
  for line in hlo_text.split("\n"):
    match = hlo.INSTRUCTION.match(line)
    if not match or match.group(3) != "custom-call" or "tpu_custom_call" not in line:
      continue
    body = hlo.mosaic_body(match.group(4))
    if 'op_name="ragged-dot-metadata' in line:
      metadata += 1
      if not _EMPTY_GROUP_NO_TILES.search(body):
        return False
    elif "ragged_dot_tiling" in line:
      kernels += 1
      bounds = re.search(r"iteration_bounds = array<i64: ([^>]*)>", body)
      rhs = re.search(r"transform_indices = @rhs_transform_indices, window_bounds = array<i64: 1,", body)
      if not (bounds and _DYNAMIC_BOUND in bounds.group(1) and rhs):
        return False
  return kernels > 0 and metadata > 0


def _grouped_operand(rest: str) -> int | None:
  """The position of a ragged dot kernel's grouped weights (its rank-3 operand) among its operands."""
  constraints = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", rest)
  if not constraints:
    return None
  ranks = [len(dims.split(",")) for _, dims, _ in hlo.ARRAY.findall(constraints.group(1))]
  return ranks.index(3) if ranks.count(3) == 1 else None


def hbm_bytes(hlo_text: str, groups_read: float = 1.0) -> float:
  """Bytes an optimized HLO module's instructions read and write in HBM: per instruction of the entry computation
  (and, once, of the bodies and branches it calls), its operands and result outside on-chip memory, each counted
  whole but an operand a fusion only slices (`hlo.sliced_reads`: the slices); a copy into on-chip memory (copy-start)
  counts its source, an in-place dynamic-update-slice its update; a grouped matmul's weights, where its kernels read
  only the groups with rows (`grouped_kernels_skip_empty_groups`), at `groups_read` of them (the expected fraction
  of experts a step's tokens choose). An estimate that over-counts a fusion reading part of an operand otherwise."""
  if groups_read != 1.0 and not grouped_kernels_skip_empty_groups(hlo_text):
    groups_read = 1.0
  blocks = {}
  for block in re.split(r"\n(?=%|ENTRY )", hlo_text):
    head, _, body = block.partition("\n")
    blocks["ENTRY" if head.startswith("ENTRY") else head.split(" ")[0].lstrip("%")] = [
        m.groups() for line in body.split("\n") if (m := hlo.INSTRUCTION.match(line))]
  sliced_by = {}  # fused computation -> `hlo.sliced_reads`

  def total(name: str) -> float:
    sizes, count = {}, 0.0
    for var, result, op, rest in blocks.get(name, ()):
      sizes[var] = _hbm_arrays(result)
      if op in _NO_TRAFFIC:
        continue
      if op in ("while", "conditional", "call"):
        called = re.findall(r"(?:body|to_apply)=%?([\w.\-]+)", rest)
        called += [c.strip().lstrip("%") for group in re.findall(r"branch_computations=\{([^}]*)\}", rest)
                   for c in group.split(",")]
        count += sum(total(c) for c in called)
        continue
      operands = hlo.operands(rest)
      if op == "dynamic-update-slice":
        count += 2 * sum(sizes.get(operands[1], ()))
        continue
      fused = re.search(r"calls=%?([\w.\-]+)", rest) if op == "fusion" else None
      if fused and fused.group(1) not in sliced_by:
        sliced_by[fused.group(1)] = hlo.sliced_reads(blocks.get(fused.group(1), []))
      sliced = sliced_by[fused.group(1)] if fused else {}
      grouped = _grouped_operand(rest) if op == "custom-call" and "ragged_dot_tiling" in rest else None
      for i, operand in enumerate(operands):
        held = sum(sizes.get(operand, ()))
        count += min(held, sliced[i]) if i in sliced else held * groups_read if i == grouped else held
      if op != "copy-start":
        count += sum(sizes[var])
    return count

  return total("ENTRY")


def table(points: list[Point]) -> str:
  """The points side by side: per chip, GB read by the compiled step and by the roofline, and their times."""
  lines = [f"{'rows':>5} {'cache':>6} {'GB acc':>8} {'opt ms':>8} {'HBM GB':>8} {'roof GB':>8} {'weights':>8} "
           f"{'kv':>8} {'roof ms':>8} {'x roof':>7} {'HBM x':>6} {'kv held GB':>10}"]
  for p in points:
    if p.error:
      lines.append(f"{p.concurrency:>5} {p.cache_length:>6} error: {p.error}")
      continue
    gb = lambda x: f"{x / 1e9:8.3f}" if x is not None else f"{'-':>8}"
    ms = lambda x: f"{x * 1e3:8.3f}" if x is not None else f"{'-':>8}"
    ratio = f"{p.ratio:7.2f}" if p.ratio is not None else f"{'-':>7}"
    roof = p.weight_bytes + p.cache_bytes
    hbm_ratio = f"{p.hbm_bytes / roof:6.2f}" if p.hbm_bytes is not None else f"{'-':>6}"
    lines.append(f"{p.concurrency:>5} {p.cache_length:>6} {gb(p.bytes_accessed)} {ms(p.optimal_seconds)} "
                 f"{gb(p.hbm_bytes)} {gb(roof)} {gb(p.weight_bytes)} {gb(p.cache_bytes)} {ms(p.roofline_seconds)} "
                 f"{ratio} {hbm_ratio} {p.cache_bytes_held / 1e9:10.3f}")
  return "\n".join(lines)
