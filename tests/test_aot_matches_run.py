"""The compile-only check compiles the programs a run executes: for configs on this machine's CPU devices, every
program the check compiles (`aot.program`, built from abstract arrays through the run's own builder,
`train.step_builder`) lowers to the text of a call the run made, lowered with the arguments the run passed."""
import re

import jax
import pytest

from configs import grpo_arith, ppo_arith
from jaxrl_batch import aot
from jaxrl_batch.rl import learner
from jaxrl_batch.sampling import continuous, engine
from jaxrl_batch.train import collector, decode_layout
from jaxrl_batch.train.trainer import Trainer
from tests.helpers import debug_config

# Where the run calls each function a program of the check compiles.
CALLED_FROM = {"update": learner, "logprobs_and_values": learner, "sample_round": collector, "generate": engine,
               "prefill_prompts": continuous, "decode_chunk": continuous, "resume_slots": continuous}


def _signature(args, kwargs) -> str:
  """What a call's lowering depends on: its arrays' shapes, dtypes and shardings, and the other arguments."""
  array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # Not a dtype (which has a shape).
  abstract = lambda x: (x.shape, x.dtype, getattr(x, "sharding", None)) if array(x) else x
  return repr(jax.tree.map(abstract, (args, kwargs)))


def _canonical(text: str) -> str:
  """Lowered text with mesh axes of size 1 left out of its shardings (`{"tensor", "fsdp"}` with tensor = 1 reads
  `{"fsdp"}`): a no-op either way. A run's arrays come out of its programs with them left out (the update's state)
  or named (a restore, as the check's abstract arrays name them)."""
  sizes = dict(re.findall(r'"(\w+)"=(\d+)', re.search(r"sdy\.mesh @mesh = <\[([^\]]*)\]>", text).group(1)))
  ones = {axis for axis, size in sizes.items() if size == "1"}
  def dims(match):
    kept = [a for a in re.findall(r'"(\w+)"', match.group(1)) if a not in ones]
    return "{" + ", ".join(f'"{a}"' for a in kept) + "}"
  return re.sub(r"\{((?:\"\w+\"(?:, )?)+)\}", dims, text)


def _record_lowered(monkeypatch) -> dict[str, set[str]]:
  """Makes each function of CALLED_FROM, and the reshard programs `decode_layout.resharder` makes, record the lowered
  text of their calls (once per signature) as the run makes them."""
  texts, seen = {name: set() for name in (*CALLED_FROM, "reshard")}, set()

  def recording(fn, name):
    def recorded(*args, **kwargs):
      signature = name + _signature(args, kwargs)
      if signature not in seen:
        seen.add(signature)
        texts[name].add(_canonical(fn.lower(*args, **kwargs).as_text()))
      return fn(*args, **kwargs)
    return recorded
  for name, module in CALLED_FROM.items():
    monkeypatch.setattr(module, name, recording(getattr(module, name), name))
  resharder = decode_layout.resharder
  monkeypatch.setattr(decode_layout, "resharder", lambda exp: recording(resharder(exp), "reshard"))
  return texts


@pytest.mark.parametrize("module,overrides,compiled", [
    (grpo_arith, {"rl.kl_coef": 0.05, "rl.old_logp": "trainer", "sampling.engine": "continuous", "sampling.slots": 4,
                  "mesh.data": 2, "mesh.fsdp": 2},
     {"update", "score", "reference", "prefill", "decode", "eval_fill", "eval"}),
    # The rollout decoded in a layout of its own, on data 2 x tensor 2 over the same 4 devices.
    (ppo_arith, {"critic.warmup_steps": 0, "mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 2,
                 "rollout_mesh.layout": "own", "rollout_mesh.data": 2, "rollout_mesh.fsdp": 1,
                 "rollout_mesh.tensor": 2},
     {"update", "score", "reshard", "rollout", "eval"}),
    # Generation on 2 chips of its own (tensor 2), ahead of the learner (fsdp 2): the policy published in its layout.
    (grpo_arith, {"rl.max_staleness": 1, "rl.old_logp": "trainer", "mesh.data": 1, "mesh.fsdp": 2,
                  "rollout_mesh.devices": 2, "rollout_mesh.data": 1, "rollout_mesh.tensor": 2},
     {"update", "score", "rollout", "eval"}),
], ids=["grpo-kl-continuous-data2-fsdp2", "ppo-static-fsdp2-tensor2-decoding-on-data2-tensor2",
        "grpo-async-fsdp2-generating-on-2-chips-tensor2"])
def test_the_check_compiles_the_programs_a_run_executes(base_cache, tmp_path, monkeypatch, module, overrides,
                                                        compiled):
  config = debug_config(base_cache, module, **overrides)
  config.sample_budget = config.batch_size  # One step, and the evaluations before and after it.
  devices = jax.devices()[:4]
  texts = _record_lowered(monkeypatch)
  Trainer(config, str(tmp_path / "run"), devices=devices).run()
  monkeypatch.undo()  # The check's programs are the functions themselves.
  step = aot.AbstractStep.build(aot.abstract_experiment(config, devices, 0, 0), devices)  # The trainer's lengths.
  checked = set()
  for name in aot.PROGRAMS:
    built = aot.program(name, step)
    if not isinstance(built, aot.Program):  # Skipped (the reason), or the publish's copy: no program.
      continue
    text = _canonical(built.lower().as_text())
    assert text in texts[built.fn.__name__], f"{name}: the check's program is none of the run's"
    checked.add(name)
  assert checked == compiled
