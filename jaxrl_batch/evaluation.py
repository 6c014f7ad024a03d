"""Held-out evaluation: greedy decoding on the task's fixed eval split."""
import jax
import numpy as np

from jaxrl_batch.distributed import to_host
from jaxrl_batch.experiment import Experiment
from jaxrl_batch.sampling import SamplingParams, generate
from jaxrl_batch.sharding import data_parallel_size


def safe_rewards(task, completions, problems) -> tuple[np.ndarray, int, str | None]:
  """Rewards as float32_B; a task whose reward raises scores 0 for that sample instead of stopping the run.

  Returns (rewards_B, number of reward errors, first error message or None).
  """
  rewards, errors, first = [], 0, None
  for completion, problem in zip(completions, problems):
    try:
      rewards.append(float(task.reward(completion, problem)))
    except Exception as e:  # A user reward function must never crash the run.
      errors += 1
      first = first or f"{type(e).__name__}: {e}"
      rewards.append(0.0)
  return np.asarray(rewards, np.float32), errors, first


def eval_accuracy(exp: Experiment, graphdef, params) -> float:
  """Mean greedy reward (0..1) over the held-out problems."""
  problems = exp.task.eval_problems()
  dp = data_parallel_size(exp.mesh)
  padded = problems + problems[: (-len(problems)) % dp]
  tokens, valid = exp.shard_batch(exp.encode_prompts(padded))
  with jax.set_mesh(exp.mesh):
    out = generate(graphdef, params, tokens, valid, jax.random.key(0), max_new_tokens=exp.response_len,
                   eos_id=exp.stop_id, pad_id=exp.tokenizer.pad_id, sampling=SamplingParams(temperature=0.0))
  completions = exp.decode_responses(*to_host((out.tokens_BxN, out.mask_BxN)))
  rewards, _, _ = safe_rewards(exp.task, completions[: len(problems)], problems)
  return float(rewards.mean())
