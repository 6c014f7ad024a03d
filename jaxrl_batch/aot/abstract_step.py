"""One RL step of a config as sharded `jax.ShapeDtypeStruct`s on compile-only devices: the `Experiment`, and the
state and step parts `train.step_builder` builds for a run, built by it from abstract arrays; and what the step
holds in HBM besides a program's arguments (its residents)."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from jaxrl_batch.aot.report import per_chip_bytes
from jaxrl_batch.config import family
from jaxrl_batch.model.compute_copy import is_cast
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.runtime import sharding
from jaxrl_batch.train import placement, step_builder
from jaxrl_batch.train.setup import Experiment


def struct(shape, dtype, sharding_):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)  # dtype as given: PRNG key types too


def abstract_experiment(config: ml_collections.ConfigDict, devices, prompt_len: int, response_len: int) -> Experiment:
  """The run's `Experiment` on `devices` (its scorer None). With both lengths given, no tokenizer or task data is read
  (tokenizer and task None too); otherwise `Experiment.create` computes the lengths as the trainer does, and a given
  one replaces its value."""
  devices = placement.split_devices(config, list(devices))[0]  # The learner's.
  mesh = sharding.make_mesh(**config.mesh, devices=devices)
  data_parallel = sharding.data_parallel_size(mesh)
  member = family.member(config, data_parallel)  # Raises for a batch the mesh cannot split, before any file is read.
  tokenizer = task = chat = None
  if not (prompt_len and response_len):
    try:
      exp = Experiment.create(config, devices=devices)
    except (ValueError, FileNotFoundError, OSError) as e:
      raise ValueError(f"The trainer's prompt and response lengths need the tokenizer and the task's data ({e}); "
                       "give both lengths instead (prompt_len/response_len, or --prompt_tokens/--response_tokens)."
                       ) from None
    exp.scorer.close()
    if prompt_len in (0, exp.prompt_len) and response_len in (0, exp.response_len):
      return dataclasses.replace(exp, scorer=None)
    tokenizer, task, chat = exp.tokenizer, exp.task, exp.chat
    prompt_len, response_len = prompt_len or exp.prompt_len, response_len or exp.response_len
  return Experiment.of_lengths(config, member, mesh, prompt_len, response_len, tokenizer, task, None, chat)


@dataclasses.dataclass
class AbstractStep:
  """One RL step's state and parts as `train.step_builder.build` makes them for a run (what `train.trainer.Trainer`
  holds), from the abstract policy: sharded ShapeDtypeStructs."""
  exp: Experiment
  parts: step_builder.StepParts
  state: dict
  ref_params: dict | None  # The reference policy held beside the policy (none with adapters: the policy without them).
  sampler_params: dict  # The policy as the engines read it (`model.compute_copy`).
  # The step whose engines decode the rollout on a mesh of its own (`rollout_mesh`'s shape): over the same chips
  # (rollout_mesh.layout='own', from the policy resharded into its layout, `train.decode_layout`) or over chips of
  # its own (rollout_mesh.devices, from the policy published to them, `train.async_collector`); None: this step's.
  generation: "AbstractStep | None" = None
  # On a generation step: what else its chips hold while the engines decode (layout own: the learner's whole state;
  # chips of its own: the next policy published beside the one decoding); None: the step's own state.
  held: int | None = None
  memo: dict = dataclasses.field(default_factory=dict)  # The engine's inputs, laid out once (`engine_inputs`).

  @classmethod
  def build(cls, exp: Experiment, devices=None) -> "AbstractStep":
    """The step of `exp` (the learner's `Experiment`, `abstract_experiment`), and its generation step where the
    rollout decodes on a mesh of its own; `devices`: all the run's devices (needed with rollout_mesh.devices, whose
    last ones are the generator's)."""
    graphdef, params = exp.abstract_params(adapters=True)
    parts, state = step_builder.build(exp, graphdef, params)
    step = cls(exp, parts, state, parts.reference_policy(params), parts.sampler_policy(params))
    config = exp.config
    if config.rollout_mesh.devices and devices is None:
      raise ValueError("rollout_mesh.devices: give AbstractStep.build the run's devices (the generator's are the "
                       "last of them).")
    generation_devices = placement.split_devices(config, list(exp.mesh.devices.flat if devices is None else
                                                              devices))[1]
    if generation_devices is None:
      return step
    config = placement.generation_config(config)
    mesh = sharding.make_mesh(**config.mesh, devices=generation_devices)
    member = family.member(config, sharding.data_parallel_size(mesh))
    generation = Experiment.of_lengths(config, member, mesh, exp.prompt_len, exp.response_len, exp.tokenizer,
                                       exp.task, None, exp.chat)
    step.generation = cls.build(generation, generation_devices)
    if placement.own_layout(exp.config):  # The learner's whole state, and the next publish (asynchronous).
      learner = step.resident("params", "opt_state", "critic", "critic_opt_state", "ref")
      step.generation.held = learner + async_copy(step)
    else:
      step.generation.held = per_chip_bytes(step.generation.sampler_params)
    return step

  @property
  def engines(self) -> "AbstractStep":
    """The step whose engines decode the rollout (the generation step, or this one)."""
    return self.generation or self

  @property
  def models(self):
    """The step's model definitions (`rl.forward.ModelDefs`), static arguments of its programs."""
    return self.parts.models

  def rows(self, shape, dtype):
    """A batch-sharded struct (leading dimension over data, fsdp and expert)."""
    return struct(shape, dtype, sharding.batch_sharding(self.exp.mesh, len(shape)))

  def experts(self, rows: int):
    """experts_BxTxLxK of a mixture-of-experts policy's rollouts (None for a dense one)."""
    cfg = self.exp.model_cfg
    if not cfg.moe_layers:
      return None
    return self.rows((rows, self.length, len(cfg.moe_layers), cfg.num_experts_per_tok), jnp.int16)

  @property
  def length(self) -> int:
    return self.exp.prompt_len + self.exp.response_len

  def train_batch(self, rows: int) -> TrainBatch:
    t = self.length
    f32 = lambda: self.rows((rows, t), jnp.float32)
    return TrainBatch(self.rows((rows, t), jnp.int32), self.rows((rows, t), bool), self.rows((rows, t), bool),
                      f32(), f32(), f32(), f32(), f32(), f32(), self.experts(rows))

  def resident(self, *names) -> int:
    """Per-chip bytes of the named parts of the step's state ('ref' = the reference policy)."""
    parts = dict(self.state, ref=self.ref_params)
    return sum(per_chip_bytes(parts.get(name)) for name in names)


def carries_partial(config: ml_collections.ConfigDict) -> bool:
  """Whether the step's rollouts are partial (`train.partial`: sequences carried between steps)."""
  return config.rollout.partial


def generator_elsewhere(config: ml_collections.ConfigDict) -> str | None:
  """Why the step's generation is not compiled (it runs in a process of its own), or None."""
  rollout = config.rollout_mesh
  if rollout.process_cores:
    return (f"rollout_mesh.process_cores={rollout.process_cores!r}: generation runs in a CPU process of its own "
            "(`train.generator_process`), the weights shipped to it as host arrays")
  return None


def async_copy(step: AbstractStep) -> int:
  """Per-chip bytes of the policy's second copy in an asynchronous colocated run (rl.max_staleness > 0): the
  generator decodes with the policy published after an update (`AsyncCollector.publish`, in the compute dtype)
  while the learner holds its own; 0 otherwise. Steps queued and not started yet hold theirs too (up to
  rl.max_staleness): not counted."""
  config = step.exp.config
  if (step.exp.member.algo.max_staleness < 1 or config.rollout_mesh.devices or generator_elsewhere(config)
      or carries_partial(config)):
    return 0
  return per_chip_bytes(step.engines.sampler_params)


def _learner_policy(step: AbstractStep) -> int:
  """Per-chip bytes of the learner's policy resident while the engines decode, beside the policy they read: the whole
  policy when they read an asynchronous run's published copy; with a compute-dtype copy, the master leaves it casts
  (the others are the copy's own arrays: with LoRA's bfloat16 base, all but the adapters); 0 when they read it."""
  if async_copy(step):
    return step.resident("params")
  return cast_bytes(step)


def cast_bytes(step: AbstractStep) -> int:
  """Per-chip bytes of the policy's leaves `model.compute_copy` casts (new arrays; the others are the master's)."""
  dtype = step.exp.model_cfg.compute_dtype
  return per_chip_bytes([x for path, x in jax.tree_util.tree_leaves_with_path(step.state["params"])
                          if is_cast(path, x, dtype)])


def rollout_resident(step: AbstractStep) -> int:
  """What the learner leaves in HBM while the policy decodes (a rollout, or the evaluation): its state but the
  policy the engines read; on a generation step of its own layout, the learner's whole state (`held`)."""
  if step.held is not None:
    return step.held
  return step.resident("opt_state", "critic", "critic_opt_state", "ref") + _learner_policy(step)


def stop_ids(exp: Experiment) -> tuple[int, int]:
  """(eos_id, pad_id) the trainer passes (static arguments: any ids compile the same program without a tokenizer)."""
  return (exp.stop_id, exp.tokenizer.pad_id) if exp.tokenizer is not None else (1, 0)


def replicated_key(exp: Experiment):
  """A PRNG key, replicated (`collector.sampling_key`'s output; the evaluation's fixed keys)."""
  return struct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding.replicated(exp.mesh))
