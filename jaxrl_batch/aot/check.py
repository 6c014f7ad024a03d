"""Compiling one RL step's programs for a TPU you do not have: memory per chip and the compiler's costs, from abstract
shapes (no weights, no data, no TPU).

`check(config, "v5p:2x2x1")` builds the run's mesh over libtpu's compile-only devices (`runtime.topologies`), the
step's state, batch and prompts as sharded `jax.ShapeDtypeStruct`s, and compiles the jitted functions the trainer
calls, with the static arguments it passes:
  update     `rl.update.update`: one optimizer step on a mini-batch, micro-batches accumulated.
  score      `rl.forward.logprobs_and_values`: the trainer's old log-probs (rl.old_logp='trainer') and the critic's
             old values.
  reference  the same function on the frozen reference policy: its log-probs (rl.kl_coef > 0).
  reshard    rollout_mesh.layout='own': `train.decode_layout.reshard`, the policy cast to the compute dtype and laid
             out on the rollout mesh (rollout_mesh's shape over the same chips), once a step; the rollout's
             programs below then compile on that mesh, the learner's whole state resident meanwhile.
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
  publish    the asynchronous run's weight publish (rl.max_staleness > 0): the policy copied in the compute dtype
             (`model.compute_copy`), not one program, reported by its bytes per chip (no compile); with
             rollout_mesh.devices sent to the generator's chips, its cost the bytes each receives and their seconds
             at the chip's interconnect rate (one direction).
With rollout_mesh.devices = n the learner's programs compile on the first chips, the rollout's on the last n
(`rollout_mesh`'s shape), each side's memory per chip its own.
There is no copy of a program here: when the trainer's program changes, the check compiles the new one. A program
the config's step does not run is reported as skipped, with the reason (also the generator process: not compiled).
The engine's inputs are laid out as the trainer's are: the prefix and the slots come from compiling
`continuous.prefill_prompts` and `continuous.slots_starter` and reading their output shardings.

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
import time

import ml_collections

from jaxrl_batch.aot.abstract_step import AbstractStep, abstract_experiment, carries_partial
from jaxrl_batch.aot.programs import FUNCTIONS, PROGRAMS, Copy, program
from jaxrl_batch.aot.report import (GIB, Cost, Memory, ProgramReport, Report, cost_of, memory_of, parse_oom,
                                    per_chip_bytes)
from jaxrl_batch.runtime import sharding, topologies
from jaxrl_batch.train import evaluation
from jaxrl_batch.train.setup import Experiment


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
             if carries_partial(config) else "")
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


def _compile_one(name: str, step: AbstractStep, hbm: int, link_bytes_per_s: float) -> ProgramReport:
  """Program `name` of the step compiled and judged against `hbm` bytes a chip; a copy to other chips timed at
  `link_bytes_per_s` (the bytes a chip receives a second)."""
  built = program(name, step)
  report = ProgramReport(name, FUNCTIONS[name], "skipped")
  if isinstance(built, str):
    report.verdict = f"skipped: {built}"
    return report
  if isinstance(built, Copy):  # No program of ours: its bytes, judged as a program's memory.
    report.shape, report.message = built.shape, built.how
    report.memory = memory_of(built.stats(), built.resident, hbm)
    if built.sent_bytes:  # To the generator's chips: its bytes and seconds over the interconnect.
      report.cost = Cost(None, float(built.sent_bytes), built.sent_bytes / link_bytes_per_s)
    report = _judge(report, name, step.exp, hbm)
    report.verdict += " (not compiled: the bytes it copies)"
    return report
  resident, report.shape = built.resident, built.shape
  report.function = f"{built.fn.__module__}.{built.fn.__name__}"
  start = time.perf_counter()
  try:
    compiled = built.lower().compile()
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
  report.memory = memory_of(compiled.memory_analysis(), resident, hbm)
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
  step = AbstractStep.build(exp, topo.devices)
  results = []
  for name in programs:
    results.append(_compile_one(name, step, topo.hbm_bytes, topo.chip.interconnect_bytes_per_s / 2))
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
  mesh, rollout_mesh = ({k: int(v) for k, v in s.exp.mesh.shape.items()} for s in (step, step.engines))
  return Report(topology_json, mesh, run, results, rollout_mesh, int(config.rollout_mesh.devices))
