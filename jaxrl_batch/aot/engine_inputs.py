"""The continuous engine's calls in a step (the rollout's and the evaluation's) and every argument of its programs,
laid out as the trainer's are: the prefix and the slots by compiling `continuous.prefill_prompts` and
`continuous.slots_starter` and reading their output shardings."""
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl_batch.aot.abstract_step import AbstractStep, carries_partial, generator_elsewhere, replicated_key, struct
from jaxrl_batch.aot.report import per_chip_bytes
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling import EngineSettings, Strategy, continuous
from jaxrl_batch.sampling.generate import cache_buckets
from jaxrl_batch.train import evaluation, partial


def eval_rows(step: AbstractStep) -> int | str:
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
class Call:
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


def engine_call(step: AbstractStep, evaluating: bool) -> Call | str:
  """The engine's call for the step's rollout (`Collector`, `PartialCollector`) or, `evaluating`, for the
  evaluation's greedy pass; or why the continuous engine does not run it on this mesh. The rollout's is the
  generation step's (`AbstractStep.engines`: a layout of its own)."""
  step = step if evaluating else step.engines
  exp, m, config = step.exp, step.exp.member, step.exp.config
  dp = sharding.data_parallel_size(exp.mesh)
  if evaluating:
    rows = eval_rows(step)
    if isinstance(rows, str):
      return rows
    engine = evaluation.engine_for(exp, evaluation.EvalConfig.from_config(config))
    call = Call("the evaluation's greedy pass", Strategy(temperature=0.0), engine, rows, rows, engine.slots or rows,
                 1, False)
  else:
    elsewhere = generator_elsewhere(config)
    if elsewhere:
      return elsewhere
    engine = exp.engine
    slots = engine.slots * dp or m.batch_size
    if carries_partial(config):
      requests, prompts = partial.capacity(slots, m.batch_size, m.num_prompts, config.rollout.max_lookahead)
      call = Call("partial rollouts", exp.strategy, engine, prompts, requests, slots, m.group_size, True)
    else:
      call = Call("the step's rollout", exp.strategy, engine, m.num_prompts, m.batch_size, slots, m.group_size,
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


def laid_out(step: AbstractStep, fn, *args, **kwargs):
  """The outputs of jitted `fn` on `args` as the trainer holds them: sharded structs with the shapes, dtypes and
  shardings of its compiled program's outputs; or, where it does not compile, a str saying so."""
  try:
    with jax.set_mesh(step.exp.mesh):
      out = fn.lower(*args, **kwargs).compile().out_info
  except Exception as e:  # pylint: disable=broad-except  # The program that needs these inputs is skipped, saying why.
    name = getattr(fn, "__name__", "the program that makes them")
    return f"its inputs come from {name}, which did not compile: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return jax.tree.map(lambda x: struct(x.shape, x.dtype, x.sharding), out)


def engine_prompts(step: AbstractStep, call: Call):
  """(prompt_QxP, valid_QxP, requests) as `continuous.decode` receives them; a str where they cannot be laid out."""
  exp, c = step.exp, call.engine.page_size
  p = exp.prompt_len + (-exp.prompt_len % c if c else 0)  # A paged cache's prompts are left-padded to whole pages.
  rows = functools.partial(sharding.batch_sharding, exp.mesh)
  if call.carried:  # `PartialCollector` uploads the call's prompt rows replicated.
    layout = sharding.replicated(exp.mesh)
  elif call.group_size == 1:  # The batch-sharded rows themselves (prompt_BxP[::1] is prompt_BxP).
    layout = rows(2)
  else:  # One row per group, as `generate_continuous` takes them from the step's rows.
    sliced = laid_out(step, continuous.group_prompts, step.rows((call.requests, exp.prompt_len), jnp.int32),
                      step.rows((call.requests, exp.prompt_len), bool), group_size=call.group_size)
    if isinstance(sliced, str):
      return sliced
    layout = sliced[0].sharding
  r, n = call.requests, exp.response_len
  i32 = lambda *shape: struct(shape, jnp.int32, rows(len(shape)))
  requests = continuous.Requests(i32(r), i32(r), i32(r), i32(r, n), struct((r, n), jnp.float32, rows(2)), i32(r))
  return struct((call.prompts, p), jnp.int32, layout), struct((call.prompts, p), bool, layout), requests


def engine_inputs(step: AbstractStep, evaluating: bool) -> dict | str:
  """Every argument of the engine's chunk, laid out as the trainer's are (the prefix by compiling
  `continuous.prefill_prompts`, the slots and outputs by compiling `continuous.slots_starter`), with the cache at
  its longest: the slot cache's last bucket, or the paged cache's whole pool and every slot's longest page row.
  Memoised on the step; a str where the engine does not run or its inputs do not compile. The rollout's are the
  generation step's (`AbstractStep.engines`)."""
  step = step if evaluating else step.engines
  key = ("engine", evaluating)
  if key in step.memo:
    return step.memo[key]
  step.memo[key] = call = engine_call(step, evaluating)
  prompts = call if isinstance(call, str) else engine_prompts(step, call)
  if isinstance(prompts, str):
    step.memo[key] = prompts
    return prompts
  exp, engine = step.exp, call.engine
  prompt_QxP, valid_QxP, requests = prompts
  prefix = laid_out(step, continuous.prefill_prompts, step.models.graphdef, step.sampler_params, prompt_QxP, valid_QxP)
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
  started = laid_out(step, start, prefix, requests)
  if isinstance(started, str):
    step.memo[key] = started
    return started
  state, outputs = started
  live = state.live_S.sharding  # The per-chunk uploads (`transfer.to_device("admit", ...)`) take the slots' layout.
  step.memo[key] = dict(
      call=call, requests=requests, state=state, outputs=outputs, key=replicated_key(exp), length=length, pool=pool,
      own_pages=own, prefix=prefix._replace(cache=None) if c else prefix,  # A paged prefix lives in the pool.
      slots_S=struct((s,), jnp.int32, live), own_SxM=struct((s, own), jnp.int32, live) if c else None)
  return step.memo[key]


def engine_shape(step: AbstractStep, inputs: dict) -> str:
  call, p = inputs["call"], step.exp.prompt_len
  c = call.engine.page_size
  if c:
    cache = (f"a paged cache of {inputs['pool']} pages of {c} positions (+ {call.prompts * -(-p // c)} prompt pages "
             "and the trash page)")
  else:
    cache = f"a slot cache of {inputs['length']} positions"
  return (f"{call.what}: {call.slots} slots, {cache}, {call.requests} requests of up to {step.exp.response_len} "
          f"tokens, chunks of {call.engine.chunk} decode steps")


def kept_slots(step: AbstractStep) -> int:
  """Per-chip bytes of the engine's slots that partial rollouts keep across the update (rollout.carry_kv: the slot
  cache and its counters stay on the chips while the learner scores and trains, `continuous.KeptSlots`); 0 without
  carry_kv, or where the engine's inputs do not lay out (its programs then say why)."""
  config = step.exp.config
  if not (carries_partial(config) and config.rollout.carry_kv):
    return 0
  inputs = engine_inputs(step, False)
  return 0 if isinstance(inputs, str) else per_chip_bytes(inputs["state"])
