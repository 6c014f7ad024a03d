"""A step's scored rollouts: what the rollout side hands the learner."""
from typing import NamedTuple

import jax


class Rollouts(NamedTuple):
  """A step's scored rollouts, on the device (batch-sharded), B = rows trained this step.

  prompt_BxP / prompt_valid_BxP: left-padded prompts; tokens_BxN, logprobs_BxN, mask_BxN: the sampler's output;
  rewards_B: float32 task rewards after any overlong penalty; trained_B: bool, rows whose tokens enter the loss;
  experts_BxTxLxK: the sampler's routing of a mixture-of-experts model (`sampling.Rollout.experts_BxTxLxK`), None
  for a dense model or where it is not recorded (partial rollouts).
  """
  prompt_BxP: jax.Array
  prompt_valid_BxP: jax.Array
  tokens_BxN: jax.Array
  logprobs_BxN: jax.Array
  mask_BxN: jax.Array
  rewards_B: jax.Array
  trained_B: jax.Array
  experts_BxTxLxK: jax.Array | None = None
