"""One RL step of a family member on a topology one does not have, predicted from the programs `aot` compiles.

The target is a TPU topology (compile-only devices, the chip's published rates) or "cpu": this machine's CPU devices
at the rates `sampling.roofline.measure_machine` measures (matmul and memory), which is how the model is checked
against measured throughput. A step's time, as the analysis's R counts it, is its rollout, its scoring and reference
forwards, its update and the host's reward scoring (not predicted: given, 0 by default). Each compiled program is
timed by its roofline at the target's rates (`program_time`). The rollout follows the engine's own schedule of the
step's requests at the given response lengths (`engine_time`); each of its decode steps is timed as the compiled
step of the engine's rows with every slot live at that step's cache bucket (`aot.decode_roofline.step`, compiled
once per bucket; a paged cache at its whole pool), each prefill as the compiled prefill of the step's prompts, in
proportion to its prompts. The static engine's blocks are timed by the same step at the block's rows. The compiler
counts a loop's body once, so the update (a loop over micro-batches) counts its micro-batches times its program (the
optimizer's step is overcounted with it) and the scoring forwards theirs: num_micro per mini-batch, or with packed
micro-batches (`rl.packing`) those holding tokens, the sequences placed as the packing places them. On this CPU
the rollout's programs are taken above their predicted best by the spread of the member's decode step measured here
(`spread`: a run's short decode programs do not run at their best on this machine).
"""
import dataclasses
import hashlib
import logging

import jax
import ml_collections
import numpy as np

from jaxrl_batch.model import KVCache, ModelConfig
from jaxrl_batch.predict import decode_layouts, engine_time, kernel_rates, lengths, spread
from jaxrl_batch.predict.program_time import ProgramTime, Rates, program_time
from jaxrl_batch.rl import packing as packing_lib
from jaxrl_batch.runtime import sharding, topologies
from jaxrl_batch.sampling.roofline import measure_machine
from jaxrl_batch.train import placement, rundir
from jaxrl_batch import aot
from jaxrl_batch.aot import decode_roofline

CPU = "cpu"  # The topology name of this machine's CPU devices.
LOCAL = "local"  # The devices this process has: its CPU's (as CPU), or accelerators at their chip's published rates.
# Draws of a member's B lengths at least: a step waits for its longest response, the tail of B / G problems' lengths,
# whose mean over a few draws (8 at B = 128 from 1,024 rollouts) is off by 5-10% in either direction.
MIN_DRAWS = 32


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A member's predicted step, the mean over draws of its requests' lengths (one draw a step): the rollout's
  schedule of each draw (`schedules`), its seconds and the other phases' seconds (means over the draws), and each
  compiled program's roofline (`programs`: decode (at the longest cache bucket), prefill, score, reference, update;
  those the step runs; `decode_by_length`: the decode step at each cache bucket the schedules read), and the factor
  the rollout's seconds were taken above those programs' best (`rollout_spread`: `spread`, this CPU; 1 elsewhere)."""
  batch: int
  schedules: tuple[engine_time.Schedule, ...]
  rollout: engine_time.RolloutTime
  score_s: float
  reference_s: float
  update_s: float
  reward_s: float
  programs: dict[str, ProgramTime]
  decode_by_length: dict[int, ProgramTime]
  rollout_spread: float = 1.0
  reshard_s: float = 0.0  # rollout_mesh.layout='own': the policy laid out for decoding, once a step.
  # rollout_mesh.devices (generation on chips of its own, rl.max_staleness >= 1): the rollout runs beside the
  # learner's programs (`overlapped`), and the policy is sent to the generator's chips once a step (`publish_s`).
  publish_s: float = 0.0
  overlapped: bool = False
  layout: str = "trainer"  # rollout_mesh.layout, and the mesh the rollout decodes on.
  rollout_mesh: dict | None = None
  layouts: tuple["LayoutTime", ...] = ()  # `compare_layouts`: the step in each decode layout, fastest first.

  @property
  def learner_s(self) -> float:
    return self.score_s + self.reference_s + self.update_s

  @property
  def seconds(self) -> float:
    """The step: its parts one after another; generating on chips of its own, the longer of the rollout and the
    learner's programs, after the publish."""
    if self.overlapped:
      return self.publish_s + max(self.rollout.seconds, self.learner_s) + self.reward_s
    return self.reshard_s + self.rollout.seconds + self.learner_s + self.reward_s

  @property
  def samples_per_s(self) -> float:
    """R: rollouts trained on per second."""
    return self.batch / self.seconds

  @property
  def decode_steps(self) -> float:
    """Decode steps a rollout runs, the mean over the draws."""
    return float(np.mean([s.decode_steps for s in self.schedules]))

  @property
  def generation_per_s(self) -> float:
    """Rollouts generated per second of the rollout phase alone (the reference study's generation throughput)."""
    return self.batch / self.rollout.seconds

  def to_json(self) -> dict:
    """The step's parts (plan.json rows' `step`), and each program's peak bytes per chip (`peak_bytes`: the decode
    step's at its longest cache bucket; what the step holds besides, optimizer state or the reference policy, is
    `launch.aot_check`'s to add)."""
    return dict(seconds=self.seconds, reshard_s=self.reshard_s, publish_s=self.publish_s, overlapped=self.overlapped,
                rollout_s=self.rollout.seconds, decode_s=self.rollout.decode_s,
                prefill_s=self.rollout.prefill_s, score_s=self.score_s, reference_s=self.reference_s,
                update_s=self.update_s, decode_steps=self.decode_steps, draws=len(self.schedules),
                decode_step_s=self.programs["decode"].seconds, rollout_spread=self.rollout_spread,
                mean_response_tokens=float(np.mean([s.decoded for s in self.schedules])) / self.batch + 1,
                peak_bytes={name: p.peak_bytes for name, p in self.programs.items()}, layout=self.layout,
                rollout_mesh=self.rollout_mesh, layouts=[dataclasses.asdict(t) for t in self.layouts])


@dataclasses.dataclass(frozen=True)
class LayoutTime:
  """A member's step predicted in one decode layout (`decode_layouts.candidates`): its seconds, the reshard's and
  the rollout's; or, where the target cannot hold or lay it out, why (`refused`, the seconds 0)."""
  layout: str
  rollout_mesh: dict
  seconds: float = 0.0
  reshard_s: float = 0.0
  rollout_s: float = 0.0
  refused: str = ""


# What shrinks a refused program (DoesNotFit's advice): the engine's, by its slots a chip; the learner's.
_DECODE_KNOBS = ("Fewer sequences at once: sampling.engine=continuous with sampling.slots below {slots} per chip (its "
                 "KV cache is slots x the prompt and response budget), a shorter budget, or a larger slice.")
_LEARNER_KNOBS = ("Fewer rows per forward: micro_batch_size / score_micro_batch_size, model.remat, model.logits_chunk, "
                  "or a larger slice (`launch.aot_check` lists the knobs per program).")


class DoesNotFit(ValueError):
  """A member's program is too big for the target's memory (the TPU compiler refuses it): no time to predict."""


def _refusal(message: str, what: str, batch: int, knobs: str) -> DoesNotFit | None:
  """DoesNotFit naming the program, the compiler's need and the knobs that shrink it, where `message` is the TPU
  compiler's out-of-memory refusal; else None."""
  oom = aot.parse_oom(message)
  if oom is None:
    return None
  need, have = oom
  return DoesNotFit(f"Batch {batch}: {what} does not fit: the compiler needs {need / aot.GIB:.2f} GiB of "
                    f"temporaries per chip, {have / aot.GIB:.2f} GiB available. {knobs}")


class _Timer:
  """Programs timed at `rates`, each compiled once however many members run it: keyed by its lowered text (members
  of one slot count share their decode steps and prefill; the update's loop differs with the batch)."""

  def __init__(self, rates: Rates):
    self.rates, self._timed = rates, {}

  def time(self, lowered, mesh, what: str, batch: int, knobs: str) -> ProgramTime:
    """The roofline of `lowered` compiled under `mesh`, or its out-of-memory refusal as DoesNotFit (`_refusal`)."""
    key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    if key not in self._timed:
      try:
        with jax.set_mesh(mesh):
          compiled = lowered.compile()
      except Exception as e:  # pylint: disable=broad-except  # only an out-of-memory refusal is translated
        refusal = _refusal(str(e), what, batch, knobs)
        if refusal is None:
          raise
        raise refusal from None
      self._timed[key] = program_time(compiled, self.rates)
    return self._timed[key]


def _lowered(name: str, step: aot.AbstractStep):
  """Program `name` of the step (`aot.program`) lowered, or None where the step does not run it."""
  built = aot.program(name, step)
  return None if isinstance(built, str) else built.lower()


def target(topology: str, config: ml_collections.ConfigDict, num_slices: int = 1) -> tuple[tuple, Rates]:
  """(devices, rates) of `topology`: `num_slices` slices of a TPU topology ('v5p:4x4x2') as compile-only devices at
  the chip's published rates, or CPU: this machine's CPU devices at the rates measured now in the compute dtype of
  `config`'s model, or LOCAL: this process's devices (CPU as CPU; TPUs and GPUs at their chip's rates)."""
  if topology == LOCAL:
    local = jax.devices()
    if local[0].platform == "cpu":
      return target(CPU, config)
    kinds = {chip.device_kind: chip for chip in (*topologies.CHIPS.values(), *topologies.GPUS.values())}
    if local[0].device_kind not in kinds:
      raise ValueError(f"No published rates for {local[0].device_kind!r} devices (runtime.topologies CHIPS, GPUS): "
                       "name a topology instead, or set rollout_mesh.layout.")
    return tuple(local), Rates.from_chip(kinds[local[0].device_kind])
  if topology == CPU:
    machine = measure_machine(ModelConfig.from_config(config.model).compute_dtype, 512, 2048)
    rates = Rates.measured(dict(machine, launch_s=kernel_rates.launch_seconds(),
                                transpose_bytes_per_s=kernel_rates.transpose_bytes_per_s(),
                                fresh_bytes_per_s=kernel_rates.fresh_bytes_per_s()), "this machine's CPU")
    # Its devices (several with --xla_force_host_platform_device_count) share one memory: a collective is a copy.
    return tuple(jax.devices("cpu")), dataclasses.replace(rates, interconnect_bytes_per_s=rates.memory_bytes_per_s)
  topo = topologies.compile_only(topology, num_slices)
  return topo.devices, Rates.from_chip(topo.chip)


def _at_length(inputs: dict, length: int) -> dict:
  """The engine's inputs with a slot cache of `length` slots (a paged cache as it is)."""
  cache = inputs["state"].cache
  if not isinstance(cache, KVCache) or cache.length == length:
    return inputs
  struct = lambda x, shape: jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)
  resized = KVCache(tuple(struct(k, (*k.shape[:3], length)) for k in cache.k_layers),
                    tuple(struct(v, (*v.shape[:2], length, v.shape[3])) for v in cache.v_layers))
  return dict(inputs, state=inputs["state"]._replace(cache=resized))


def _micro_batches(exp, lengths_B, prompts_B, rows: int) -> int:
  """Micro-batches a forward (and backward) over the batch runs in slices of `rows` rows: each slice's `num_micro`
  (`rows` // its micro-batch size), or with packed micro-batches those its sequences fill (prompt + response tokens
  each, padding stripped, placed by `rl.packing.first_fit_decreasing` into rows of the packing's length)."""
  m, packing = exp.member, exp.packing
  if packing is None:
    return len(lengths_B) // rows * (m.num_micro if rows == m.mini_batch_size else m.score_num_micro)
  count = 0
  for first in range(0, len(lengths_B), rows):
    tokens_B = np.asarray(prompts_B[first:first + rows] + lengths_B[first:first + rows], np.int32)
    bin_B, _ = packing_lib.first_fit_decreasing(jax.numpy.asarray(tokens_B), packing.length)
    count += -(-(int(bin_B.max()) + 1) // packing.rows)
  return count


def predict(config: ml_collections.ConfigDict, topology: str, lengths_B, *, prompt_len: int, response_len: int,
            num_slices: int = 1, rates: Rates | None = None, reward_s: float = 0.0,
            timer: _Timer | None = None, prompt_lengths_B=None) -> StepTime:
  """The step of the member `config` describes on `topology` (`target`), its B requests' response lengths
  `lengths_B` (tokens, EOS included; B of them, or D x B: D draws, the step's mean over them), prompts padded to
  `prompt_len` tokens and the response budget `response_len`; timed at `rates` (default: the target's), by `timer`
  where given (`sweep`'s: programs members share are compiled once). `prompt_lengths_B` (the same shape): each
  prompt's own tokens (default `prompt_len`), which packed micro-batches hold without padding; the engine prefills
  every prompt at `prompt_len`."""
  if rates is None:
    devices, rates = target(topology, config, num_slices)
  else:
    devices = _devices(topology, num_slices)
  timer = timer if timer is not None and timer.rates == rates else _Timer(rates)
  exp = aot.abstract_experiment(config, devices, prompt_len, response_len)
  m = exp.member
  lengths_DxB, prompts_DxB = _draws(exp, lengths_B, prompt_lengths_B)
  dp = _engine_shards(config, devices)
  block = exp.engine.slots * dp or m.batch_size  # rows decoding at once on the slice
  # The member's step with its rollout on `block` slots: the decode step, the prefill and the learner's programs
  # (which the engine's settings leave unchanged) compile against it.
  step, inputs = decode_roofline.engine_step(config, devices, exp.prompt_len, exp.response_len, block // dp)
  schedules, rollout, programs, by_length, rollout_spread = _rollout(step.engines.exp, step, inputs, timer,
                                                                     lengths_DxB, block)
  score_s, reference_s, update_s = _learner(exp, step, timer, lengths_DxB, prompts_DxB, programs)
  reshard = aot.program("reshard", step)
  if isinstance(reshard, aot.Program):
    programs["reshard"] = timer.time(reshard.lower(), reshard.mesh, "the reshard program", m.batch_size,
                                     _LEARNER_KNOBS)
  reshard_s = programs["reshard"].running(1, 1) if "reshard" in programs else 0.0
  publish = aot.program("publish", step)
  publish_s = publish.sent_bytes / rates.interconnect_bytes_per_s if isinstance(publish, aot.Copy) else 0.0
  mesh = {axis: int(size) for axis, size in step.engines.exp.mesh.shape.items()}
  return StepTime(m.batch_size, schedules, rollout, score_s, reference_s, update_s, reward_s, programs, by_length,
                  rollout_spread, reshard_s=reshard_s, publish_s=publish_s,
                  overlapped=bool(config.rollout_mesh.devices), layout=config.rollout_mesh.layout, rollout_mesh=mesh)


def compare_layouts(config: ml_collections.ConfigDict, topology: str, lengths_B, *, prompt_len: int,
                    response_len: int, num_slices: int = 1, rates: Rates | None = None, timer: _Timer | None = None,
                    prompt_lengths_B=None) -> StepTime:
  """The member's step (`predict`, same arguments) in the fastest of the decode layouts its chips allow
  (`decode_layouts.candidates`: the trainer's and each of its own), its `layouts` every candidate's, fastest first
  and refused ones last. The learner's programs are the same in each: one `_Timer` compiles them once. Raises
  DoesNotFit where no layout fits."""
  if rates is None:
    devices, rates = target(topology, config, num_slices)
  else:
    devices = _devices(topology, num_slices)
  timer = timer if timer is not None and timer.rates == rates else _Timer(rates)
  steps, times = [], []
  for candidate in decode_layouts.candidates(config, len(devices)):
    try:
      step = predict(candidate, topology, lengths_B, prompt_len=prompt_len, response_len=response_len,
                     num_slices=num_slices, rates=rates, timer=timer, prompt_lengths_B=prompt_lengths_B)
    except Exception as e:  # pylint: disable=broad-except  # Too big, or a mesh the batch or weights cannot split over.
      times.append(LayoutTime(*decode_layouts.describe(candidate), refused=str(e).splitlines()[0][:300]))
      continue
    steps.append(step)
    times.append(LayoutTime(step.layout, step.rollout_mesh, step.seconds, step.reshard_s, step.rollout.seconds))
  if not steps:
    raise DoesNotFit(f"Batch {config.batch_size}: no decode layout fits: " + "; ".join(t.refused for t in times))
  times.sort(key=lambda t: (bool(t.refused), t.seconds))
  return dataclasses.replace(min(steps, key=lambda s: s.seconds), layouts=tuple(times))


def _devices(topology: str, num_slices: int) -> tuple:
  """The devices of `topology` (`target`'s, without measuring rates)."""
  if topology == CPU:
    return tuple(jax.devices("cpu"))
  if topology == LOCAL:
    return tuple(jax.devices())
  return topologies.compile_only(topology, num_slices).devices


def choose_layout(config: ml_collections.ConfigDict, topology: str, *, prompt_len: int, response_len: int,
                  num_slices: int = 1) -> tuple[ml_collections.ConfigDict, tuple["LayoutTime", ...]]:
  """rollout_mesh.layout='auto' resolved: (`config` decoding in the fastest of its decode layouts on `topology`
  (`compare_layouts`, every response at the budget: a run's lengths are not known before it runs), each layout's
  predicted step, fastest first). Any other layout: (`config`, ()). Lengths of 0: the trainer's."""
  if config.rollout_mesh.layout != decode_layouts.AUTO:
    return config, ()
  if not (prompt_len and response_len):  # The trainer's (they read the tokenizer and the task's data).
    exp = aot.abstract_experiment(decode_layouts.with_layout(config, "trainer"), _devices(topology, num_slices),
                                  prompt_len, response_len)
    prompt_len, response_len = exp.prompt_len, exp.response_len
  step = compare_layouts(decode_layouts.with_layout(config, "trainer"), topology,
                         np.full(config.batch_size, response_len), prompt_len=prompt_len, response_len=response_len,
                         num_slices=num_slices)
  chosen = decode_layouts.with_layout(config, step.layout, **step.rollout_mesh)
  return chosen, step.layouts


def run_layout(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
  """A run's `config` with rollout_mesh.layout='auto' chosen: as the run's config.json saved it when it resumes, else
  the fastest decode layout predicted on this process's devices (`choose_layout`), each one's step logged."""
  if config.rollout_mesh.layout != decode_layouts.AUTO:
    return config
  saved = rundir.read_config(workdir)
  if saved is not None:
    config = ml_collections.ConfigDict(config.to_dict())
    config.rollout_mesh.update(saved["config"]["rollout_mesh"])
    return config
  if jax.process_count() > 1 and jax.devices()[0].platform == "cpu":
    raise ValueError("rollout_mesh.layout='auto' on CPU processes: each measures its own rates and could choose "
                     "another layout; name the layout.")
  config, layouts = choose_layout(config, LOCAL, prompt_len=0, response_len=0)
  for t in layouts:
    logging.info("Decode layout %s on %s: %s", t.layout, t.rollout_mesh,
                 f"refused: {t.refused}" if t.refused else f"a step of {t.seconds:.4f} s predicted (rollout "
                 f"{t.rollout_s:.4f} s, reshard {t.reshard_s:.4f} s)")
  logging.info("rollout_mesh.layout='auto': decoding in the %s layout on %s.", config.rollout_mesh.layout,
               layouts[0].rollout_mesh)
  return config


def _engine_shards(config: ml_collections.ConfigDict, devices) -> int:
  """Data-parallel shards of the mesh the rollout decodes on: the run's, or rollout_mesh's over the same devices
  (rollout_mesh.layout='own') or over the generator's own (rollout_mesh.devices)."""
  generation = placement.split_devices(config, list(devices))[1]
  if generation is not None:
    config, devices = placement.generation_config(config), generation
  return sharding.data_parallel_size(sharding.make_mesh(**config.mesh, devices=devices))


def _draws(exp, lengths_B, prompt_lengths_B) -> tuple[np.ndarray, np.ndarray]:
  """(D x B response lengths, D x B prompt lengths) of `predict`'s arguments, checked against the member."""
  lengths_DxB = np.atleast_2d(lengths_B)
  prompts_DxB = (np.full_like(lengths_DxB, exp.prompt_len) if prompt_lengths_B is None
                 else np.atleast_2d(prompt_lengths_B))
  if lengths_DxB.shape[1] != exp.member.batch_size or prompts_DxB.shape != lengths_DxB.shape:
    raise ValueError(f"Response lengths of shape {lengths_DxB.shape} and prompt lengths of shape {prompts_DxB.shape} "
                     f"for a member of batch {exp.member.batch_size}: give one a rollout (B, or D x B for D draws).")
  if prompts_DxB.min() < 1 or prompts_DxB.max() > exp.prompt_len:
    raise ValueError(f"Prompt lengths must be in [1, {exp.prompt_len}] (the prompts' padded length), got "
                     f"{prompts_DxB.min()} .. {prompts_DxB.max()}.")
  return lengths_DxB, prompts_DxB


def _rollout(exp, step, inputs, timer: _Timer, lengths_DxB: np.ndarray, block: int):
  """The rollout of each draw through the engine's schedule on `block` slots, its decode steps timed at their cache
  lengths and its prefills, kernel by kernel (this CPU) taken above their best by the decode step's measured spread:
  (schedules, the mean RolloutTime, the programs timed: prefill and decode at the longest cache, the decode step's
  time by cache length, the spread)."""
  m, engine = exp.member, exp.engine
  slots = block // sharding.data_parallel_size(exp.mesh)
  knobs = _DECODE_KNOBS.format(slots=slots)
  if isinstance(inputs, str):
    raise (_refusal(inputs, f"the decode step of {slots} slots per chip (its cache)", m.batch_size, knobs)
           or ValueError(f"The decode step of {slots} slots per shard cannot be laid out: {inputs}"))
  backend = decode_roofline.resolved_backend_for(exp.mesh, engine.attention_backend)
  shape = dict(max_new_tokens=exp.response_len, prompt_len=exp.prompt_len, group_size=m.group_size, backend=backend)
  if engine.engine == "continuous":
    schedules = tuple(engine_time.continuous(d, slots=block, chunk=engine.chunk, **shape) for d in lengths_DxB)
  else:
    schedules = tuple(engine_time.static(d, slots=block, **shape) for d in lengths_DxB)
  by_length = {}

  def decode_step(length: int) -> ProgramTime:
    if length not in by_length:
      by_length[length] = timer.time(decode_roofline.lower_step(step, _at_length(inputs, length)), exp.mesh,
                                     f"the decode step of {slots} slots per chip at a cache of {length}",
                                     m.batch_size, knobs)
    return by_length[length]

  programs = dict(prefill=timer.time(_lowered("prefill", step), exp.mesh, "the prefill program", m.batch_size,
                                     knobs))
  prompts = inputs["prefix"].valid_QxP.shape[0]  # the compiled prefill's prompt rows
  # A segment (a chunk, or a static block's stretch at one bucket) is one execution of the decode loop: its setup
  # (temporaries faulted in) once, its steps each.
  timed = [s.time(lambda rows, length: decode_step(length).seconds,
                  lambda q: programs["prefill"].running(1, q / prompts),
                  segment_seconds=lambda rows, length: decode_step(length).setup_s) for s in schedules]
  rollout_spread = spread.rollout_spread(step, inputs) if timer.rates.kernel_level else 1.0
  rollout = engine_time.RolloutTime(*(rollout_spread * float(np.mean(part))
                                      for part in zip(*map(dataclasses.astuple, timed))))
  decode_step(max((s.cache_length for d in schedules for s in d.segments), default=inputs["state"].cache.length))
  programs["decode"] = by_length[max(by_length)]
  return schedules, rollout, programs, dict(sorted(by_length.items())), rollout_spread


def _learner(exp, step, timer: _Timer, lengths_DxB: np.ndarray, prompts_DxB: np.ndarray, programs: dict
             ) -> tuple[float, float, float]:
  """(score_s, reference_s, update_s) of a step: each program timed (added to `programs`) and run once per
  micro-batch the draws' sequences fill on average, the update once per update of the step."""
  m = exp.member
  for name in ("score", "reference", "update"):
    lowered = _lowered(name, step)
    if lowered is not None:
      programs[name] = timer.time(lowered, exp.mesh, f"the {name} program", m.batch_size, _LEARNER_KNOBS)
  seconds = lambda name, calls, times: programs[name].running(calls, times) if name in programs else 0.0
  mean_micro = lambda rows: float(np.mean([_micro_batches(exp, r, p, rows) for r, p in zip(lengths_DxB, prompts_DxB)]))
  scored = mean_micro(m.batch_size)
  epochs = m.updates_per_step * m.mini_batch_size / m.batch_size  # passes over the batch's mini-batches
  trained = mean_micro(m.mini_batch_size) * epochs
  return seconds("score", 1, scored), seconds("reference", 1, scored), seconds("update", m.updates_per_step, trained)


def sweep(member_config, batches, topology: str, lengths_spec: str, *, prompt_len: int, response_len: int,
          num_slices: int = 1, prompt_lengths_spec: str | None = None, samples: int = 0, layouts: bool = False
          ) -> dict[int, StepTime | DoesNotFit]:
  """Each batch's member (`member_config(batch)`: its ConfigDict) predicted on `topology`, the mean step over
  max(MIN_DRAWS, ceil(samples / B)) draws of its B response lengths from `lengths_spec` (`lengths.response_lengths`, the
  same seed for every member) and, given `prompt_lengths_spec`, of its prompts' own lengths (clipped to
  `prompt_len`; another seed), all at the rates of the first member's target (CPU rates are measured once). A
  member whose program the target cannot hold is its DoesNotFit (the others are still predicted); ValueError where
  none fits. With `layouts`, each member in the fastest of its decode layouts (`compare_layouts`)."""
  steps, rates, timer = {}, None, None
  for batch in batches:
    config = member_config(batch)
    if rates is None:
      rates = target(topology, config, num_slices)[1]
      timer = _Timer(rates)
    draws = max(MIN_DRAWS, -(-samples // batch))
    drawn = lengths.response_lengths(lengths_spec, draws * batch, response_len).reshape(draws, batch)
    prompts = None if prompt_lengths_spec is None else lengths.prompt_lengths(
        prompt_lengths_spec, draws * batch, prompt_len).reshape(draws, batch)
    try:
      compare = layouts or config.rollout_mesh.layout == decode_layouts.AUTO
      steps[batch] = (compare_layouts if compare else predict)(
          config, topology, drawn, prompt_len=prompt_len, response_len=response_len, num_slices=num_slices,
          rates=rates, timer=timer, prompt_lengths_B=prompts)
    except DoesNotFit as e:
      steps[batch] = e
      logging.warning("%s", e)
      continue
    logging.info("Batch %d: %.4f s a step predicted on %s, %.1f samples/s.", batch, steps[batch].seconds, topology,
                 steps[batch].samples_per_s)
  if all(isinstance(s, DoesNotFit) for s in steps.values()):
    raise ValueError(f"No member fits on {topology}:\n" + "\n".join(map(str, steps.values())))
  return steps
