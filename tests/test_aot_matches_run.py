"""The compile-only check compiles the programs a run executes: for configs on this machine's CPU devices, the text
of each program a trainer's step calls (the update, the trainer's old log-probs, the reference policy's, the static
engine's rollout), lowered with the arguments the run passed, equals the text of the check's program
(`aot.BUILDERS`), which it builds from abstract arrays through the same builder (`train.step_builder`)."""
import jax
import pytest

from configs import grpo_arith, ppo_arith
from jaxrl_batch import aot
from jaxrl_batch.rl import learner
from jaxrl_batch.train import collector
from jaxrl_batch.train.trainer import Trainer
from tests.helpers import debug_config

# Where the trainer calls each program, by the name the check gives it (the score and reference programs are the
# same function, called in that order).
CALLS = {"update": (learner, "update"), "score": (learner, "logprobs_and_values"),
         "rollout": (collector, "sample_round")}


def _record_lowered(monkeypatch, module, name: str, texts: list) -> None:
  """Makes `module.name` record the lowered text of each call before running it."""
  fn = getattr(module, name)

  def recorded(*args, **kwargs):
    texts.append(fn.lower(*args, **kwargs).as_text())
    return fn(*args, **kwargs)
  monkeypatch.setattr(module, name, recorded)


@pytest.mark.parametrize("module,overrides", [
    (grpo_arith, {"rl.kl_coef": 0.05, "rl.old_logp": "trainer", "mesh.data": 2, "mesh.fsdp": 2}),
    (ppo_arith, {"critic.warmup_steps": 0, "mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 2}),
], ids=["grpo-kl-data2-fsdp2", "ppo-fsdp2-tensor2"])
def test_the_check_lowers_the_programs_a_run_executes(base_cache, tmp_path, monkeypatch, module, overrides):
  config = debug_config(base_cache, module, **overrides)
  config.sample_budget = config.batch_size  # One step.
  devices = jax.devices()[:4]
  texts = {name: [] for name in CALLS}
  for name, (module, attr) in CALLS.items():
    _record_lowered(monkeypatch, module, attr, texts[name])
  trainer = Trainer(config, str(tmp_path / "run"), devices=devices)
  trainer.run()
  run = dict(update=texts["update"][0], score=texts["score"][0], rollout=texts["rollout"][0])
  if trainer.algo.use_kl:
    run["reference"] = texts["score"][1]
  monkeypatch.undo()  # The check's programs are the functions themselves.
  step = aot.AbstractStep.build(aot.abstract_experiment(config, devices, 0, 0))  # The trainer's lengths.
  for name, text in run.items():
    fn, args, kwargs, _, _ = aot.BUILDERS[name](step)
    with jax.set_mesh(step.exp.mesh):
      assert fn.lower(*args, **kwargs).as_text() == text, name
