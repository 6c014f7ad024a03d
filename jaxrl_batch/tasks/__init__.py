"""Task registry: `make_task(config.task.name, config.task)`, and the scorer of its rewards: `make_scorer`.

Task modules are imported on first use, so `python -m jaxrl_batch.tasks.<module>` runs without double imports.
"""
import importlib

from jaxrl_batch.tasks.base import Problem, Task
from jaxrl_batch.tasks.rewards import RewardScorer

# Fields of `config.task` that configure the scoring of any task, not the task itself, and their defaults.
SCORING_FIELDS = {
    "reward_timeout_s": 30.0,  # Seconds one sample's reward may take; past it it scores 0 and is counted. 0 = none.
    "reward_workers": 1,  # Threads running the reward function (raise it for verifiers that wait on I/O).
    "stream_rewards": True,  # Continuous engine: score responses as they end, while decoding goes on.
    # Consecutive steps whose every sample's reward failed before the trainer stops the run (0 = never).
    "max_failed_reward_steps": 5,
}

TASKS = {  # name -> "module:class"
    "arithmetic": "jaxrl_batch.tasks.arithmetic:ArithmeticTask",
    "gsm8k": "jaxrl_batch.tasks.gsm8k:Gsm8kTask",
    "math": "jaxrl_batch.tasks.math_boxed:MathTask",
    "countdown": "jaxrl_batch.tasks.countdown:CountdownTask",
    "long_addition": "jaxrl_batch.tasks.long_addition:LongAdditionTask",
}


def make_task(name: str, task_cfg) -> Task:
  """Builds the task registered as `name` from its config group (a ConfigDict or dict).

  The group may carry a `name` field; it must equal `name`, and `SCORING_FIELDS`: neither is passed to the task.
  """
  if name not in TASKS:
    raise ValueError(f"Unknown task {name!r}; known tasks: {sorted(TASKS)}.")
  fields = {key: task_cfg[key] for key in task_cfg.keys() if key != "name" and key not in SCORING_FIELDS}
  if "name" in task_cfg and task_cfg["name"] != name:
    raise ValueError(f"make_task({name!r}) got a config with name={task_cfg['name']!r}; pass matching names.")
  module_name, class_name = TASKS[name].split(":")
  return getattr(importlib.import_module(module_name), class_name)(fields)


def make_scorer(task: Task, task_cfg) -> RewardScorer:
  """The scorer of `task.reward` with the config group's `SCORING_FIELDS` (missing ones take their defaults)."""
  fields = {key: task_cfg[key] if key in task_cfg else default for key, default in SCORING_FIELDS.items()}
  # task.reward is looked up at each call, so a reward swapped on the task object (a wrapper, a test) is the one used.
  return RewardScorer(lambda completion, problem: task.reward(completion, problem), workers=fields["reward_workers"],
                      timeout_s=fields["reward_timeout_s"], stream=fields["stream_rewards"])


__all__ = ["Problem", "RewardScorer", "SCORING_FIELDS", "Task", "TASKS", "make_scorer", "make_task"]
