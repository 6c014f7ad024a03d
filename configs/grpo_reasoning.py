r"""GRPO on long addition worked column by column (`tasks.long_addition`): the reasoning-length workload of issue 16,
still being calibrated.

Responses are worked traces of ~42 tokens on average with a long tail (up to 123), generation uses the continuous
engine and updates are packed. Measured 2026-12-05 on the 2-core CPU (base member B = 32, 1M-parameter model):
  - the warm start (160 SFT steps on every length) solves 0.35 of the 768 held-out problems greedily (0.14 sampled
    at temperature 1): all 2-digit ones, about half of the 5-digit ones, none past 7 digits; 140 steps give 0.00,
    170 give 0.42, 200 give 0.65;
  - a step takes ~0.65 s (rollout ~0.1 s, update ~0.2-0.4 s: generation is not yet most of a step);
  - RL does not yet improve held-out accuracy: at lr 5e-5 the training reward rises from ~0.12 to ~0.2 over 9k
    samples while greedy held-out accuracy falls to ~0.3; at 1.2e-4 and 3e-4 the policy collapses.
So this family does not yet meet issue 16's criteria (RL that improves the skill gradually; its throughput across
the family is not measured yet), and the study is not run on it.

  python -m launch.train --config=configs/grpo_reasoning.py --workdir=/tmp/reasoning
"""
import ml_collections

from configs import grpo_arith
from jaxrl_batch.tasks import SCORING_FIELDS, long_addition

BASE_BATCH = 32  # B0: the family's reference member (8 prompts x 4 samples).
BASE_LR = 5e-5  # lr0 at B0 (Adam).
GROUP_SIZE = 4  # Samples per prompt when the family scales prompts per step.


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: as configs/grpo_arith.py ('batch=...,lr_rule=...,seed=...,family_axis=...,debug,moe'); the base member
  is B0 = 32 (`debug`: the grpo_arith debug model on short problems)."""
  parsed = grpo_arith.parse(arg)
  c = grpo_arith.get_config(arg)
  scoring = {key: c.task[key] for key in SCORING_FIELDS}  # Reward timeout, workers, streaming: as grpo_arith.
  c.task = long_addition.default_config()
  c.task.name = "long_addition"  # Registered task name (jaxrl_batch.tasks.TASKS).
  c.task.update(scoring)
  c.batch_size = parsed.batch or BASE_BATCH
  by_prompts = parsed.family_axis == "prompts"
  c.group_size = GROUP_SIZE if by_prompts else 0
  c.num_prompts = 0 if by_prompts else BASE_BATCH // GROUP_SIZE
  c.micro_batch_size = 0
  c.micro_batch_tokens = 2048  # Packed updates: ~14 rows of prompt + response per micro-batch.
  c.extra_response_tokens = 8
  c.sampling.update(engine="continuous", slots=0, chunk=16)
  c.optim.update(base_lr=BASE_LR, base_batch=BASE_BATCH, warmup_samples=256)
  c.sample_budget = 16_384
  c.eval_every_samples = 512
  c.checkpoint_every_samples = 2048
  c.sft.update(steps=160, batch_size=64, lr=3e-3, warmup_steps=30)  # Held-out 0.35 (see above).
  if parsed.debug:  # Runs end to end in ~25 s on the CPU (operands of 2-6 digits, 128 samples); learning not tuned.
    c.task.update(max_digits=6, num_eval=32)
    c.sample_budget, c.eval_every_samples, c.checkpoint_every_samples = 128, 64, 64
  return c


def sweep() -> list[dict]:
  """The study's members: sqrt, none and linear over 16..128 rollouts per update (8x)."""
  return [dict(batch=b, lr_rule=rule) for rule in ("sqrt", "none", "linear") for b in (16, 32, 64, 128)]
