"""Compiling one RL step's programs for a TPU you do not have: memory per chip and the compiler's costs, from abstract
shapes (no weights, no data, no TPU).

`check(config, "v5p:2x2x1")` builds the run's mesh over libtpu's compile-only devices (`runtime.topologies`), the
step's state, batch and prompts as sharded `jax.ShapeDtypeStruct`s, and compiles the jitted functions the trainer
calls, with the static arguments it passes:
  update     `rl.update.update`: one optimizer step on a mini-batch, micro-batches accumulated.
  score      `rl.update.score`: the trainer's old log-probs (rl.old_logp='trainer') and the critic's old values.
  reference  `rl.learner.reference_logprobs`: the frozen reference policy's log-probs (rl.kl_coef > 0).
  rollout    the static engine's `sampling.generate` (prefill and the whole decode loop), as
             `train.collector._sample` runs it for one block of all rows.
There is no copy of a program here: when the trainer's program changes, the check compiles the new one. A program
the config's step does not run is reported as skipped, with the reason.

Per program and per chip: argument, output, alias and temporary bytes (`memory_analysis`), peak = arguments +
outputs - aliases + temporaries, and resident = what the step holds in HBM meanwhile that is not an argument (the
optimizer state during a rollout, the reference policy during an update). The verdict compares peak + resident
with the chip's HBM. Flops, bytes accessed and optimal seconds are the compiler's (`cost_analysis`, per chip), and
it counts the body of a loop without its trip count: the update's figures do not grow with its micro-batches (seen
equal for 4, 16 and 64 of them), the rollout's hold the prefill and one step per decode segment; and it counts no
flops inside Pallas kernels (splash attention). Compare them between settings of equal micro-batch count and
attention, not as the time of a step. A plan too big for HBM is a compile error on TPU: it is reported as not
fitting, with the figures of the compiler's message.
"""
import dataclasses
import datetime
import math
import re
import time

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from jaxrl_batch.config import family
from jaxrl_batch.config.optim import make_optimizer
from jaxrl_batch.model import ModelConfig
from jaxrl_batch.model.value_head import ValueHead, ValueModel
from jaxrl_batch.rl import critic as critic_lib
from jaxrl_batch.rl import learner, update
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.runtime import sharding, topologies
from jaxrl_batch.sampling import generate
from jaxrl_batch.train import collector
from jaxrl_batch.train.setup import Experiment, packing_for

PROGRAMS = ("update", "score", "reference", "rollout")
# The function each program compiles (the rollout's: `sampling.generate` itself when it runs in blocks of slots).
FUNCTIONS = dict(update="jaxrl_batch.rl.update.update", score="jaxrl_batch.rl.update.score",
                 reference="jaxrl_batch.rl.learner.reference_logprobs", rollout="jaxrl_batch.train.collector._sample")
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
    lines = [f"{self.topology['name']} x {self.topology['num_slices']} slice(s): {self.topology['num_chips']} chips "
             f"({self.topology['device_kind']}), mesh {self.mesh}; sizes in GiB per chip", fmt.format(*head)]
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


def _per_chip_bytes(tree) -> int:
  """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
  leaves = [x for x in jax.tree.leaves(tree) if x is not None]
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)


def _struct(shape, dtype, sharding_):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)  # dtype as given: PRNG key types too


def _experiment(config: ml_collections.ConfigDict, devices, prompt_len: int, response_len: int) -> Experiment:
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
  packing = packing_for(config.get("micro_batch_tokens", 0), prompt_len + response_len, data_parallel)
  return Experiment(config, member, mesh, tokenizer, task, None, ModelConfig.from_config(config.model), prompt_len,
                    response_len, chat, packing)


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
class _Step:
  """The abstract pieces of one RL step (what `train.trainer.Trainer` holds), as sharded ShapeDtypeStructs."""
  exp: Experiment
  models: update.Models
  state: dict
  ref_params: dict | None

  @classmethod
  def build(cls, exp: Experiment) -> "_Step":
    m, config = exp.member, exp.config
    graphdef, params = exp.abstract_params()
    actor = make_optimizer(config.optim, m.batch_size, m.sample_budget, m.updates_per_step, (m.actor_lr, m.actor_adam))
    state = dict(params=params, opt_state=_abstract_opt_state(actor.tx, params, exp.mesh))
    critic_graphdef = critic_tx = None
    if m.algo.critic:
      critic_tx = make_optimizer(config.critic.optim, m.batch_size, m.sample_budget, m.updates_per_step,
                                 (m.critic_lr, m.critic_adam)).tx
      critic_graphdef, state["critic"] = _abstract_critic(exp)
      state["critic_opt_state"] = _abstract_opt_state(critic_tx, state["critic"], exp.mesh)
    models = update.Models(graphdef, actor.tx, critic_graphdef, critic_tx)
    return cls(exp, models, state, params if m.algo.use_kl else None)

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
    return sum(_per_chip_bytes(parts.get(name)) for name in names)


def _program_update(step: _Step):
  exp, m = step.exp, step.exp.member
  algo = m.algo
  batch = step.train_batch(m.mini_batch_size)
  noise_ids = step.rows((m.mini_batch_size, 2), jnp.int32) if algo.noise_split else None
  kl_coef = _struct((), jnp.float32, sharding.replicated(exp.mesh))
  resident = step.resident("ref")
  if algo.updates_per_step > 1:  # The step's whole batch stays while its mini-batches are trained on.
    resident += _per_chip_bytes(step.train_batch(m.batch_size))
  if exp.packing is None:
    shape = (f"mini-batch {m.mini_batch_size} x {step.length} tokens in {m.num_micro} micro-batch(es) of "
             f"{m.micro_batch_size}")
  else:
    shape = (f"mini-batch {m.mini_batch_size} x {step.length} tokens packed in rows of {exp.packing.length}, "
             f"{exp.packing.rows} rows per micro-batch")
  args = (step.state, batch, kl_coef, noise_ids)
  kwargs = dict(models=step.models, cfg=algo, num_micro=m.num_micro, train_actor=True, packing=exp.packing)
  return update.update, args, kwargs, resident, shape


def _program_score(step: _Step):
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
  resident = step.resident("opt_state", "critic_opt_state", "ref")
  return update.score, args, kwargs, resident, _forward_shape(step, b)


def _program_reference(step: _Step):
  exp, m = step.exp, step.exp.member
  if not m.algo.use_kl:
    return "rl.kl_coef=0: no KL term, no reference policy"
  b = m.batch_size
  args = (step.ref_params, step.rows((b, step.length), jnp.int32), step.rows((b, step.length), bool),
          step.rows((b, step.length), bool))
  kwargs = dict(graphdef=step.models.graphdef, temperature=m.algo.temperature, packing=exp.packing,
                num_micro=m.score_num_micro)
  resident = step.resident("params", "opt_state", "critic", "critic_opt_state")
  return learner.reference_logprobs, args, kwargs, resident, _forward_shape(step, b)


def _forward_shape(step: _Step, rows: int) -> str:
  packing, num_micro = step.exp.packing, step.exp.member.score_num_micro
  if packing is None:
    return f"batch {rows} x {step.length} tokens in {num_micro} forward(s) of {rows // num_micro}"
  return f"batch {rows} x {step.length} tokens packed, {packing.rows} rows of {packing.length} per micro-batch"


def _program_rollout(step: _Step):
  exp, m = step.exp, step.exp.member
  sampling, config = exp.sampling, exp.config
  if config.get("rollout") is not None and config.rollout.get("partial", False):
    return "rollout.partial (the continuous engine's chunks) is not compiled yet"
  if config.get("rollout_mesh") is not None and (config.rollout_mesh.devices or config.rollout_mesh.process_cores):
    return "rollout_mesh (generation on devices of its own) is not compiled yet"
  if sampling.engine != "static":
    return f"sampling.engine={sampling.engine!r}: only the static engine is compiled yet"
  slots = sampling.slots * sharding.data_parallel_size(exp.mesh)
  rows = slots if slots and slots < m.batch_size else m.batch_size
  eos_id, pad_id = (exp.stop_id, exp.tokenizer.pad_id) if exp.tokenizer is not None else (1, 0)
  kwargs = dict(max_new_tokens=exp.response_len, eos_id=eos_id, pad_id=pad_id, sampling=sampling,
                group_size=m.group_size)
  prompts = (step.rows((rows, exp.prompt_len), jnp.int32), step.rows((rows, exp.prompt_len), bool))
  if rows == m.batch_size:  # One block of all rows: the collector's own program.
    fn = collector._sample  # pylint: disable=protected-access
    key = _struct((3,), jnp.int32, sharding.replicated(exp.mesh))  # `streams.sampling_key_data`
  else:  # Blocks of `slots` rows, each a call of `generate` (`sampling.engine.rollout`).
    fn, key = generate, _struct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding.replicated(exp.mesh))
  args = (step.models.graphdef, step.state["params"], *prompts, key)
  resident = step.resident("opt_state", "critic", "critic_opt_state", "ref")
  shape = (f"{rows} rows x {exp.prompt_len} prompt tokens (one prefill per group of {m.group_size}), up to "
           f"{exp.response_len} new tokens")
  return fn, args, kwargs, resident, shape


BUILDERS = dict(update=_program_update, score=_program_score, reference=_program_reference, rollout=_program_rollout)


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


def _cost(compiled) -> Cost:
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
  if name == "rollout":
    return [f"sampling.slots (now {exp.sampling.slots}; sequences decoded at once per chip)",
            "the response budget (task.max_response_tokens)", mesh]
  knobs = []
  if exp.packing is not None:
    knobs.append(f"micro_batch_tokens (now {config.micro_batch_tokens})")
  elif name == "update" and m.micro_batch_size > dp:
    knobs.append(f"micro_batch_size (now {m.micro_batch_size}; e.g. {max(dp, m.micro_batch_size // 2)})")
  elif name != "update":
    knobs.append(f"score_micro_batch_size (now {config.get('score_micro_batch_size', 0)}; rows per forward, 0 = "
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


def _compile_one(name: str, step: _Step, hbm: int) -> ProgramReport:
  built = BUILDERS[name](step)
  report = ProgramReport(name, FUNCTIONS[name], "skipped")
  if isinstance(built, str):
    report.verdict = f"skipped: {built}"
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
  report.cost = _cost(compiled)
  m = report.memory
  if m.total_bytes <= hbm:
    report.status = "fits"
    report.verdict = (f"fits with {100 * m.headroom_frac:.0f}% headroom ({m.total_bytes / GIB:.2f} of "
                      f"{hbm / GIB:.2f} GiB)")
  else:
    report.status = "does_not_fit"
    report.verdict = f"does not fit: {m.total_bytes / GIB:.2f} GiB per chip, {hbm / GIB:.2f} GiB of HBM"
  if m.headroom_frac < 0.1:
    report.knobs = _knobs(name, step.exp)
  return report


def check(config: ml_collections.ConfigDict, topology: str, num_slices: int = 1, programs=PROGRAMS,
          prompt_len: int = 0, response_len: int = 0, log=None) -> Report:
  """Compiles `programs` (names in PROGRAMS) of one RL step of `config` for `num_slices` slices of TPU `topology`
  ('v5p:2x2x1', 'v5e:2x2', 'v6e:4x4'), with the config's mesh over its chips, and reports each one's memory and
  costs per chip.

  prompt_len, response_len: the step's token lengths; 0 = as the trainer computes them (`train.setup.Experiment`:
  that reads the tokenizer and the task's data). `log`: called with each program's report as it completes.
  """
  unknown = sorted(set(programs) - set(PROGRAMS))
  if unknown:
    raise ValueError(f"Unknown programs {unknown}; choose among {list(PROGRAMS)}.")
  topo = topologies.compile_only(topology, num_slices)
  exp = _experiment(config, topo.devices, prompt_len, response_len)
  step = _Step.build(exp)
  results = []
  for name in programs:
    results.append(_compile_one(name, step, topo.chip.hbm_bytes))
    if log is not None:
      log(results[-1])
  chip = topo.chip
  m, cfg = exp.member, exp.model_cfg
  topology_json = dict(name=topo.name, num_slices=topo.num_slices, num_chips=topo.num_chips, chip=chip.name,
                       device_kind=chip.device_kind, hbm_bytes_per_chip=chip.hbm_bytes,
                       hbm_bytes_per_s=chip.hbm_bytes_per_s, peak_bf16_flops=chip.peak_bf16_flops)
  run = dict(num_params=cfg.num_params(), num_layers=cfg.num_layers, d_model=cfg.d_model, vocab_size=cfg.vocab_size,
             dtype=cfg.dtype, param_dtype=cfg.param_dtype, logits_chunk=cfg.logits_chunk, remat=cfg.remat,
             attention=cfg.attention, batch_size=m.batch_size, mini_batch_size=m.mini_batch_size,
             micro_batch_size=m.micro_batch_size,
             num_micro=m.num_micro, score_num_micro=m.score_num_micro, group_size=m.group_size,
             prompt_len=exp.prompt_len, response_len=exp.response_len,
             micro_batch_tokens=exp.config.get("micro_batch_tokens", 0),
             engine=exp.sampling.engine, slots=exp.sampling.slots, state_bytes_per_chip=_per_chip_bytes(step.state))
  mesh = {k: int(v) for k, v in exp.mesh.shape.items()}
  return Report(topology_json, mesh, run, results)
