"""`train.aot`: the trainer's programs compiled for a TPU slice this machine does not have (libtpu's compile-only
devices), their memory per chip and costs; `launch.aot_check` writes them as JSON."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import grpo_gsm8k_qwen
from jaxrl_batch.runtime import topologies
from jaxrl_batch.train import aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OOM = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (21.77G) exceeds "
       "available HBM (15.75G).")


@pytest.fixture(scope="module")
def libtpu():
  """Skips (with the reason) where libtpu cannot give compile-only v5e:2x2 devices."""
  pytest.importorskip("libtpu", reason="libtpu is not installed (pip install 'jax[tpu]')")
  try:
    topologies.compile_only("v5e:2x2")
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"libtpu cannot load a compile-only v5e:2x2 here: {e}")


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
def test_a_plan_too_big_for_hbm_is_reported_not_raised():
  config = grpo_gsm8k_qwen.get_config("model=tiny_random")
  config.model.vocab_size = 40_000_000  # Logits and embedding gradients of a 40M-row table: > 100 GiB per chip.
  report = aot.check(config, "v5e:2x2", programs=("update",), prompt_len=32, response_len=32)
  update = report.program("update")
  assert update.status == "does_not_fit" and "RESOURCE_EXHAUSTED" in update.message, update.message
  assert update.memory.temp_bytes > update.memory.hbm_bytes == topologies.CHIPS["v5e"].hbm_bytes
  assert update.verdict.startswith("does not fit")
  assert any(k.startswith("micro_batch_size") for k in update.knobs)
  assert any(k.startswith("model.remat") for k in update.knobs)
  assert "does not fit" in report.table()


@pytest.mark.usefixtures("libtpu")
def test_cli_compiles_the_update_for_v5e_with_its_memory_and_costs(tmp_path):
  # tiny_random: 16 rollouts in micro-batches of 8 (2 per update) on a 4-chip data-parallel mesh.
  cmd = [sys.executable, "-m", "launch.aot_check", "--config=configs/grpo_gsm8k_qwen.py:model=tiny_random",
         "--topology=v5e:2x2", "--programs=update,score", "--prompt_tokens=64", "--response_tokens=64",
         f"--out={tmp_path}"]
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
  exp = aot._experiment(config, jax.devices(), 64, 64)  # pylint: disable=protected-access
  step = aot._Step.build(exp)  # pylint: disable=protected-access
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
def test_chunked_logits_and_rollout_blocks_compile_for_v5e():
  """The update's temporaries with 32-position logit chunks are under half the whole-sequence form's (a 40,000-token
  vocabulary makes the float32 logits dominate); the rollout compiles as one block of all rows and as blocks of
  `sampling.slots` (a PRNG key argument)."""
  config = grpo_gsm8k_qwen.get_config("model=tiny_random")
  config.model.vocab_size = 40_000

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
