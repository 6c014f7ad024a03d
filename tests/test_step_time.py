"""`predict.step_time`: a member's step predicted from its programs compiled for a TPU slice (libtpu's compile-only
devices): the parts add up as the engine's schedule and the loop counts say, and decode being bandwidth-bound at low
concurrency, a 4x larger batch is predicted to train more rollouts per second."""
import numpy as np
import pytest

from configs import grpo_gsm8k_qwen
from jaxrl_batch.predict import engine_time, step_time

PROMPT, RESPONSE = 32, 32


def _lengths(batch: int, seed: int = 0):
  return np.random.default_rng(seed).integers(1, RESPONSE + 1, batch)


def _config(batch: int, **sampling):
  config = grpo_gsm8k_qwen.get_config(f"model=tiny_random,batch={batch}")
  config.sampling.update(sampling)
  return config


@pytest.mark.slow
def test_the_step_is_its_programs_times_the_engines_schedule(compile_only_tpu):
  compile_only_tpu("v5e:2x2")
  config = _config(16, engine="continuous", slots=2, chunk=4)
  lengths = _lengths(16)
  got = step_time.predict(config, "v5e:2x2", lengths, prompt_len=PROMPT, response_len=RESPONSE)
  schedule = engine_time.continuous(lengths, slots=8, chunk=4, max_new_tokens=RESPONSE, prompt_len=PROMPT,
                                    group_size=4, backend="pallas")
  assert got.schedule == schedule and got.schedule.decode_steps > 0
  decode, prefill, update = (got.programs[name].seconds for name in ("decode", "prefill", "update"))
  assert got.rollout.decode_s == pytest.approx(schedule.decode_steps * decode)
  assert got.rollout.prefill_s == pytest.approx(prefill)  # one prefill of the step's 4 prompts
  assert "reference" not in got.programs and got.reference_s == 0.0  # rl.kl_coef = 0
  assert got.update_s == pytest.approx(update * 2)  # 16 rollouts in micro-batches of 8
  assert got.seconds == pytest.approx(got.rollout.seconds + got.score_s + got.update_s)
  assert got.samples_per_s == pytest.approx(16 / got.seconds)


@pytest.mark.slow
def test_a_larger_batch_decodes_more_rows_a_step_at_nearly_the_same_cost(compile_only_tpu):
  """Static engine: the step of 64 rows costs less than 4 steps of 16 (the weights are read once a step)."""
  compile_only_tpu("v5e:2x2")
  small, large = (step_time.predict(_config(b), "v5e:2x2", _lengths(b), prompt_len=PROMPT, response_len=RESPONSE)
                  for b in (16, 64))
  assert large.programs["decode"].seconds < 4 * small.programs["decode"].seconds
  assert large.samples_per_s > small.samples_per_s


def test_lengths_must_be_one_a_rollout():
  with pytest.raises(ValueError, match="one a rollout"):
    step_time.predict(_config(16), "v5e:2x2", _lengths(8), prompt_len=PROMPT, response_len=RESPONSE)
