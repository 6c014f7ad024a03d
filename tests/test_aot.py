"""`aot`: the trainer's programs compiled for a TPU slice this machine does not have (libtpu's compile-only
devices), their memory per chip and costs; `launch.aot_check` writes them as JSON. The same for GPU nodes (the JAX
CUDA plugin's compile-only devices)."""
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import grpo_gsm8k_qwen
from jaxrl_batch.kernels import train_attention
from jaxrl_batch.model import lora
from jaxrl_batch.runtime import sharding, topologies
from jaxrl_batch import aot
from tests.helpers import ATTENTION_B, ATTENTION_T, compiled_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OOM = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (21.77G) exceeds "
       "available HBM (15.75G).")


@pytest.fixture(scope="module")
def libtpu(compile_only_tpu):
  """Skips (with the reason) where libtpu cannot give compile-only v5e:2x2 devices."""
  compile_only_tpu("v5e:2x2")


def test_topology_names():
  chip, dims = topologies.parse("v5p:2x2x1")
  assert (chip.device_kind, dims) == ("TPU v5", (2, 2, 1))
  assert topologies.parse("v5e:4x4")[1] == (4, 4)
  for bad in ("v9x:2x2", "v5e", "v5e:2xq", "v5e:0x2"):
    with pytest.raises(ValueError, match="topology"):
      topologies.parse(bad)


def test_parse_oom():
  parse_oom = aot.parse_oom
  assert parse_oom(OOM) == (int(21.77 * 2**30), int(15.75 * 2**30))
  assert parse_oom("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.5G of 15.48G hbm.") == (
      int(20.5 * 2**30), int(15.48 * 2**30))
  assert parse_oom("INVALID_ARGUMENT: something else") is None


@pytest.mark.usefixtures("libtpu")
@pytest.mark.slow
def test_a_plan_too_big_for_hbm_is_reported_not_raised():
  # Logits and embedding gradients of a 40M-row table: > 100 GiB per chip.
  config = _tiny_with(**{"model.vocab_size": 40_000_000})
  report = aot.check(config, "v5e:2x2", programs=("update",), prompt_len=32, response_len=32)
  update = report.program("update")
  assert update.status == "does_not_fit" and "RESOURCE_EXHAUSTED" in update.message, update.message
  assert update.memory.temp_bytes > update.memory.hbm_bytes == topologies.CHIPS["v5e"].hbm_bytes
  assert update.verdict.startswith("does not fit")
  assert any(k.startswith("micro_batch_size") for k in update.knobs)
  assert any(k.startswith("model.remat") for k in update.knobs)
  assert "does not fit" in report.table()


@pytest.mark.slow
@pytest.mark.usefixtures("libtpu")
def test_cli_compiles_the_update_for_v5e_with_its_memory_and_costs(tmp_path):
  # tiny_random (one layer): 16 rollouts in micro-batches of 8 (2 per update) on a 4-chip data-parallel mesh.
  cmd = [sys.executable, "-m", "launch.aot_check", "--config=configs/grpo_gsm8k_qwen.py:model=tiny_random",
         "--config.model.num_layers=1", "--topology=v5e:2x2", "--programs=update,score", "--prompt_tokens=64",
         "--response_tokens=64", f"--out={tmp_path}"]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "update" in done.stdout and "fits with" in done.stdout
  with open(tmp_path / "aot_check.json") as f:
    out = json.load(f)
  assert out["schema_version"] == 1
  assert out["topology"]["device_kind"] == "TPU v5 lite" and out["topology"]["num_chips"] == 4
  assert out["mesh"] == dict(data=4, fsdp=1, expert=1, tensor=1)
  assert out["run"]["prompt_len"] == 64 and out["run"]["num_micro"] == 2
  update, score = out["programs"]
  assert update["name"] == "update" and update["function"] == "jaxrl_batch.rl.update.update"
  assert update["status"] == "fits" and update["verdict"].startswith("fits with"), update["message"]
  m, c = update["memory"], update["cost"]
  assert set(m) == {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes", "resident_bytes",
                    "total_bytes", "hbm_bytes", "headroom_frac"}
  assert m["temp_bytes"] > 0 and m["argument_bytes"] > 0 and m["alias_bytes"] > 0  # The state is donated.
  assert m["peak_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
  assert m["peak_bytes"] <= m["total_bytes"] <= m["hbm_bytes"] == topologies.CHIPS["v5e"].hbm_bytes
  assert c["flops"] > 0 and c["bytes_accessed"] > 0 and c["optimal_seconds"] > 0 and update["compile_seconds"] > 0
  # rl.old_logp='sampler' without a critic: the step's score call computes nothing.
  assert score["status"] == "skipped" and "old_logp" in score["verdict"] and score["memory"] is None


def test_the_abstract_state_is_the_trainers():
  """Shapes, dtypes and shardings of the state `aot` compiles against equal those of the state the trainer builds:
  `tx.init` under the mesh (eagerly) on parameters placed as `create_sharded` places them; CPU devices."""
  config = grpo_gsm8k_qwen.get_config("model=tiny_random,mesh=1x-1x1")
  exp = aot.abstract_experiment(config, jax.devices(), 64, 64)
  step = aot.AbstractStep.build(exp)
  _, abstract = exp.abstract_params()
  params = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), abstract)
  with jax.set_mesh(exp.mesh):
    real = dict(params=params, opt_state=step.models.actor_tx.init(params))
  flat_real, tree_real = jax.tree.flatten(real)
  flat_abstract, tree_abstract = jax.tree.flatten(step.state)
  assert tree_real == tree_abstract
  for x, s in zip(flat_real, flat_abstract):
    assert (x.shape, x.dtype) == (s.shape, s.dtype)
    assert x.sharding.is_equivalent_to(s.sharding, x.ndim), (x.sharding, s.sharding)


@pytest.mark.usefixtures("libtpu")
@pytest.mark.slow
def test_chunked_logits_and_rollout_blocks_compile_for_v5e():
  """The update's temporaries with 32-position logit chunks are under half the whole-sequence form's (a 40,000-token
  vocabulary makes the float32 logits dominate); the rollout compiles as one block of all rows and as blocks of
  `sampling.slots` (a PRNG key argument)."""
  config = _tiny_with(**{"model.vocab_size": 40_000})

  def update_temps(chunk):
    config.model.logits_chunk = chunk
    report = aot.check(config, "v5e:2x2", programs=("update",), prompt_len=32, response_len=224)
    assert report.program("update").status == "fits", report.program("update").verdict
    return report.program("update").memory.temp_bytes

  whole, chunked = update_temps(0), update_temps(32)
  logits_bytes = 2 * 256 * 40_000 * 4  # One micro-batch's float32 logits per chip (8 rows on 4 chips).
  assert whole > logits_bytes and chunked < whole / 2, (chunked, whole)
  for slots in (0, 2):
    config.sampling.slots = slots
    rollout = aot.check(config, "v5e:2x2", programs=("rollout",), prompt_len=32, response_len=32).program("rollout")
    # Temporaries this small live in on-chip memory (0 bytes of HBM); the weights and prompts are arguments.
    assert rollout.status == "fits" and rollout.memory.peak_bytes > 0 and rollout.cost.flops > 0, rollout.verdict
    assert (f"{4 * slots} rows" if slots else "16 rows") in rollout.shape



@pytest.mark.slow
def test_the_lora_update_compiles_for_one_v5e_chip_with_optimizer_state_for_the_adapters_only(compile_only_tpu):
  """One v5e chip (Colab's v5e-1: v5e:1x1) and LoRA: the update the AOT check compiles fits, and the optimizer state
  among its arguments is Adam's two moments of the adapters, nothing of the frozen base."""
  topology = compile_only_tpu("v5e:1x1")
  assert topology.num_chips == 1 and topology.hbm_bytes == topologies.CHIPS["v5e"].hbm_bytes
  config = grpo_gsm8k_qwen.get_config("model=tiny_random,lora=4")
  config.model.num_layers = 1  # as _tiny_with's
  report = aot.check(config, "v5e:1x1", programs=("update",), prompt_len=32, response_len=32)
  assert report.program("update").status == "fits", report.program("update").verdict
  step = aot.AbstractStep.build(aot.abstract_experiment(config, topology.devices, 32, 32))
  # The program's state argument, as lowered: the arguments check() compiled above (not compiled twice).
  state = aot.program("update", step).lower().args_info[0][0]
  adapters, base = lora.split(state["params"])
  size = lambda leaves: sum(int(np.prod(x.shape)) for x in leaves)
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.shape]  # Adam's mu and nu (scalars: its count)
  assert sorted(x.shape for x in moments) == sorted(2 * [x.shape for x in jax.tree.leaves(adapters)])
  assert size(moments) == 2 * size(jax.tree.leaves(adapters)) < size(jax.tree.leaves(base)) / 2

# GPU nodes: the JAX CUDA plugin's compile-only devices, from the target descriptions in jaxrl_batch/runtime/gpu_specs.


@pytest.fixture(scope="module")
def cuda_plugin():
  """Skips (with the reason) where the JAX CUDA plugin is not installed or XLA finds no ptxas to compile with; a target
  description the plugin refuses, or any other failure, fails the test instead."""
  pytest.importorskip("jax_plugins.xla_cuda12", reason="the JAX CUDA plugin is not installed (pip install -e "
                      "'.[cuda_aot]')")
  try:
    topologies.compile_only_gpu("h100", 1)
  except ValueError as e:
    if "needs the JAX CUDA plugin" in str(e) or "needs ptxas" in str(e):
      pytest.skip(f"no compile-only H100 here: {e}")
    raise


@pytest.mark.parametrize("name", sorted(topologies.GPUS))
def test_gpu_chips_are_their_target_descriptions(name):
  """GPUS' figures are those of gpu_specs/<name>.txtpb: device kind, memory, bandwidth, and the tensor cores' dense
  bf16 rate where the description has one (SMs x tensor cores x FMAs per clock x clock x 2)."""
  text, chip = topologies.gpu_target_config(name), topologies.GPUS[name]
  field = lambda key: re.search(rf"^\s*{key}: \"?([^\"\s]+(?: [^\"\s#]+)*)\"?", text, re.M).group(1)
  assert field("name") == chip.device_kind and chip.platform == "cuda"
  assert int(field("device_memory_size")) == chip.hbm_bytes
  assert abs(int(field("memory_bandwidth")) / chip.hbm_bytes_per_s - 1) < 0.01
  bf16 = re.search(r"key: 16 value \{ clock_rate_ghz: ([\d.]+) units_per_core: (\d+) ops_per_clock: (\d+)",
                   text.split("matrix_unit_description")[-1])
  if bf16:
    flops = int(field("core_count")) * float(bf16[1]) * 1e9 * int(bf16[2]) * int(bf16[3]) * 2
    assert abs(flops / chip.peak_bf16_flops - 1) < 0.01, flops


def test_gpu_topology_names():
  with pytest.raises(ValueError, match="unknown GPU"):
    topologies.gpu_target_config("b200")
  for bad in ("h100", "h100:x", "h100:2x2"):
    with pytest.raises(ValueError, match="<gpu>:<GPUs per node>"):
      topologies.compile_only(bad)
  with pytest.raises(ValueError, match="h100:8"):  # The TPU parser's error names the GPUs too.
    topologies.parse("b200:8")


@pytest.mark.usefixtures("cuda_plugin")
@pytest.mark.slow
def test_the_update_compiles_for_h100s_and_fits(monkeypatch):
  """tiny_random on 2 H100s (fsdp=2): the update's memory per GPU from the GPU compiler, compared with the share of the
  device JAX's allocator takes (XLA_CLIENT_MEM_FRACTION); no costs (GPU executables have no cost analysis)."""
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
  config = grpo_gsm8k_qwen.get_config("model=tiny_random,mesh=1x2x1")
  config.model.num_layers = 1  # as _tiny_with's
  report = aot.check(config, "h100:2", programs=("update",), prompt_len=32, response_len=32)
  hbm = int(0.9 * topologies.GPUS["h100"].hbm_bytes)
  assert report.topology == dict(
      name="h100:2", num_slices=1, num_chips=2, chip="h100", device_kind="NVIDIA H100 80GB HBM3",
      hbm_bytes_per_chip=hbm, hbm_bytes_per_s=3352e9, peak_bf16_flops=989e12, platform="cuda",
      device_memory_bytes=topologies.GPUS["h100"].hbm_bytes, memory_fraction=0.9)
  assert report.mesh == dict(data=1, fsdp=2, expert=1, tensor=1)
  update = report.program("update")
  assert update.status == "fits" and update.verdict.startswith("fits with"), update.message
  m = update.memory
  assert m.temp_bytes > 0 and m.argument_bytes > 0 and m.alias_bytes > 0  # The state is donated.
  assert m.peak_bytes == m.argument_bytes + m.output_bytes - m.alias_bytes + m.temp_bytes
  assert m.peak_bytes <= m.total_bytes <= m.hbm_bytes == hbm
  assert update.cost == aot.Cost(None, None, None)
  assert "h100:2 x 1 node(s): 2 GPUs" in report.table()


@pytest.mark.usefixtures("cuda_plugin")
@pytest.mark.slow
def test_the_decode_chunk_on_h100s_with_tensor_parallelism_gathers_no_cache():
  """tiny_random (4 query heads over 2 kv heads of 16) decoding with tensor = 2 on 2 H100s: the Triton attention runs
  per shard (`decode_attention_triton`), so the compiled decode chunk gathers nothing of the cache or the queries
  (XLA, left to partition the Pallas call, all-gathered q, k and v in every layer at every step)."""
  config = _tiny_with(**{"mesh.data": 1, "mesh.tensor": 2, "sampling.engine": "continuous", "sampling.slots": 2})
  devices = topologies.compile_only_gpu("h100", 2).devices
  step = aot.AbstractStep.build(aot.abstract_experiment(config, devices, 32, 32), devices)
  text = aot.program("decode", step).lower().compile().as_text()
  gathered = [line for line in text.splitlines() if re.search(r" all-gather(-start)?\(", line)]
  assert not [line for line in gathered if "decode_attention" in line], gathered
  assert "__triton" in text or "triton" in text


@pytest.mark.usefixtures("cuda_plugin")
@pytest.mark.slow
def test_a_plan_too_big_for_an_h100_compiles_and_is_reported():
  """The GPU compiler does not refuse a plan larger than the device (the TPU compiler's out-of-memory error): the
  program compiles and its memory_analysis gives the verdict."""
  # Logits and embedding gradients of a 40M-row table: > 100 GiB per GPU.
  config = _tiny_with(**{"model.vocab_size": 40_000_000})
  update = aot.check(config, "h100:1", programs=("update",), prompt_len=32, response_len=32).program("update")
  assert update.status == "does_not_fit" and update.message == "", update.message
  assert update.memory.total_bytes > update.memory.hbm_bytes and update.memory.argument_bytes > 0
  assert update.verdict.startswith("does not fit") and any(k.startswith("micro_batch_size") for k in update.knobs)


@pytest.mark.usefixtures("cuda_plugin")
@pytest.mark.slow
def test_flash_gpu_compiled_for_h100s_needs_a_fraction_of_dense_temporaries():
  """model.attention='auto' on a mesh of H100s is flash_gpu (Pallas Triton kernels, forward and backward): compiled
  at Qwen2.5-1.5B's heads (12 query, 2 kv, head_dim 128), bf16, B=2, T=2048 on 2 GPUs with tensor=2, its temporaries
  are a small fraction of the dense form's (B x 6 local heads x T x T float32 scores). Measured (jax-cuda12-plugin
  0.10.2): dense 503,418,880 temporary bytes per GPU, flash_gpu 25,166,104 (kv heads repeated to 12, the backward's
  residuals); at T=4096: 2,013,470,720 and 50,331,928."""
  mesh = sharding.make_mesh(data=1, fsdp=1, tensor=2, devices=topologies.compile_only("h100:2").devices)
  with jax.set_mesh(mesh):
    assert train_attention.resolve("auto") == "flash_gpu"
  flash_hlo, flash_temp = compiled_attention(mesh, "auto")
  dense_hlo, dense_temp = compiled_attention(mesh, "dense")
  b, t = ATTENTION_B, ATTENTION_T
  triton = "__gpu$xla.gpu.triton"
  assert flash_hlo.count(triton) >= 3 and triton not in dense_hlo  # mha's forward, and its dq and dk/dv kernels
  assert dense_temp >= b * 6 * t * t * 4, dense_temp
  assert flash_temp <= dense_temp // 10, (flash_temp, dense_temp)


@pytest.mark.slow
@pytest.mark.usefixtures("cuda_plugin")
def test_cli_compiles_for_gpu_nodes(tmp_path):
  base = [sys.executable, "-m", "launch.aot_check", "--config=configs/grpo_gsm8k_qwen.py:model=tiny_random",
          "--config.model.num_layers=1", "--programs=update", "--prompt_tokens=32", "--response_tokens=32",
          f"--out={tmp_path}"]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
  both = subprocess.run(base + ["--gpu=h100", "--topology=v5e:2x2"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120, check=False, env=env)
  assert both.returncode != 0 and "exactly one of --topology" in both.stderr, both.stderr[-2000:]
  done = subprocess.run(base + ["--gpu=a100", "--gpus=2", "--num_nodes=2"], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, check=False, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "2 node(s): 4 GPUs (NVIDIA A100-SXM4-80GB)" in done.stdout and "fits with" in done.stdout
  with open(tmp_path / "aot_check.json") as f:
    out = json.load(f)
  topology, (update,) = out["topology"], out["programs"]
  assert (topology["name"], topology["num_slices"], topology["num_chips"], topology["platform"]) == (
      "a100:2", 2, 4, "cuda")
  assert topology["memory_fraction"] == 0.75 and topology["hbm_bytes_per_chip"] == int(0.75 * 85_100_068_864)
  assert out["mesh"] == dict(data=4, fsdp=1, expert=1, tensor=1)  # tiny_random: data=-1 over both nodes' GPUs
  assert update["status"] == "fits" and update["memory"]["hbm_bytes"] == topology["hbm_bytes_per_chip"]
  assert update["cost"] == dict(flops=None, bytes_accessed=None, optimal_seconds=None)


# -- The continuous engine's programs, partial rollouts, the evaluation and the weight publish ---------------------


def _tiny_with(**overrides):
  """tiny_random with one layer (each program compiles in less time; every layer is the same program part) and
  `overrides` ('group.key': value)."""
  config = grpo_gsm8k_qwen.get_config("model=tiny_random")
  config.model.num_layers = 1
  for key, value in overrides.items():
    group, _, name = key.rpartition(".")
    (config[group] if group else config)[name] = value
  return config


@pytest.mark.usefixtures("libtpu")
@pytest.mark.slow
def test_continuous_engine_prefill_decode_and_eval_compile_for_v5e():
  """The decode chunk's arguments hold the slot cache at its longest bucket (128 positions: P + N - 1 = 127 in whole
  TPU tiles, `cache_buckets`; the first bucket holds 64), so 2 more slots per chip add that cache's bytes, donated
  with the state; the prefill and the evaluation's programs compile too, and the static engine's `rollout` is
  skipped."""
  from jaxrl_batch.model import KVCache, ModelConfig  # pylint: disable=import-outside-toplevel
  programs = ("rollout", "prefill", "decode", "eval_fill", "eval")
  config = _tiny_with(**{"sampling.engine": "continuous", "sampling.slots": 2, "model.head_dim": 128})
  report = aot.check(config, "v5e:2x2", programs=programs, prompt_len=32, response_len=96)
  assert "prefill and decode" in report.program("rollout").verdict
  for name in programs[1:]:
    p = report.program(name)
    assert p.status == "fits" and p.memory.argument_bytes > 0, (name, p.verdict)
  decode, prefill, evaluation = report.program("decode"), report.program("prefill"), report.program("eval")
  assert decode.function == evaluation.function == "jaxrl_batch.sampling.continuous.decode_chunk"
  assert prefill.function == "jaxrl_batch.sampling.continuous.prefill_prompts"
  assert "8 slots, a slot cache of 128 positions, 16 requests" in decode.shape, decode.shape
  assert "4 prompts x 32 tokens" in prefill.shape and "4 slots" in evaluation.shape, (prefill.shape, evaluation.shape)
  # The step's 16 requests (tokens, log-probs, budgets...) exist before its prefill: resident beside the optimizer.
  assert prefill.memory.resident_bytes > decode.memory.resident_bytes > 0
  config.sampling.slots = 4
  wider = aot.check(config, "v5e:2x2", programs=("decode",), prompt_len=32, response_len=96).program("decode")
  cache = KVCache.bytes_for(ModelConfig.from_config(config.model), 2, 128)  # 2 more slots per chip
  grown = wider.memory.argument_bytes - decode.memory.argument_bytes
  assert cache <= grown <= cache + 4096, (grown, cache)
  assert cache <= wider.memory.alias_bytes - decode.memory.alias_bytes <= cache + 4096  # Donated: updated in place.


@pytest.mark.usefixtures("libtpu")
@pytest.mark.slow
def test_paged_engine_pool_and_reprefill_compile_for_one_v5e_chip():
  """The paged cache decodes on one chip: its pool is an argument of the decode chunk (24 more pages add their
  bytes), a pool short of every slot at the longest length re-prefills preempted sequences (`reprefill`), and on 4
  chips its programs are skipped, as the trainer refuses them."""
  from jaxrl_batch.model import ModelConfig, PagedKVCache  # pylint: disable=import-outside-toplevel
  config = _tiny_with(**{"sampling.engine": "continuous", "sampling.slots": 4, "sampling.page_size": 16,
                    "sampling.pages": 6, "model.head_dim": 128})
  skipped = aot.check(config, "v5e:2x2", programs=("decode", "eval"), prompt_len=32, response_len=32)
  assert all(p.status == "skipped" and "one device" in p.verdict for p in skipped.programs), skipped.table()
  report = aot.check(config, "v5e:1x1", programs=("decode", "reprefill"), prompt_len=32, response_len=32)
  decode, reprefill = report.program("decode"), report.program("reprefill")
  assert decode.status == reprefill.status == "fits", (decode.verdict, reprefill.verdict)
  assert "a paged cache of 6 pages of 16 positions (+ 8 prompt pages" in decode.shape, decode.shape
  assert reprefill.function == "jaxrl_batch.sampling.continuous.resume_slots" and "31 tokens re-fed" in reprefill.shape
  config.sampling.pages = 30
  bigger = aot.check(config, "v5e:1x1", programs=("decode", "reprefill"), prompt_len=32, response_len=32)
  assert "no paged pool short" in bigger.program("reprefill").verdict  # 4 slots x 2 pages fit: no preemption.
  pages = PagedKVCache.bytes_for(ModelConfig.from_config(config.model), 24, 16)
  grown = bigger.program("decode").memory.argument_bytes - decode.memory.argument_bytes
  assert pages <= grown <= pages + 4096, (grown, pages)


def _partial(carry_kv: bool):
  """Partial rollouts on the continuous engine, 2 slots a chip, keeping the carried slots' KV cache or not."""
  return _tiny_with(**{"sampling.engine": "continuous", "sampling.slots": 2, "rollout.partial": True,
                       "rollout.carry_kv": carry_kv})


@pytest.fixture(name="partial_report", scope="module")
def _partial_report(compile_only_tpu):
  """The partial rollouts' programs and update (carry_kv, the default) for v5e:2x2, compiled once for the two tests
  below (one xdist group: one worker compiles them)."""
  compile_only_tpu("v5e:2x2")
  return aot.check(_partial(True), "v5e:2x2", programs=("rollout", "prefill", "decode", "reprefill", "update"),
                   prompt_len=32, response_len=32)


@pytest.mark.slow
@pytest.mark.xdist_group("aot_partial")
def test_partial_rollouts_compile_their_prefill_decode_and_reprefill_for_v5e(partial_report):
  """rollout.partial: the call holds 8 carried + 2 steps x 16 new requests and 8 + 2 x 4 prompt rows; the
  re-prefill of carried sequences returns a new slot cache (not donated: the old one is live meanwhile)."""
  from jaxrl_batch.model import KVCache, ModelConfig  # pylint: disable=import-outside-toplevel
  config, report = _partial(True), partial_report
  assert "rollout.partial" in report.program("rollout").verdict
  prefill, decode, reprefill = (report.program(name) for name in ("prefill", "decode", "reprefill"))
  for p in (prefill, decode, reprefill):
    assert p.status == "fits" and p.shape.startswith("partial rollouts"), (p.name, p.verdict)
  assert "16 prompts x 32 tokens, for 40 requests on 8 slots" in prefill.shape, prefill.shape
  assert "40 requests" in decode.shape and "31 tokens re-fed per slot" in reprefill.shape
  cache = KVCache.bytes_for(ModelConfig.from_config(config.model), 2, 128)  # 2 slots per chip, 63 positions in 128
  assert reprefill.memory.alias_bytes == 0 and reprefill.memory.output_bytes >= cache
  assert decode.memory.alias_bytes >= cache


@pytest.mark.slow
@pytest.mark.xdist_group("aot_partial")
def test_carried_slots_stay_resident_through_the_update_with_carry_kv(partial_report):
  """rollout.carry_kv keeps the slots' KV cache on the chips while the learner trains: the update counts it."""
  from jaxrl_batch.model import KVCache, ModelConfig  # pylint: disable=import-outside-toplevel
  config = _partial(False)
  report = aot.check(config, "v5e:2x2", programs=("update",), prompt_len=32, response_len=32)
  resident = {False: report.program("update").memory.resident_bytes,
              True: partial_report.program("update").memory.resident_bytes}
  cache = KVCache.bytes_for(ModelConfig.from_config(config.model), 2, 128)  # 2 slots per chip, 63 positions in 128
  assert cache <= resident[True] - resident[False] < 2 * cache


@pytest.mark.usefixtures("libtpu")
@pytest.mark.slow
def test_static_eval_and_the_weight_publish_of_an_async_run_for_v5e():
  """The evaluation's greedy pass compiles as the static engine's `generate` of the held-out rows; with
  rl.max_staleness = 1 the publish is no program: its bytes (the policy per chip, copied) are reported, and the
  update counts the generator's copy as resident; a held-out set of unknown size skips `eval`."""
  config = _tiny_with(**{"rl.max_staleness": 1})
  report = aot.check(config, "v5e:2x2", programs=("update", "eval", "publish", "decode"), prompt_len=32,
                     response_len=32)
  update, evaluation, publish = (report.program(name) for name in ("update", "eval", "publish"))
  assert evaluation.status == "fits" and evaluation.function == "jaxrl_batch.sampling.generate.generate"
  assert "4 held-out rows in blocks of 4" in evaluation.shape, evaluation.shape  # task.num_eval = 4 on 4 chips
  assert publish.status == "fits" and "not compiled" in publish.verdict, publish.verdict
  assert publish.compile_seconds is None and publish.cost is None
  m = publish.memory
  assert m.argument_bytes == m.output_bytes == update.memory.resident_bytes > 0 and "jnp.copy" in publish.message
  assert m.peak_bytes == 2 * m.argument_bytes and m.resident_bytes > m.argument_bytes  # + the optimizer's moments
  assert "static" in report.program("decode").verdict
  config.rl.max_staleness, config.task.num_eval = 0, 0
  report = aot.check(config, "v5e:2x2", programs=("eval", "publish"), prompt_len=32, response_len=32)
  assert "task.num_eval" in report.program("eval").verdict and "max_staleness=0" in report.program("publish").verdict


@pytest.mark.usefixtures("libtpu")
@pytest.mark.slow
def test_a_decode_layout_of_its_own_compiles_the_reshard_and_the_rollout_on_its_mesh_for_v5e():
  """rollout_mesh.layout='own', trained with fsdp 4 and decoded with data 4: the reshard reads the master weights in
  the trainer's layout (a quarter of each a chip) and writes the engines' copy whole on every chip, the optimizer's
  moments resident; the rollout compiles on the rollout mesh with the learner's whole state resident; the
  evaluation on the trainer's mesh."""
  config = _tiny_with(**{"mesh.data": 1, "mesh.fsdp": 4, "rollout_mesh.layout": "own", "rollout_mesh.data": 4})
  report = aot.check(config, "v5e:2x2", programs=("update", "reshard", "rollout", "eval"), prompt_len=32,
                     response_len=32)
  assert report.mesh["fsdp"] == 4 and report.rollout_mesh == dict(data=4, fsdp=1, expert=1, tensor=1)
  assert "(the rollout on {'data': 4" in report.table()
  update, reshard, rollout, evaluation = (report.program(n) for n in ("update", "reshard", "rollout", "eval"))
  assert all(p.status == "fits" for p in (update, reshard, rollout, evaluation)), report.table()
  assert reshard.function == "jaxrl_batch.train.decode_layout.reshard" and "once a step" in reshard.shape
  step = aot.AbstractStep.build(aot.abstract_experiment(config, topologies.compile_only("v5e:2x2").devices, 32, 32))
  master, copy = aot.per_chip_bytes(step.state["params"]), aot.per_chip_bytes(step.engines.sampler_params)
  assert 3.9 * master < copy <= 4 * master  # float32 either way, whole on each chip: 4x a quarter (the norms whole)
  # The compiler's bytes hold these tiny arrays padded to whole tiles: the copy is still over twice the master.
  assert reshard.memory.output_bytes > 2 * reshard.memory.argument_bytes >= 2 * master
  assert rollout.memory.argument_bytes >= reshard.memory.output_bytes  # the rollout reads the copy
  moments = step.resident("opt_state")
  assert reshard.memory.resident_bytes == moments and rollout.memory.resident_bytes == moments + master
  assert evaluation.memory.resident_bytes < rollout.memory.resident_bytes  # it reads the master in place
  config.rollout_mesh.layout = "trainer"
  skipped = aot.check(config, "v5e:2x2", programs=("reshard",), prompt_len=32, response_len=32).program("reshard")
  assert skipped.status == "skipped" and "layout='trainer'" in skipped.verdict


@pytest.mark.usefixtures("libtpu")
@pytest.mark.slow
def test_generation_on_chips_of_its_own_compiles_each_side_and_times_the_publish_for_v5e():
  """rollout_mesh.devices = 2 of v5e:2x2: the learner's programs on the first 2 chips (data 2), the rollout's on the
  last 2 (tensor 2) with the next published policy resident beside the one decoding; the publish sends each generator
  chip its share of the policy, timed at the chip's interconnect rate one way."""
  config = _tiny_with(**{"rl.max_staleness": 1, "mesh.data": 2, "rollout_mesh.devices": 2, "rollout_mesh.data": 1,
                         "rollout_mesh.tensor": 2})
  report = aot.check(config, "v5e:2x2", programs=("update", "reshard", "rollout", "publish"), prompt_len=32,
                     response_len=32)
  assert report.mesh["data"] == 2 and report.rollout_chips == 2 and report.rollout_mesh["tensor"] == 2
  assert "(the rollout on 2 chips of its own: " in report.table()
  update, reshard, rollout, publish = (report.program(n) for n in ("update", "reshard", "rollout", "publish"))
  assert update.status == rollout.status == publish.status == "fits" and "publish" in reshard.verdict
  devices = topologies.compile_only("v5e:2x2").devices
  step = aot.AbstractStep.build(aot.abstract_experiment(config, devices, 32, 32), devices)
  assert [d.id for d in step.exp.mesh.devices.flat] == [d.id for d in devices[:2]]
  assert [d.id for d in step.engines.exp.mesh.devices.flat] == [d.id for d in devices[2:]]
  sent = aot.per_chip_bytes(step.engines.sampler_params)
  assert rollout.memory.resident_bytes == sent  # the next policy, published while this one decodes
  assert update.memory.resident_bytes == 0  # no copy of the policy stays on the learner's chips
  assert publish.cost.bytes_accessed == sent
  assert publish.cost.optimal_seconds == pytest.approx(sent / (topologies.CHIPS["v5e"].interconnect_bytes_per_s / 2))
