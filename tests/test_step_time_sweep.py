"""The members of a predicted sweep: one whose program the target's memory cannot hold is refused by name, not timed;
a program several members run is compiled once."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import grpo_gsm8k_qwen
from jaxrl_batch.analysis import planner
from jaxrl_batch.predict import step_time


@pytest.mark.slow
def test_a_decode_step_too_big_for_the_chip_is_refused_with_the_knobs(compile_only_tpu):
  compile_only_tpu("v5e:1x1")
  config = grpo_gsm8k_qwen.get_config("model=tiny_random,batch=8192,mesh=1x1x1")
  config.sampling.engine, config.sampling.slots = "continuous", 8192
  config.sample_budget = 8192
  # 8,192 slots of 256 + 8,192 tokens of the tiny model's float32 KV cache (2 layers x 2 x 2 heads x 16 x 4 bytes a
  # token): 35 GB, against a v5e chip's 16 GB.
  refused = r"Batch 8192: the decode step of 8192 slots per chip \(its cache\) does not fit: .* GiB available\. "
  with pytest.raises(step_time.DoesNotFit, match=refused + r".*sampling\.slots below 8192"):
    step_time.predict(config, "v5e:1x1", np.full(8192, 100), prompt_len=256, response_len=8192)

def test_a_sweep_keeps_the_members_that_fit_and_says_why_the_others_are_left_out(monkeypatch):
  fits = types.SimpleNamespace(seconds=1.0, samples_per_s=16.0)

  def predict(config, topology, drawn, **kw):
    if config.batch_size > 16:
      raise step_time.DoesNotFit(f"Batch {config.batch_size}: the decode step does not fit.")
    return fits

  monkeypatch.setattr(step_time, "predict", predict)
  monkeypatch.setattr(step_time, "target", lambda *a: (None, None))
  member = lambda batch: grpo_gsm8k_qwen.get_config(f"model=tiny_random,batch={batch}")
  steps = step_time.sweep(member, [16, 32], "v5e:1x1", "fixed:8", prompt_len=8, response_len=8)
  assert steps[16] is fits and str(steps[32]) == "Batch 32: the decode step does not fit."
  with pytest.raises(ValueError, match="No member fits on v5e:1x1:\nBatch 32: the decode step does not fit."):
    step_time.sweep(member, [32], "v5e:1x1", "fixed:8", prompt_len=8, response_len=8)

def test_plan_md_names_the_members_left_out():
  result = dict(planner.plan({16: 10.0, 32: 15.0}, {}, predicted=True, samples_model=(100.0, 50.0)), rule="sqrt",
                target=None, sweep=dict(topology="v5e:1x1", num_slices=1, lengths="fixed:8", prompt_tokens=8,
                                        response_tokens=8), refused=[dict(batch=64, reason="Batch 64: the decode step does not fit.")])
  assert "Not predicted: batch 64: Batch 64: the decode step does not fit." in planner.render(result)


def test_a_program_members_share_is_compiled_and_timed_once(monkeypatch):
  timed = []
  monkeypatch.setattr(step_time, "program_time", lambda compiled, rates: timed.append(compiled) or len(timed))
  timer = step_time._Timer(rates=None)  # pylint: disable=protected-access
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  lower = lambda f, n: jax.jit(f).lower(jax.ShapeDtypeStruct((n,), jnp.float32))
  time = lambda lowered: timer.time(lowered, mesh, "a program", 16, "")
  assert [time(lower(jnp.sin, 8)), time(lower(jnp.sin, 8)), time(lower(jnp.cos, 8)), time(lower(jnp.sin, 16))] == [
      1, 1, 2, 3]
