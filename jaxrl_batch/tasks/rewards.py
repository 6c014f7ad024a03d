"""Rewards that never stop a run: a raising reward function scores 0 for that sample and is counted."""
import numpy as np


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
