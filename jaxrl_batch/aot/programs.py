"""Each program of a step, as the trainer calls it (`program`): the jitted function, its arguments as sharded structs,
its static arguments, the bytes resident meanwhile, a line saying its shape and the mesh it runs on; or why the
config's step does not run it. The learner's programs take their static arguments from the run's own
`rl.learner.Learner` (`train.step_builder`)."""
import dataclasses
import types
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_batch.aot.abstract_step import (AbstractStep, async_copy, carries_partial, cast_bytes,
                                           generator_elsewhere, replicated_key, rollout_resident, stop_ids, struct)
from jaxrl_batch.aot.engine_inputs import (engine_call, engine_inputs, engine_prompts, engine_shape, eval_rows,
                                           kept_slots)
from jaxrl_batch.aot.report import GIB, per_chip_bytes
from jaxrl_batch.rl import forward, update
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling import Strategy, continuous, generate
from jaxrl_batch.train import collector, decode_layout, evaluation


PROGRAMS = ("update", "score", "reference", "reshard", "rollout", "prefill", "decode", "reprefill", "eval_fill",
            "eval", "publish")
# The rollout's programs: on the generation step's mesh where the engines decode in a layout of their own.
ROLLOUT_PROGRAMS = ("rollout", "prefill", "decode", "reprefill")
# The function each program compiles (the rollout's: `sampling.generate` itself when it runs in blocks of slots; the
# eval's: `continuous.decode_chunk` with the continuous engine). The publish is no program: the copy of its bytes.
FUNCTIONS = dict(update="jaxrl_batch.rl.update.update", score="jaxrl_batch.rl.forward.logprobs_and_values",
                 reference="jaxrl_batch.rl.forward.logprobs_and_values",
                 reshard="jaxrl_batch.train.decode_layout.reshard",
                 rollout="jaxrl_batch.train.collector.sample_round",
                 prefill="jaxrl_batch.sampling.continuous.prefill_prompts",
                 decode="jaxrl_batch.sampling.continuous.decode_chunk",
                 reprefill="jaxrl_batch.sampling.continuous.resume_slots",
                 eval_fill="jaxrl_batch.sampling.continuous.prefill_prompts",
                 eval="jaxrl_batch.sampling.generate.generate",
                 publish="jaxrl_batch.train.async_collector.AsyncCollector.publish")


def _program_update(step: AbstractStep):
  exp, m = step.exp, step.exp.member
  algo = m.algo
  learner = step.parts.learner
  batch = step.train_batch(m.mini_batch_size)
  replicated = sharding.replicated(exp.mesh)
  # Each row's prompt and index in its group, computed on the device from the uploaded row orders: replicated.
  noise_ids = struct((m.mini_batch_size, 2), jnp.int32, replicated) if learner.with_ids else None
  kl_coef = struct((), jnp.float32, replicated)
  resident = step.resident("ref") + async_copy(step) + kept_slots(step)
  if algo.updates_per_step > 1:  # The step's whole batch stays while its mini-batches are trained on.
    resident += per_chip_bytes(step.train_batch(m.batch_size))
  if exp.packing is None:
    shape = (f"mini-batch {m.mini_batch_size} x {step.length} tokens in {m.num_micro} micro-batch(es) of "
             f"{m.micro_batch_size}")
  else:
    shape = (f"mini-batch {m.mini_batch_size} x {step.length} tokens packed in rows of {exp.packing.length}, "
             f"{exp.packing.rows} rows per micro-batch")
  args = (step.state, batch, kl_coef, noise_ids)
  return update.update, args, learner.update_kwargs(train_actor=True), resident, shape


def _program_score(step: AbstractStep):
  m = step.exp.member
  kwargs = step.parts.learner.score_kwargs()
  if not (kwargs["need_policy"] or m.algo.critic):
    return "rl.old_logp='sampler' without a critic: the trainer's score call computes nothing"
  b = m.batch_size
  args = (step.state["params"], step.state.get("critic"), step.rows((b, step.length), jnp.int32),
          step.rows((b, step.length), bool), step.rows((b, step.length), bool), step.experts(b))
  resident = step.resident("opt_state", "critic_opt_state", "ref") + async_copy(step) + kept_slots(step)
  return forward.logprobs_and_values, args, kwargs, resident, _forward_shape(step, b)


def _program_reference(step: AbstractStep):
  m = step.exp.member
  if not m.algo.use_kl:
    return "rl.kl_coef=0: no KL term, no reference policy"
  b = m.batch_size
  policy, held = step.ref_params, ("params", "opt_state", "critic", "critic_opt_state")
  if policy is None:  # LoRA: the policy without its adapters' updates (`lora.base_policy`): the policy's arrays.
    policy, held = step.state["params"], held[1:]
  args = (policy, None, step.rows((b, step.length), jnp.int32), step.rows((b, step.length), bool),
          step.rows((b, step.length), bool))
  resident = step.resident(*held) + async_copy(step) + kept_slots(step)
  kwargs = step.parts.learner.score_kwargs(reference=True)
  return forward.logprobs_and_values, args, kwargs, resident, _forward_shape(step, b)


def _forward_shape(step: AbstractStep, rows: int) -> str:
  packing, num_micro = step.exp.packing, step.exp.member.score_num_micro
  if packing is None:
    return f"batch {rows} x {step.length} tokens in {num_micro} forward(s) of {rows // num_micro}"
  return f"batch {rows} x {step.length} tokens packed, {packing.rows} rows of {packing.length} per micro-batch"


def _program_reshard(step: AbstractStep):
  generation = step.generation
  if generation is None:
    return "rollout_mesh.layout='trainer': the engines read the policy in the trainer's layout"
  if step.exp.config.rollout_mesh.devices:
    return "rollout_mesh.devices: the policy is sent to the generator's chips (`publish`)"
  if step.exp.member.algo.max_staleness:
    return "rl.max_staleness > 0: the policy is published in the engines' layout (`publish`)"
  learner_mesh, mesh = (dict(s.exp.mesh.shape) for s in (step, generation))
  shape = (f"the policy's {step.exp.model_cfg.num_params() / 1e6:.1f}M parameters from the learner's mesh "
           f"{learner_mesh} to the engines' {mesh} in {step.exp.model_cfg.dtype}, once a step")
  resident = step.resident("opt_state", "critic", "critic_opt_state", "ref")
  kwargs = dict(dtype=step.exp.model_cfg.compute_dtype)
  return decode_layout.resharder(generation.exp), (step.state["params"],), kwargs, resident, shape


def _program_rollout(step: AbstractStep):
  exp, m = step.exp, step.exp.member
  engine, config = exp.engine, exp.config
  elsewhere = generator_elsewhere(config)
  if elsewhere:
    return elsewhere
  if carries_partial(config):
    return "rollout.partial: the continuous engine's programs run (prefill, decode, reprefill)"
  if engine.engine != "static":
    return f"sampling.engine={engine.engine!r}: its programs are prefill and decode"
  slots = engine.slots * sharding.data_parallel_size(exp.mesh)
  rows = slots if slots and slots < m.batch_size else m.batch_size
  eos_id, pad_id = stop_ids(exp)
  kwargs = dict(max_new_tokens=exp.response_len, eos_id=eos_id, pad_id=pad_id, sampling=exp.strategy,
                group_size=m.group_size, attention_backend=engine.attention_backend)
  prompts = (step.rows((rows, exp.prompt_len), jnp.int32), step.rows((rows, exp.prompt_len), bool))
  if rows == m.batch_size:  # One block of all rows: the collector's own program.
    fn = collector.sample_round
    key = struct((3,), jnp.int32, sharding.replicated(exp.mesh))  # `streams.sampling_key_data`
  else:  # Blocks of `slots` rows, each a call of `generate` (`sampling.engine.rollout`).
    fn, key = generate, struct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding.replicated(exp.mesh))
  args = (step.models.graphdef, step.sampler_params, *prompts, key)
  resident = rollout_resident(step)
  shape = (f"{rows} rows x {exp.prompt_len} prompt tokens (one prefill per group of {m.group_size}), up to "
           f"{exp.response_len} new tokens")
  return fn, args, kwargs, resident, shape


def _program_prefill(step: AbstractStep, evaluating: bool = False):
  call = engine_call(step, evaluating)
  prompts = call if isinstance(call, str) else engine_prompts(step, call)
  if isinstance(prompts, str):
    return prompts
  prompt_QxP, valid_QxP, requests = prompts
  args = (step.models.graphdef, step.sampler_params, prompt_QxP, valid_QxP)
  resident = rollout_resident(step) + per_chip_bytes(requests)  # The requests exist before the prefill.
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
  kwargs = dict(steps=call.engine.chunk, eos_id=stop_ids(step.exp)[0], sampling=call.sampling,
                attention_backend=call.engine.attention_backend)
  return continuous.decode_chunk, args, kwargs, rollout_resident(step), engine_shape(step, inputs)


def _program_reprefill(step: AbstractStep):
  exp = step.exp
  call = engine_call(step, False)
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
  shape = f"{engine_shape(step, inputs)}; {fed} tokens re-fed per slot"
  if call.carried and not short and exp.config.rollout.carry_kv:  # Carried sequences keep their caches.
    shape += "; rollout.carry_kv: runs on resume only"
  return continuous.resume_slots, args, dict(fed=fed), rollout_resident(step), shape


def _program_eval_fill(step: AbstractStep):
  return _program_prefill(step, evaluating=True)


def _program_eval(step: AbstractStep):
  exp = step.exp
  rows = eval_rows(step)
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
  eos_id, pad_id = stop_ids(exp)
  kwargs = dict(max_new_tokens=exp.response_len, eos_id=eos_id, pad_id=pad_id, sampling=Strategy(temperature=0.0),
                group_size=1, attention_backend=engine.attention_backend)
  args = (step.models.graphdef, step.sampler_params, step.rows((block, exp.prompt_len), jnp.int32),
          step.rows((block, exp.prompt_len), bool), replicated_key(exp))
  shape = (f"the evaluation's greedy pass: {rows} held-out rows in blocks of {block} x {exp.prompt_len} prompt "
           f"tokens, up to {exp.response_len} new tokens")
  return generate, args, kwargs, rollout_resident(step), shape


@dataclasses.dataclass(frozen=True)
class Copy:
  """A copy the step makes without a program of ours (the weight publish): its bytes per chip (source, copy), what
  stays resident meanwhile, and how it is made; judged like a compiled program's memory. `sent_bytes`: what each
  chip of another mesh receives (a generator on chips of its own), 0 for a copy on the same chips."""
  source_bytes: int
  copy_bytes: int
  resident: int
  shape: str
  how: str
  sent_bytes: int = 0

  def stats(self):
    """`memory_analysis`'s fields for it: the source is the argument, the copy the output."""
    return types.SimpleNamespace(argument_size_in_bytes=self.source_bytes, output_size_in_bytes=self.copy_bytes,
                                 alias_size_in_bytes=0, temp_size_in_bytes=0)


def _program_publish(step: AbstractStep):
  exp, config = step.exp, step.exp.config
  if exp.member.algo.max_staleness < 1:
    return "rl.max_staleness=0: generation uses the learner's own policy, nothing is published"
  if carries_partial(config):
    return "rollout.partial with rl.max_staleness > 0: the trainer refuses this config"
  elsewhere = generator_elsewhere(config)
  if elsewhere:
    return elsewhere
  params = per_chip_bytes(step.state["params"])
  millions = exp.model_cfg.num_params() / 1e6
  if config.rollout_mesh.devices:  # Sent to the generator's chips.
    sent, chips = per_chip_bytes(step.generation.sampler_params), step.generation.exp.mesh.size
    shape = (f"the policy's {millions:.1f}M parameters ({params / GIB:.3f} GiB per learner chip) in "
             f"{exp.model_cfg.dtype}, sent to the generator's {chips} chips in its layout ({sent / GIB:.3f} GiB each)")
    how = ("`AsyncCollector.publish` casts the policy on the learner's chips (`model.compute_copy`) and puts it on the "
           "generator's in their layout (`jax.device_put`, `Experiment.policy_shardings`): no program of ours; "
           "its seconds: the bytes each generator chip receives at the chip's interconnect rate")
    resident = step.resident("opt_state", "critic", "critic_opt_state", "ref")
    return Copy(params, cast_bytes(step), resident, shape, how, sent)
  copy = per_chip_bytes(step.engines.sampler_params)  # In the engines' layout (rollout_mesh.layout='own').
  shape = (f"the policy's {millions:.1f}M parameters ({params / GIB:.3f} GiB per chip) copied "
           f"on the learner's chips in {exp.model_cfg.dtype} ({copy / GIB:.3f} GiB per chip)")
  how = ("`AsyncCollector.publish` copies each parameter in the compute dtype (`model.compute_copy`: `astype`, or "
         "`jnp.copy`): no program of ours, so no compile and no cost")
  # Meanwhile: the learner's state but the policy copied, and the generator's previous copy.
  resident = step.resident("opt_state", "critic", "critic_opt_state", "ref") + async_copy(step)
  return Copy(params, copy, resident, shape, how)


_BUILDERS = dict(update=_program_update, score=_program_score, reference=_program_reference, reshard=_program_reshard,
                 rollout=_program_rollout, prefill=_program_prefill, decode=_program_decode,
                 reprefill=_program_reprefill, eval_fill=_program_eval_fill, eval=_program_eval,
                 publish=_program_publish)


class Program(NamedTuple):
  """One program of a step: `fn` (jitted) lowered with `args` and its static `kwargs` under `mesh`; `resident`: the
  bytes per chip the step holds meanwhile that are not its arguments; `shape`: a line saying what it computes."""
  fn: Callable
  args: tuple
  kwargs: dict
  resident: int
  shape: str
  mesh: jax.sharding.Mesh

  def lower(self):
    with jax.set_mesh(self.mesh):
      return self.fn.lower(*self.args, **self.kwargs)


def program(name: str, step: AbstractStep) -> Program | Copy | str:
  """Program `name` (in PROGRAMS) of the step as a run executes it: the rollout's on the generation step where the
  engines decode in a layout of their own (`AbstractStep.engines`); the publish's copy; or why the step does not run
  it."""
  on = step.engines if name in ROLLOUT_PROGRAMS else step
  built = _BUILDERS[name](on)
  return Program(*built, on.exp.mesh) if isinstance(built, tuple) else built
