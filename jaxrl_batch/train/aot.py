"""Compiling one RL step's programs for a TPU you do not have: memory per chip and the compiler's costs, from abstract
shapes (no weights, no data, no TPU).

`check(config, "v5p:2x2x1")` builds the run's mesh over libtpu's compile-only devices (`runtime.topologies`), the
step's state, batch and prompts as sharded `jax.ShapeDtypeStruct`s, and compiles the jitted functions the trainer
calls, with the static arguments it passes:
  update     `rl.update.update`: one optimizer step on a mini-batch, micro-batches accumulated.
  score      `rl.forward.logprobs_and_values`: the trainer's old log-probs (rl.old_logp='trainer') and the critic's
             old values.
  reference  the same function on the frozen reference policy: its log-probs (rl.kl_coef > 0).
  rollout    the static engine's `sampling.generate` (prefill and the whole decode loop), as
             `train.collector.sample_round` runs it for one block of all rows.
  prefill    the continuous engine's `sampling.continuous.prefill_prompts`: the step's Q prompts (one per group; with
             rollout.partial the call's prompt rows, `train.partial.capacity`) into the prefix store.
  decode     the continuous engine's `sampling.continuous.decode_chunk`: admission and `sampling.chunk` decode
             steps of `slots` sequences, its KV cache at the longest length (the slot cache's last bucket), or with
             sampling.page_size > 0 the paged cache's pool of `sampling.pages` pages.
  reprefill  `sampling.continuous.resume_slots`: sequences carried over (rollout.partial) or preempted (a paged pool
             smaller than every slot at the longest length) re-prefilled under new weights, at the longest bucket.
  eval_fill  the evaluation's prefill (`continuous.prefill_prompts` of the held-out prompts; continuous engine).
  eval       the evaluation's greedy pass (`train.evaluation.evaluate`): the static engine's `generate` of its
             rows (or blocks of `eval.slots` per chip), or the continuous engine's `decode_chunk` on `eval.slots`.
  publish    the asynchronous run's weight publish (rl.max_staleness > 0, colocated): the policy copied in the
             compute dtype (`model.compute_copy`), not one program, reported by its bytes per chip (no compile, no
             cost).
There is no copy of a program here: when the trainer's program changes, the check compiles the new one. A program
the config's step does not run is reported as skipped, with the reason (also a rollout mesh of its own and the
generator process: not compiled yet). The engine's inputs are laid out as the trainer's are: the prefix and the
slots come from compiling `continuous.prefill_prompts` and `continuous.slots_starter` and reading their output
shardings.

Per program and per chip: argument, output, alias and temporary bytes (`memory_analysis`), peak = arguments +
outputs - aliases + temporaries, and resident = what the step holds in HBM meanwhile that is not an argument (the
optimizer state during a rollout, the reference policy during an update, the requests during a prefill, with
rl.max_staleness > 0 colocated the second copy of the policy, and with rollout.carry_kv the slots partial rollouts
keep, their KV cache, during the score, reference and update programs). The engines and the reference policy read
the policy in the compute dtype (`model.compute_copy`: float32 master weights under bfloat16 compute cast once), so
the master weights are resident while the engines run; the cast itself is not compiled (its peak, master + copy,
is under the engines'). The verdict compares peak + resident with the
chip's HBM; an asynchronous run's generation runs beside the update, and their peaks are not added. Flops, bytes
accessed and optimal seconds are the compiler's (`cost_analysis`, per chip), and it counts the body of a loop
without its trip count: the update's figures do not grow with its micro-batches (seen equal for 4, 16 and 64 of
them), the rollout's hold the prefill and one step per decode segment, a decode chunk's one step; and it counts no
flops inside Pallas kernels (splash attention). Compare them between settings of equal micro-batch count and
attention, not as the time of a step. A plan too big for HBM is a compile error on TPU: it is reported as not
fitting, with the figures of the compiler's message.
"""
import dataclasses
import datetime
import functools
import math
import re
import time
import types

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from jaxrl_batch.config import family
from jaxrl_batch.config.optim import make_optimizer
from jaxrl_batch.model import ModelConfig, lora
from jaxrl_batch.model.compute_copy import abstract_compute_copy, casts_any, is_cast
from jaxrl_batch.model.value_head import ValueHead, ValueModel
from jaxrl_batch.rl import critic as critic_lib
from jaxrl_batch.rl import forward, learner, update
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.runtime import sharding, topologies
from jaxrl_batch.sampling import EngineSettings, Strategy, continuous, generate
from jaxrl_batch.sampling.generate import cache_buckets
from jaxrl_batch.train import collector, evaluation, partial
from jaxrl_batch.train.setup import Experiment, packing_for

PROGRAMS = ("update", "score", "reference", "rollout", "prefill", "decode", "reprefill", "eval_fill", "eval",
            "publish")
# The function each program compiles (the rollout's: `sampling.generate` itself when it runs in blocks of slots; the
# eval's: `continuous.decode_chunk` with the continuous engine). The publish is no program: the copy of its bytes.
FUNCTIONS = dict(update="jaxrl_batch.rl.update.update", score="jaxrl_batch.rl.forward.logprobs_and_values",
                 reference="jaxrl_batch.rl.forward.logprobs_and_values",
                 rollout="jaxrl_batch.train.collector.sample_round",
                 prefill="jaxrl_batch.sampling.continuous.prefill_prompts",
                 decode="jaxrl_batch.sampling.continuous.decode_chunk",
                 reprefill="jaxrl_batch.sampling.continuous.resume_slots",
                 eval_fill="jaxrl_batch.sampling.continuous.prefill_prompts",
                 eval="jaxrl_batch.sampling.generate.generate",
                 publish="jaxrl_batch.train.async_collector.AsyncCollector._publish")
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
  created: str = dataclasses.field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))

  def program(self, name: str) -> ProgramReport:
    return next(p for p in self.programs if p.name == name)

  def to_json(self) -> dict:
    """The aot_check.json contract (docs/scaling.md lists every field)."""
    return dict(schema_version=SCHEMA_VERSION, created=self.created, topology=self.topology, mesh=self.mesh,
                run=self.run, programs=[dataclasses.asdict(p) for p in self.programs])

  def table(self) -> str:
    """A fixed-width table of the programs, sizes in GiB per chip, then one verdict line each."""
    head = ("program", "args", "out", "alias", "temp", "peak", "resid", "HBM", "TFLOP", "GB acc", "opt s",
            "compile s")
    fmt = "{:<10}" + "{:>10}" * (len(head) - 1)
    gib = lambda x: "-" if x is None else f"{x / GIB:.2f}"
    num = lambda x, scale, digits: "-" if x is None else f"{x / scale:.{digits}f}"
    if self.topology.get("platform", "tpu") == "tpu":
      title = (f"{self.topology['name']} x {self.topology['num_slices']} slice(s): {self.topology['num_chips']} "
               f"chips ({self.topology['device_kind']}), mesh {self.mesh}; sizes in GiB per chip")
    else:  # GPU nodes: HBM is the allocator's share of the device; no cost analysis.
      title = (f"{self.topology['name']} x {self.topology['num_slices']} node(s): {self.topology['num_chips']} GPUs "
               f"({self.topology['device_kind']}), mesh {self.mesh}; sizes in GiB per GPU, HBM = "
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


def _struct(shape, dtype, sharding_):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)  # dtype as given: PRNG key types too


def abstract_experiment(config: ml_collections.ConfigDict, devices, prompt_len: int, response_len: int) -> Experiment:
  """The run's `Experiment` on `devices` (its scorer None). With both lengths given, no tokenizer or task data is read
  (tokenizer and task None too); otherwise `Experiment.create` computes the lengths as the trainer does, and a given
  one replaces its value."""
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
  # The rest as `Experiment.create` derives it from the lengths.
  if member.algo.loss_agg == "constant" and not member.algo.loss_agg_constant:
    member = dataclasses.replace(member, algo=dataclasses.replace(member.algo, loss_agg_constant=float(response_len)))
  packing = packing_for(config.micro_batch_tokens, prompt_len + response_len, data_parallel)
  return Experiment(config, member, mesh, tokenizer, task, None, ModelConfig.from_config(config.model), prompt_len,
                    response_len, chat, packing, lora.LoRAConfig.from_config(config.lora))


def _abstract_critic(exp: Experiment):
  """(graphdef, abstract params) of the critic `rl.critic.init_critic` creates (its copies of the policy's
  parameters keep their shapes and shardings)."""
  cfg, algo = exp.model_cfg, exp.member.algo
  if algo.share_backbone:
    module_fn = lambda: ValueHead(cfg.d_model, cfg.weight_dtype, nnx.Rngs(0))
  else:
    module_fn = lambda: ValueModel(critic_lib.critic_model_config(cfg, algo.critic_layers), nnx.Rngs(0))
  return sharding.abstract_sharded(module_fn, exp.mesh, exp.config.sharding_rules)


def _abstract_opt_state(tx: optax.GradientTransformation, params, mesh):
  """The optimizer state `tx.init(params)` makes under the mesh: moments sharded like their parameters, counters
  replicated."""
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(tx.init, params)
  return optax.tree_utils.tree_map_params(
      tx, lambda s, p: _struct(s.shape, s.dtype, p.sharding), shapes, params,
      transform_non_params=lambda s: _struct(s.shape, s.dtype, sharding.replicated(mesh)))


@dataclasses.dataclass
class AbstractStep:
  """The abstract pieces of one RL step (what `train.trainer.Trainer` holds), as sharded ShapeDtypeStructs."""
  exp: Experiment
  models: forward.ModelDefs
  state: dict
  ref_params: dict | None
  sampler_params: dict  # The policy as the engines read it (`model.compute_copy`): the master weights or a copy.
  memo: dict = dataclasses.field(default_factory=dict)  # The engine's inputs, laid out once (`engine_inputs`).

  @classmethod
  def build(cls, exp: Experiment) -> "AbstractStep":
    m, config = exp.member, exp.config
    graphdef, params = exp.abstract_params(adapters=True)
    actor = make_optimizer(config.optim, m.batch_size, m.sample_budget, m.updates_per_step, (m.actor_lr, m.actor_adam))
    state = dict(params=params, opt_state=_abstract_opt_state(actor.tx, lora.trainable(params), exp.mesh))
    critic_graphdef = critic_tx = None
    if m.algo.critic:
      critic_tx = make_optimizer(config.critic.optim, m.batch_size, m.sample_budget, m.updates_per_step,
                                 (m.critic_lr, m.critic_adam)).tx
      critic_graphdef, state["critic"] = _abstract_critic(exp)
      state["critic_opt_state"] = _abstract_opt_state(critic_tx, state["critic"], exp.mesh)
    models = forward.ModelDefs(graphdef, actor.tx, critic_graphdef, critic_tx)
    dtype = exp.model_cfg.compute_dtype
    sampler = abstract_compute_copy(params, dtype) if casts_any(params, dtype) else params
    # The reference policy held beside the policy (none with adapters: it is the policy without them).
    ref = abstract_compute_copy(params, dtype) if m.algo.use_kl and exp.lora is None else None
    return cls(exp, models, state, ref, sampler)

  def rows(self, shape, dtype):
    """A batch-sharded struct (leading dimension over data, fsdp and expert)."""
    return _struct(shape, dtype, sharding.batch_sharding(self.exp.mesh, len(shape)))

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


def _program_update(step: AbstractStep):
  exp, m = step.exp, step.exp.member
  algo = m.algo
  batch = step.train_batch(m.mini_batch_size)
  needs_ids = learner.needs_ids(algo, m.group_size, m.mini_batch_size, m.num_micro, exp.packing)
  noise_ids = step.rows((m.mini_batch_size, 2), jnp.int32) if needs_ids else None
  kl_coef = _struct((), jnp.float32, sharding.replicated(exp.mesh))
  resident = step.resident("ref") + _async_copy(step) + _kept_slots(step)
  if algo.updates_per_step > 1:  # The step's whole batch stays while its mini-batches are trained on.
    resident += per_chip_bytes(step.train_batch(m.batch_size))
  if exp.packing is None:
    shape = (f"mini-batch {m.mini_batch_size} x {step.length} tokens in {m.num_micro} micro-batch(es) of "
             f"{m.micro_batch_size}")
  else:
    shape = (f"mini-batch {m.mini_batch_size} x {step.length} tokens packed in rows of {exp.packing.length}, "
             f"{exp.packing.rows} rows per micro-batch")
  args = (step.state, batch, kl_coef, noise_ids)
  kwargs = dict(models=step.models, cfg=algo, num_micro=m.num_micro, train_actor=True, packing=exp.packing)
  return update.update, args, kwargs, resident, shape


def _program_score(step: AbstractStep):
  exp, m = step.exp, step.exp.member
  algo = m.algo
  need_policy = algo.old_logp == "trainer"
  if not (need_policy or algo.critic):
    return "rl.old_logp='sampler' without a critic: the trainer's score call computes nothing"
  b = m.batch_size
  args = (step.state["params"], step.state.get("critic"), step.rows((b, step.length), jnp.int32),
          step.rows((b, step.length), bool), step.rows((b, step.length), bool), step.experts(b))
  kwargs = dict(models=step.models, cfg=algo, need_policy=need_policy, packing=exp.packing,
                num_micro=m.score_num_micro)
  resident = step.resident("opt_state", "critic_opt_state", "ref") + _async_copy(step) + _kept_slots(step)
  return forward.logprobs_and_values, args, kwargs, resident, _forward_shape(step, b)


def _program_reference(step: AbstractStep):
  exp, m = step.exp, step.exp.member
  if not m.algo.use_kl:
    return "rl.kl_coef=0: no KL term, no reference policy"
  b = m.batch_size
  policy, held = step.ref_params, ("params", "opt_state", "critic", "critic_opt_state")
  if policy is None:  # LoRA: the policy without its adapters' updates (`lora.base_policy`): the policy's arrays.
    policy, held = step.state["params"], held[1:]
  args = (policy, None, step.rows((b, step.length), jnp.int32), step.rows((b, step.length), bool),
          step.rows((b, step.length), bool))
  kwargs = dict(models=forward.ModelDefs(step.models.graphdef), cfg=forward.reference_cfg(m.algo),
                packing=exp.packing, num_micro=m.score_num_micro)
  resident = step.resident(*held) + _async_copy(step) + _kept_slots(step)
  return forward.logprobs_and_values, args, kwargs, resident, _forward_shape(step, b)


def _forward_shape(step: AbstractStep, rows: int) -> str:
  packing, num_micro = step.exp.packing, step.exp.member.score_num_micro
  if packing is None:
    return f"batch {rows} x {step.length} tokens in {num_micro} forward(s) of {rows // num_micro}"
  return f"batch {rows} x {step.length} tokens packed, {packing.rows} rows of {packing.length} per micro-batch"


def _program_rollout(step: AbstractStep):
  exp, m = step.exp, step.exp.member
  engine, config = exp.engine, exp.config
  elsewhere = _generator_elsewhere(config)
  if elsewhere:
    return elsewhere
  if _partial(config):
    return "rollout.partial: the continuous engine's programs run (prefill, decode, reprefill)"
  if engine.engine != "static":
    return f"sampling.engine={engine.engine!r}: its programs are prefill and decode"
  slots = engine.slots * sharding.data_parallel_size(exp.mesh)
  rows = slots if slots and slots < m.batch_size else m.batch_size
  eos_id, pad_id = _stop_ids(exp)
  kwargs = dict(max_new_tokens=exp.response_len, eos_id=eos_id, pad_id=pad_id, sampling=exp.strategy,
                group_size=m.group_size, attention_backend=engine.attention_backend)
  prompts = (step.rows((rows, exp.prompt_len), jnp.int32), step.rows((rows, exp.prompt_len), bool))
  if rows == m.batch_size:  # One block of all rows: the collector's own program.
    fn = collector.sample_round
    key = _struct((3,), jnp.int32, sharding.replicated(exp.mesh))  # `streams.sampling_key_data`
  else:  # Blocks of `slots` rows, each a call of `generate` (`sampling.engine.rollout`).
    fn, key = generate, _struct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding.replicated(exp.mesh))
  args = (step.models.graphdef, step.sampler_params, *prompts, key)
  resident = _rollout_resident(step)
  shape = (f"{rows} rows x {exp.prompt_len} prompt tokens (one prefill per group of {m.group_size}), up to "
           f"{exp.response_len} new tokens")
  return fn, args, kwargs, resident, shape


def _partial(config: ml_collections.ConfigDict) -> bool:
  return config.rollout.partial


def _generator_elsewhere(config: ml_collections.ConfigDict) -> str | None:
  """Why the step's generation is not compiled on this mesh (a rollout mesh or a process of its own), or None."""
  rollout = config.rollout_mesh
  if rollout.process_cores:
    return (f"rollout_mesh.process_cores={rollout.process_cores!r}: generation runs in a CPU process of its own "
            "(`train.generator_process`), the weights shipped to it as host arrays")
  if rollout.devices:
    return (f"rollout_mesh.devices={rollout.devices} (generation on chips of its own) is not compiled yet: the "
            "check builds one mesh over every chip")
  return None


def _async_copy(step: AbstractStep) -> int:
  """Per-chip bytes of the policy's second copy in an asynchronous colocated run (rl.max_staleness > 0): the
  generator decodes with the policy published after an update (`AsyncCollector._publish`, in the compute dtype)
  while the learner holds its own; 0 otherwise. Steps queued and not started yet hold theirs too (up to
  rl.max_staleness): not counted."""
  config = step.exp.config
  if step.exp.member.algo.max_staleness < 1 or _generator_elsewhere(config) or _partial(config):
    return 0
  return per_chip_bytes(step.sampler_params)


def _kept_slots(step: AbstractStep) -> int:
  """Per-chip bytes of the engine's slots that partial rollouts keep across the update (rollout.carry_kv: the slot
  cache and its counters stay on the chips while the learner scores and trains, `continuous.KeptSlots`); 0 without
  carry_kv, or where the engine's inputs do not lay out (its programs then say why)."""
  config = step.exp.config
  if not (_partial(config) and config.rollout.carry_kv):
    return 0
  inputs = engine_inputs(step, False)
  return 0 if isinstance(inputs, str) else per_chip_bytes(inputs["state"])


def _learner_policy(step: AbstractStep) -> int:
  """Per-chip bytes of the learner's policy resident while the engines decode, beside the policy they read: the whole
  policy when they read an asynchronous run's published copy; with a compute-dtype copy, the master leaves it casts
  (the others are the copy's own arrays: with LoRA's bfloat16 base, all but the adapters); 0 when they read it."""
  if _async_copy(step):
    return step.resident("params")
  if step.sampler_params is step.state["params"]:
    return 0
  dtype = step.exp.model_cfg.compute_dtype
  return per_chip_bytes([x for path, x in jax.tree_util.tree_leaves_with_path(step.state["params"])
                          if is_cast(path, x, dtype)])


def _rollout_resident(step: AbstractStep) -> int:
  """What the learner leaves in HBM while the policy decodes (a rollout, or the evaluation): its state but the
  policy the engines read."""
  return step.resident("opt_state", "critic", "critic_opt_state", "ref") + _learner_policy(step)


def _stop_ids(exp: Experiment) -> tuple[int, int]:
  """(eos_id, pad_id) the trainer passes (static arguments: any ids compile the same program without a tokenizer)."""
  return (exp.stop_id, exp.tokenizer.pad_id) if exp.tokenizer is not None else (1, 0)


def _key(exp: Experiment):
  """A PRNG key, replicated (`collector.sampling_key`'s output; the evaluation's fixed keys)."""
  return _struct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding.replicated(exp.mesh))


def _eval_rows(step: AbstractStep) -> int | str:
  """Rows of the evaluation's greedy pass: the held-out problems (the task's; without its data, task.num_eval, an
  upper bound with task.eval_path), padded to the data-parallel size as `evaluation.evaluate` pads them; or why
  they are unknown."""
  exp = step.exp
  if exp.task is not None:
    n = len(exp.task.eval_problems())
  else:
    n = exp.config.task.get("num_eval", 0)
    if not n:
      return ("the held-out set's size needs the task's data (the config has no task.num_eval): give no lengths, or "
              "set task.num_eval")
  return n + min(n, -n % sharding.data_parallel_size(exp.mesh))  # problems + problems[:-n % dp]


@dataclasses.dataclass(frozen=True)
class _Call:
  """One call of the continuous engine (`continuous.decode`) as the trainer makes it: `prompts` (Q) prompt rows
  prefilled, `requests` (R) decoded on `slots` (S, all chips) by `sampling` with `engine`, groups of `group_size`
  requests sharing a prompt; `carried`: partial rollouts (`train.partial`: prompts uploaded replicated, sequences
  carried)."""
  what: str
  sampling: Strategy
  engine: EngineSettings
  prompts: int
  requests: int
  slots: int
  group_size: int
  carried: bool


def _engine_call(step: AbstractStep, evaluating: bool) -> _Call | str:
  """The engine's call for the step's rollout (`Collector`, `PartialCollector`) or, `evaluating`, for the
  evaluation's greedy pass; or why the continuous engine does not run it on this mesh."""
  exp, m, config = step.exp, step.exp.member, step.exp.config
  dp = sharding.data_parallel_size(exp.mesh)
  if evaluating:
    rows = _eval_rows(step)
    if isinstance(rows, str):
      return rows
    engine = evaluation.engine_for(exp, evaluation.EvalConfig.from_config(config))
    call = _Call("the evaluation's greedy pass", Strategy(temperature=0.0), engine, rows, rows, engine.slots or rows,
                 1, False)
  else:
    elsewhere = _generator_elsewhere(config)
    if elsewhere:
      return elsewhere
    engine = exp.engine
    slots = engine.slots * dp or m.batch_size
    if _partial(config):
      requests, prompts = partial.capacity(slots, m.batch_size, m.num_prompts, config.rollout.max_lookahead)
      call = _Call("partial rollouts", exp.strategy, engine, prompts, requests, slots, m.group_size, True)
    else:
      call = _Call("the step's rollout", exp.strategy, engine, m.num_prompts, m.batch_size, slots, m.group_size,
                   False)
  if call.engine.engine != "continuous":
    if call.carried:
      return "rollout.partial needs sampling.engine='continuous' (the trainer refuses this config)"
    return (f"sampling.engine={call.engine.engine!r}: the {'evaluation' if evaluating else 'rollout'} is one "
            f"program, `{'eval' if evaluating else 'rollout'}`")
  if call.engine.page_size and exp.mesh.size > 1:
    return (f"sampling.page_size={call.engine.page_size} (a paged KV cache) decodes on one device: the trainer "
            f"refuses this mesh of {exp.mesh.size} chips")
  return call


def _laid_out(step: AbstractStep, fn, *args, **kwargs):
  """The outputs of jitted `fn` on `args` as the trainer holds them: sharded structs with the shapes, dtypes and
  shardings of its compiled program's outputs; or, where it does not compile, a str saying so."""
  try:
    with jax.set_mesh(step.exp.mesh):
      out = fn.lower(*args, **kwargs).compile().out_info
  except Exception as e:  # pylint: disable=broad-except  # The program that needs these inputs is skipped, saying why.
    name = getattr(fn, "__name__", "the program that makes them")
    return f"its inputs come from {name}, which did not compile: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return jax.tree.map(lambda x: _struct(x.shape, x.dtype, x.sharding), out)


def _engine_prompts(step: AbstractStep, call: _Call):
  """(prompt_QxP, valid_QxP, requests) as `continuous.decode` receives them; a str where they cannot be laid out."""
  exp, c = step.exp, call.engine.page_size
  p = exp.prompt_len + (-exp.prompt_len % c if c else 0)  # A paged cache's prompts are left-padded to whole pages.
  rows = functools.partial(sharding.batch_sharding, exp.mesh)
  if call.carried:  # `PartialCollector` uploads the call's prompt rows replicated.
    layout = sharding.replicated(exp.mesh)
  elif call.group_size == 1:  # The batch-sharded rows themselves (prompt_BxP[::1] is prompt_BxP).
    layout = rows(2)
  else:  # One row per group, as `generate_continuous` slices the step's rows: prompt_BxP[::G].
    sliced = _laid_out(step, jax.jit(lambda x: x[::call.group_size]),
                       step.rows((call.requests, exp.prompt_len), jnp.int32))
    if isinstance(sliced, str):
      return sliced
    layout = sliced.sharding
  r, n = call.requests, exp.response_len
  i32 = lambda *shape: _struct(shape, jnp.int32, rows(len(shape)))
  requests = continuous.Requests(i32(r), i32(r), i32(r), i32(r, n), _struct((r, n), jnp.float32, rows(2)), i32(r))
  return _struct((call.prompts, p), jnp.int32, layout), _struct((call.prompts, p), bool, layout), requests


def engine_inputs(step: AbstractStep, evaluating: bool) -> dict | str:
  """Every argument of the engine's chunk, laid out as the trainer's are (the prefix by compiling
  `continuous.prefill_prompts`, the slots and outputs by compiling `continuous.slots_starter`), with the cache at
  its longest: the slot cache's last bucket, or the paged cache's whole pool and every slot's longest page row.
  Memoised on the step; a str where the engine does not run or its inputs do not compile."""
  key = ("engine", evaluating)
  if key in step.memo:
    return step.memo[key]
  step.memo[key] = call = _engine_call(step, evaluating)
  prompts = call if isinstance(call, str) else _engine_prompts(step, call)
  if isinstance(prompts, str):
    step.memo[key] = prompts
    return prompts
  exp, engine = step.exp, call.engine
  prompt_QxP, valid_QxP, requests = prompts
  prefix = _laid_out(step, continuous.prefill_prompts, step.models.graphdef, step.sampler_params, prompt_QxP, valid_QxP)
  if isinstance(prefix, str):
    step.memo[key] = prefix
    return prefix
  layers, moe = len(prefix.cache.k_layers), prefix.experts_QxPxLxK is not None
  n, c, s, p = exp.response_len, engine.page_size, call.slots, prompt_QxP.shape[1]
  if c:
    own = -(-(n - 1) // c)  # Own pages of a sequence at the longest length.
    pool, length = engine.pages or s * own, 0
    if pool < own:
      step.memo[key] = f"sampling.pages={pool} cannot hold one sequence of {n - 1} tokens: the engine refuses it"
      return step.memo[key]
    start = continuous.slots_starter(s, 0, layers, None, pool, c, moe)
  else:
    own = pool = 0
    with jax.set_mesh(exp.mesh):  # "auto" stands for the backend of the mesh's chips.
      length = cache_buckets(p, n, engine.backend)[-1]
    start = continuous.slots_starter(s, length, layers, functools.partial(sharding.batch_sharding, exp.mesh), moe=moe,
                                     heads=prefix.cache.k_layers[0].shape[1])
  started = _laid_out(step, start, prefix, requests)
  if isinstance(started, str):
    step.memo[key] = started
    return started
  state, outputs = started
  live = state.live_S.sharding  # The per-chunk uploads (`transfer.to_device("admit", ...)`) take the slots' layout.
  step.memo[key] = dict(
      call=call, requests=requests, state=state, outputs=outputs, key=_key(exp), length=length, pool=pool,
      own_pages=own, prefix=prefix._replace(cache=None) if c else prefix,  # A paged prefix lives in the pool.
      slots_S=_struct((s,), jnp.int32, live), own_SxM=_struct((s, own), jnp.int32, live) if c else None)
  return step.memo[key]


def _engine_shape(step: AbstractStep, inputs: dict) -> str:
  call, p = inputs["call"], step.exp.prompt_len
  c = call.engine.page_size
  if c:
    cache = (f"a paged cache of {inputs['pool']} pages of {c} positions (+ {call.prompts * -(-p // c)} prompt pages "
             "and the trash page)")
  else:
    cache = f"a slot cache of {inputs['length']} positions"
  return (f"{call.what}: {call.slots} slots, {cache}, {call.requests} requests of up to {step.exp.response_len} "
          f"tokens, chunks of {call.engine.chunk} decode steps")


def _program_prefill(step: AbstractStep, evaluating: bool = False):
  call = _engine_call(step, evaluating)
  prompts = call if isinstance(call, str) else _engine_prompts(step, call)
  if isinstance(prompts, str):
    return prompts
  prompt_QxP, valid_QxP, requests = prompts
  args = (step.models.graphdef, step.sampler_params, prompt_QxP, valid_QxP)
  resident = _rollout_resident(step) + per_chip_bytes(requests)  # The requests exist before the prefill.
  shape = (f"{call.what}: {call.prompts} prompts x {prompt_QxP.shape[1]} tokens, for {call.requests} requests on "
           f"{call.slots} slots")
  return continuous.prefill_prompts, args, {}, resident, shape


def _program_decode(step: AbstractStep, evaluating: bool = False):
  inputs = engine_inputs(step, evaluating)
  if isinstance(inputs, str):
    return inputs
  call = inputs["call"]
  args = (step.models.graphdef, step.sampler_params, inputs["state"], inputs["outputs"], inputs["prefix"],
          inputs["requests"], inputs["slots_S"], inputs["key"], inputs["own_SxM"])
  kwargs = dict(steps=call.engine.chunk, eos_id=_stop_ids(step.exp)[0], sampling=call.sampling,
                attention_backend=call.engine.attention_backend)
  return continuous.decode_chunk, args, kwargs, _rollout_resident(step), _engine_shape(step, inputs)


def _program_reprefill(step: AbstractStep):
  exp = step.exp
  call = _engine_call(step, False)
  if isinstance(call, str):
    return call
  n, c, pages = exp.response_len, call.engine.page_size, call.engine.pages
  short = c and pages and pages < call.slots * -(-(n - 1) // c)  # Preemption: some sequences give their pages back.
  if not (call.carried or short):
    return ("no sequence is re-prefilled: no partial rollouts (rollout.partial) and no paged pool short of every "
            "slot at the longest length (sampling.pages)")
  if n < 2:
    return "a response budget of one token: no sequence is ever carried"
  inputs = engine_inputs(step, False)
  if isinstance(inputs, str):
    return inputs
  fed = continuous.fed_bucket(n - 1, n)  # The longest re-prefill: a sequence one token short of the budget.
  args = (step.models.graphdef, step.sampler_params, inputs["state"], inputs["outputs"], inputs["prefix"],
          inputs["requests"], inputs["slots_S"], inputs["own_SxM"])
  shape = f"{_engine_shape(step, inputs)}; {fed} tokens re-fed per slot"
  if call.carried and not short and exp.config.rollout.carry_kv:  # Carried sequences keep their caches.
    shape += "; rollout.carry_kv: runs on resume only"
  return continuous.resume_slots, args, dict(fed=fed), _rollout_resident(step), shape



def _program_eval_fill(step: AbstractStep):
  return _program_prefill(step, evaluating=True)


def _program_eval(step: AbstractStep):
  exp = step.exp
  rows = _eval_rows(step)
  if isinstance(rows, str):
    return rows
  settings = evaluation.EvalConfig.from_config(exp.config)
  engine = evaluation.engine_for(exp, settings)
  if engine.engine == "continuous":
    return _program_decode(step, evaluating=True)
  slots = engine.slots
  if slots and (rows % slots or slots % max(settings.num_samples, 1)):
    return (f"eval.slots={settings.slots}: the static engine's blocks of {slots} rows must divide the {rows} held-out "
            "rows (and be a multiple of eval.num_samples): the trainer refuses this config")
  block = min(slots or rows, rows)
  eos_id, pad_id = _stop_ids(exp)
  kwargs = dict(max_new_tokens=exp.response_len, eos_id=eos_id, pad_id=pad_id, sampling=Strategy(temperature=0.0),
                group_size=1, attention_backend=engine.attention_backend)
  args = (step.models.graphdef, step.sampler_params, step.rows((block, exp.prompt_len), jnp.int32),
          step.rows((block, exp.prompt_len), bool), _key(exp))
  shape = (f"the evaluation's greedy pass: {rows} held-out rows in blocks of {block} x {exp.prompt_len} prompt "
           f"tokens, up to {exp.response_len} new tokens")
  return generate, args, kwargs, _rollout_resident(step), shape


@dataclasses.dataclass(frozen=True)
class _Copy:
  """A copy the step makes without a program of ours (the weight publish): its bytes per chip (source, copy), what
  stays resident meanwhile, and how it is made; judged like a compiled program's memory."""
  source_bytes: int
  copy_bytes: int
  resident: int
  shape: str
  how: str

  def stats(self):
    """`memory_analysis`'s fields for it: the source is the argument, the copy the output."""
    return types.SimpleNamespace(argument_size_in_bytes=self.source_bytes, output_size_in_bytes=self.copy_bytes,
                                 alias_size_in_bytes=0, temp_size_in_bytes=0)


def _program_publish(step: AbstractStep):
  exp, config = step.exp, step.exp.config
  if exp.member.algo.max_staleness < 1:
    return "rl.max_staleness=0: generation uses the learner's own policy, nothing is published"
  if _partial(config):
    return "rollout.partial with rl.max_staleness > 0: the trainer refuses this config"
  elsewhere = _generator_elsewhere(config)
  if elsewhere:
    return elsewhere
  params, copy = per_chip_bytes(step.state["params"]), per_chip_bytes(step.sampler_params)
  shape = (f"the policy's {exp.model_cfg.num_params() / 1e6:.1f}M parameters ({params / GIB:.3f} GiB per chip) copied "
           f"on the learner's chips in {exp.model_cfg.dtype} ({copy / GIB:.3f} GiB per chip)")
  how = ("`AsyncCollector._publish` copies each parameter in the compute dtype (`model.compute_copy`: `astype`, or "
         "`jnp.copy`): no program of ours, so no compile and no cost")
  # Meanwhile: the learner's state but the policy copied, and the generator's previous copy.
  resident = step.resident("opt_state", "critic", "critic_opt_state", "ref") + _async_copy(step)
  return _Copy(params, copy, resident, shape, how)


BUILDERS = dict(update=_program_update, score=_program_score, reference=_program_reference, rollout=_program_rollout,
                prefill=_program_prefill, decode=_program_decode, reprefill=_program_reprefill,
                eval_fill=_program_eval_fill, eval=_program_eval, publish=_program_publish)


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


def _knobs(name: str, exp: Experiment) -> list[str]:
  """Settings that lower this program's memory per chip, each with its current value."""
  config, m, cfg = exp.config, exp.member, exp.model_cfg
  dp = sharding.data_parallel_size(exp.mesh)
  mesh = (f"mesh (now data={exp.mesh.shape['data']}, fsdp={exp.mesh.shape['fsdp']}, "
          f"tensor={exp.mesh.shape['tensor']}): more fsdp or tensor shards the parameters further")
  budget = "the response budget (task.max_response_tokens)"
  if name == "rollout":
    return [f"sampling.slots (now {exp.engine.slots}; sequences decoded at once per chip)", budget, mesh]
  if name in ("decode", "reprefill"):
    c = exp.engine.page_size
    pages = (f"sampling.pages (now {exp.engine.pages}; the paged pool per chip, 0 = every slot at the longest "
             "length)" if c else "sampling.page_size (now 0; > 0 pages the cache: memory follows the live tokens)")
    return [f"sampling.slots (now {exp.engine.slots}; sequences in flight per chip)", pages, budget, mesh]
  if name == "eval":
    return [f"eval.slots (now {evaluation.EvalConfig.from_config(config).slots}; held-out sequences decoded at once "
            "per chip, 0 = all)", budget, mesh]
  if name == "prefill":
    ahead = (f"; rollout.max_lookahead (now {config.rollout.max_lookahead}) adds a step's prompts each"
             if _partial(config) else "")
    return [f"the prompts prefilled at once (now {m.num_prompts} per step{ahead})", mesh]
  if name == "eval_fill":
    return ["task.num_eval (the held-out prompts, prefilled at once)", mesh]
  if name == "publish":
    return [f"rl.max_staleness (now {m.algo.max_staleness}; 0 = no second copy of the policy)", mesh]
  knobs = []
  if exp.packing is not None:
    knobs.append(f"micro_batch_tokens (now {config.micro_batch_tokens})")
  elif name == "update" and m.micro_batch_size > dp:
    knobs.append(f"micro_batch_size (now {m.micro_batch_size}; e.g. {max(dp, m.micro_batch_size // 2)})")
  elif name != "update":
    knobs.append(f"score_micro_batch_size (now {config.score_micro_batch_size}; rows per forward, 0 = "
                 f"the whole batch; e.g. {max(dp, m.micro_batch_size)})")
  if name == "update" and cfg.remat == "none":
    knobs.append("model.remat (now 'none'; 'block' keeps only each block's input for the backward pass)")
  if cfg.attention == "dense":
    knobs.append("model.attention (now 'dense'; 'auto' = splash on TPU, no T x T scores)")
  chunked = 0 < cfg.logits_chunk < exp.prompt_len + exp.response_len - 1
  knobs.append(f"model.logits_chunk (now {cfg.logits_chunk}; " + (
      "smaller = fewer float32 logits at once)" if chunked else "e.g. 1024: float32 logits a chunk at a time)"))
  return knobs + [mesh]


def _memory(stats, resident: int, hbm: int) -> Memory:
  args, out, alias, temp = (stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                            stats.temp_size_in_bytes)
  peak = args + out - alias + temp
  return Memory(args, out, alias, temp, peak, resident, peak + resident, hbm, 1.0 - (peak + resident) / hbm)


def _compile_one(name: str, step: AbstractStep, hbm: int) -> ProgramReport:
  built = BUILDERS[name](step)
  report = ProgramReport(name, FUNCTIONS[name], "skipped")
  if isinstance(built, str):
    report.verdict = f"skipped: {built}"
    return report
  if isinstance(built, _Copy):  # No program of ours: its bytes, judged as a program's memory.
    report.shape, report.message = built.shape, built.how
    report.memory = _memory(built.stats(), built.resident, hbm)
    report = _judge(report, name, step.exp, hbm)
    report.verdict += " (not compiled: the bytes it copies)"
    return report
  fn, args, kwargs, resident, report.shape = built
  report.function = f"{fn.__module__}.{fn.__name__}"
  start = time.perf_counter()
  try:
    with jax.set_mesh(step.exp.mesh):
      compiled = fn.lower(*args, **kwargs).compile()
  except Exception as e:  # pylint: disable=broad-except  # Out of memory, or a program that does not build: reported.
    report.compile_seconds = time.perf_counter() - start
    oom = parse_oom(str(e))
    if oom is None:
      report.status, report.message = "error", f"{type(e).__name__}: {e}"
      report.verdict = f"error: {report.message.splitlines()[0][:200]}"
      return report
    need, have = oom
    report.status, report.message = "does_not_fit", str(e).splitlines()[0]
    report.memory = Memory(None, None, None, need, None, resident, None, have, None)
    report.verdict = (f"does not fit: the compiler needs {need / GIB:.2f} GiB of temporaries per chip, "
                      f"{have / GIB:.2f} GiB available")
    report.knobs = _knobs(name, step.exp)
    return report
  report.compile_seconds = time.perf_counter() - start
  report.memory = _memory(compiled.memory_analysis(), resident, hbm)
  report.cost = cost_of(compiled)
  return _judge(report, name, step.exp, hbm)


def _judge(report: ProgramReport, name: str, exp: Experiment, hbm: int) -> ProgramReport:
  """The report's status, verdict and (below 10% headroom) knobs from its memory."""
  m = report.memory
  if m.total_bytes <= hbm:
    report.status = "fits"
    report.verdict = (f"fits with {100 * m.headroom_frac:.0f}% headroom ({m.total_bytes / GIB:.2f} of "
                      f"{hbm / GIB:.2f} GiB)")
  else:
    report.status = "does_not_fit"
    report.verdict = f"does not fit: {m.total_bytes / GIB:.2f} GiB per chip, {hbm / GIB:.2f} GiB of HBM"
  if m.headroom_frac < 0.1:
    report.knobs = _knobs(name, exp)
  return report


def check(config: ml_collections.ConfigDict, topology: str, num_slices: int = 1, programs=PROGRAMS,
          prompt_len: int = 0, response_len: int = 0, log=None) -> Report:
  """Compiles `programs` (names in PROGRAMS) of one RL step of `config` for `num_slices` slices of TPU `topology`
  ('v5p:2x2x1', 'v5e:2x2', 'v6e:4x4'), or for `num_slices` nodes of GPUs ('h100:8': 8 H100s per node; h200, a100),
  with the config's mesh over its chips, and reports each one's memory and costs per chip.

  GPUs (`runtime.topologies.compile_only_gpu`): XLA's GPU compiler, without autotuning (no device to time kernels
  on), counting cuDNN workspaces as 0. It does not refuse a plan larger than the device: the verdict compares the
  plan with the memory JAX's allocator would have (the device's x XLA_CLIENT_MEM_FRACTION, default 0.75). Its
  executables have no cost analysis: the costs are None (XLA's generic HLO cost analysis would count no flops in the
  cuBLAS GEMMs, cuDNN and Triton kernels, which are most of a step's).

  prompt_len, response_len: the step's token lengths; 0 = as the trainer computes them (`train.setup.Experiment`:
  that reads the tokenizer and the task's data). `log`: called with each program's report as it completes.
  """
  unknown = sorted(set(programs) - set(PROGRAMS))
  if unknown:
    raise ValueError(f"Unknown programs {unknown}; choose among {list(PROGRAMS)}.")
  topo = topologies.compile_only(topology, num_slices)
  exp = abstract_experiment(config, topo.devices, prompt_len, response_len)
  step = AbstractStep.build(exp)
  results = []
  for name in programs:
    results.append(_compile_one(name, step, topo.hbm_bytes))
    if log is not None:
      log(results[-1])
  chip = topo.chip
  m, cfg = exp.member, exp.model_cfg
  topology_json = dict(name=topo.name, num_slices=topo.num_slices, num_chips=topo.num_chips, chip=chip.name,
                       device_kind=chip.device_kind, hbm_bytes_per_chip=topo.hbm_bytes,
                       hbm_bytes_per_s=chip.hbm_bytes_per_s, peak_bf16_flops=chip.peak_bf16_flops,
                       platform=topo.platform, device_memory_bytes=chip.hbm_bytes,
                       memory_fraction=topo.memory_fraction)
  run = dict(num_params=cfg.num_params(), num_layers=cfg.num_layers, d_model=cfg.d_model, vocab_size=cfg.vocab_size,
             dtype=cfg.dtype, param_dtype=cfg.param_dtype, logits_chunk=cfg.logits_chunk, remat=cfg.remat,
             moe_chunk=cfg.moe_chunk,
             attention=cfg.attention, batch_size=m.batch_size, mini_batch_size=m.mini_batch_size,
             micro_batch_size=m.micro_batch_size,
             num_micro=m.num_micro, score_num_micro=m.score_num_micro, group_size=m.group_size,
             prompt_len=exp.prompt_len, response_len=exp.response_len,
             micro_batch_tokens=exp.config.micro_batch_tokens,
             engine=exp.engine.engine, slots=exp.engine.slots, state_bytes_per_chip=per_chip_bytes(step.state))
  mesh = {k: int(v) for k, v in exp.mesh.shape.items()}
  return Report(topology_json, mesh, run, results)
