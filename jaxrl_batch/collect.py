"""A step's rollouts: sample group_size responses per prompt, score them, and apply dynamic sampling and overlong
handling. Returns host arrays ready for `Learner.prepare`.

Round r of step s draws its prompts with seed (seed, r) and its sampling key from (seed, s, r): round 0 is exactly
the run without dynamic sampling, and a resumed run replays every round.
"""
import logging
import time

import jax
import numpy as np

from jaxrl_batch.distributed import to_host
from jaxrl_batch.evaluation import safe_rewards
from jaxrl_batch.experiment import Experiment
from jaxrl_batch.rl.advantages import zero_std_group_frac, zero_std_groups
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.learner import Rollouts
from jaxrl_batch.rl.overlong import overlong_penalty
from jaxrl_batch.sampling import generate

_ROUND_SEED_STRIDE = 1_000_003  # Seeds of refill rounds: seed + r * stride (never another run's round-0 seed).


class Collector:
  """Produces each step's `Rollouts` for `num_prompts` prompts x `group_size` samples."""

  def __init__(self, exp: Experiment, algo: AlgoConfig, num_prompts: int, group_size: int, seed: int):
    self.exp, self.algo = exp, algo
    self.num_prompts, self.group_size, self.seed = num_prompts, group_size, seed

  def _round(self, graphdef, params, step: int, r: int):
    """One round of sampling and scoring: (host arrays and timings dict, reward errors, first error)."""
    exp, g = self.exp, self.group_size
    problems = exp.task.train_problems(self.seed + r * _ROUND_SEED_STRIDE, step, self.num_prompts)
    prompt_BxP, prompt_valid_BxP = (np.repeat(x, g, axis=0) for x in exp.encode_prompts(problems))
    tokens, valid = exp.shard_batch((prompt_BxP, prompt_valid_BxP))
    rng = jax.random.fold_in(jax.random.key(self.seed), step)
    if r:
      rng = jax.random.fold_in(rng, r)
    t0 = time.time()
    with jax.set_mesh(exp.mesh):
      rollout = generate(graphdef, params, tokens, valid, rng, max_new_tokens=exp.response_len,
                         eos_id=exp.stop_id, pad_id=exp.tokenizer.pad_id, sampling=exp.sampling,
                         group_size=g)  # One prefill per prompt, its KV shared by the group.
    rollout = jax.block_until_ready(rollout)
    t1 = time.time()
    out = dict(prompt_BxP=prompt_BxP, prompt_valid_BxP=prompt_valid_BxP, **to_host(rollout)._asdict())
    completions = exp.decode_responses(out["tokens_BxN"], out["mask_BxN"])
    rewards_B, errors, first = safe_rewards(exp.task, completions, [p for p in problems for _ in range(g)])
    out.update(task_rewards_B=rewards_B, rollout_s=t1 - t0, reward_s=time.time() - t1)
    return out, errors, first

  def collect(self, graphdef, params, step: int) -> tuple[Rollouts, dict]:
    """The step's rollouts and statistics (timings, reward and length statistics over every generated rollout,
    `samples_generated`, `sampling_rounds`)."""
    algo, g = self.algo, self.group_size
    rounds, kept, dropped = [], [], []
    for r in range(algo.max_sampling_rounds if algo.dynamic_sampling else 1):
      out, errors, first = self._round(graphdef, params, step, r)
      if errors:
        logging.warning("Step %d: the reward function raised on %d samples (scored 0); first: %s", step, errors,
                        first)
      out["errors"] = errors
      rounds.append(out)
      informative_G = (~zero_std_groups(out["task_rewards_B"], g) if algo.dynamic_sampling
                       else np.ones(self.num_prompts, bool))
      kept += [(out, i) for i in np.flatnonzero(informative_G)]
      dropped += [(out, i) for i in np.flatnonzero(~informative_G)]
      if len(kept) >= self.num_prompts:
        break
    # Short of informative groups after the last round: fill the batch with dropped ones (their group advantages
    # are 0), so that a step always trains on a full batch and the run reaches its budget.
    groups = kept[:self.num_prompts] + dropped[:max(self.num_prompts - len(kept), 0)]

    def take(key):
      return np.concatenate([out[key][i * g:(i + 1) * g] for out, i in groups])

    truncated_B, lengths_B = take("truncated_B"), take("lengths_B")
    rewards_B = take("task_rewards_B")
    trained_B = np.ones(len(rewards_B), bool)
    if algo.overlong == "penalty":
      rewards_B = rewards_B + overlong_penalty(lengths_B, truncated_B, self.exp.response_len, algo.overlong_buffer,
                                               algo.overlong_penalty)
    elif algo.overlong == "mask":
      trained_B = trained_B & ~truncated_B
    rollouts = Rollouts(take("prompt_BxP"), take("prompt_valid_BxP"), take("tokens_BxN"), take("logprobs_BxN"),
                        take("mask_BxN").astype(bool), rewards_B.astype(np.float32), trained_B)
    every = {k: np.concatenate([out[k] for out in rounds]) for k in ("task_rewards_B", "lengths_B", "truncated_B")}
    stats = dict(rollout_s=sum(out["rollout_s"] for out in rounds), reward_s=sum(out["reward_s"] for out in rounds),
                 samples_generated=len(every["task_rewards_B"]),
                 sampling_rounds=len(rounds), reward_mean=float(every["task_rewards_B"].mean()),
                 reward_std=float(every["task_rewards_B"].std()),
                 response_len_mean=float(every["lengths_B"].mean()),
                 truncated_frac=float(every["truncated_B"].mean()),
                 zero_std_group_frac=float(zero_std_group_frac(every["task_rewards_B"], g)) if g > 1 else 0.0,
                 reward_errors=int(sum(out["errors"] for out in rounds)), trained_samples=int(trained_B.sum()))
    return rollouts, stats
