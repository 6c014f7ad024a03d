"""Task registry: `make_task(config.task.name, config.task)`.

Task modules are imported on first use, so `python -m jaxrl_batch.tasks.<module>` runs without double imports.
"""
import importlib

from jaxrl_batch.tasks.base import Problem, Task

TASKS = {  # name -> "module:class"
    "arithmetic": "jaxrl_batch.tasks.arithmetic:ArithmeticTask",
    "gsm8k": "jaxrl_batch.tasks.gsm8k:Gsm8kTask",
    "math": "jaxrl_batch.tasks.math_boxed:MathTask",
    "countdown": "jaxrl_batch.tasks.countdown:CountdownTask",
}


def make_task(name: str, task_cfg) -> Task:
  """Builds the task registered as `name` from its config group (a ConfigDict or dict).

  The group may carry a `name` field; it must equal `name` and is not passed to the task.
  """
  if name not in TASKS:
    raise ValueError(f"Unknown task {name!r}; known tasks: {sorted(TASKS)}.")
  fields = {key: task_cfg[key] for key in task_cfg.keys() if key != "name"}
  if "name" in task_cfg and task_cfg["name"] != name:
    raise ValueError(f"make_task({name!r}) got a config with name={task_cfg['name']!r}; pass matching names.")
  module_name, class_name = TASKS[name].split(":")
  return getattr(importlib.import_module(module_name), class_name)(fields)


__all__ = ["Problem", "Task", "TASKS", "make_task"]
