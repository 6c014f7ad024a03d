"""Held-out evaluation: greedy decoding on the task's fixed eval split."""
import logging

import jax

from jaxrl_batch.runtime.distributed import to_host
from jaxrl_batch.runtime.sharding import data_parallel_size
from jaxrl_batch.sampling import SamplingParams, generate
from jaxrl_batch.train.setup import Experiment


def evaluate(exp: Experiment, graphdef, params) -> dict:
  """{eval_accuracy: mean greedy reward (0..1), eval_reward_errors: rewards that raised or timed out} over the
  held-out problems; such a reward scores 0, is counted, and the first error is logged."""
  problems = exp.task.eval_problems()
  dp = data_parallel_size(exp.mesh)
  padded = problems + problems[: (-len(problems)) % dp]
  tokens, valid = exp.shard_batch(exp.encode_prompts(padded))
  with jax.set_mesh(exp.mesh):
    out = generate(graphdef, params, tokens, valid, jax.random.key(0), max_new_tokens=exp.response_len,
                   eos_id=exp.stop_id, pad_id=exp.tokenizer.pad_id, sampling=SamplingParams(temperature=0.0))
  completions = exp.decode_responses(*to_host((out.tokens_BxN, out.mask_BxN)))
  scores = exp.scorer.score(completions[: len(problems)], problems)
  failures = scores.failures()
  if failures:
    logging.warning("Evaluation: the reward function %s", failures)
  return dict(eval_accuracy=float(scores.rewards_B.mean()), eval_reward_errors=scores.errors + scores.timeouts)


def eval_accuracy(exp: Experiment, graphdef, params) -> float:
  """Mean greedy reward (0..1) over the held-out problems."""
  return evaluate(exp, graphdef, params)["eval_accuracy"]
