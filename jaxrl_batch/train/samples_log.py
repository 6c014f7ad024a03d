"""samples.jsonl: a few of a step's rollouts as text, so a user sees what the policy writes and how it is scored.

Every `log_samples_every_steps` steps the first `log_samples_count` rollouts of the step's batch (with the default
layout, one prompt's group) are appended, one JSON row each: step, samples, prompt, answer (the reference),
completion, reward (the task's, before any overlong penalty), length (tokens) and truncated. Texts longer than
`log_samples_max_chars` keep their head and tail around a marker. Only process 0 writes; a resumed run drops the rows
past the step it resumes from, like metrics.jsonl.
"""
import json
import os
from collections.abc import Sequence

import numpy as np

from jaxrl_batch.runtime.distributed import is_main_process

SAMPLES = "samples.jsonl"
CUT = " [...] "


def examples(problems: Sequence, completions: Sequence[str], rewards_B: np.ndarray, lengths_B: np.ndarray,
             truncated_B: np.ndarray) -> list[dict]:
  """One dict per rollout: prompt, answer, completion, reward, length, truncated (JSON-ready)."""
  return [dict(prompt=p.prompt, answer=p.answer, completion=c, reward=float(r), length=int(n), truncated=bool(t))
          for p, c, r, n, t in zip(problems, completions, rewards_B, lengths_B, truncated_B)]


def shorten(text: str, max_chars: int) -> str:
  """`text`, or its head and tail around CUT when it is longer than max_chars (0 = no limit)."""
  if max_chars <= 0 or len(text) <= max_chars:
    return text
  keep = max(max_chars - len(CUT), 2)
  return text[: keep - keep // 2] + CUT + text[len(text) - keep // 2:]


class SamplesLog:
  """Appends example rows to `<run_dir>/samples.jsonl`."""

  def __init__(self, run_dir: str, max_chars: int):
    self.path, self.max_chars = os.path.join(run_dir, SAMPLES), max_chars

  def write(self, step: int, samples: int, rows: list[dict]) -> None:
    if not is_main_process() or not rows:
      return
    with open(self.path, "a") as f:
      for row in rows:
        row = {k: shorten(v, self.max_chars) if isinstance(v, str) else v for k, v in row.items()}
        f.write(json.dumps(dict(step=step, samples=samples, **row)) + "\n")

  def truncate_after(self, step: int) -> None:
    """Drops rows logged after `step` (a resumed run logs them again); atomic replace. A torn last line is dropped."""
    if not is_main_process() or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = f.readlines()
    keep = []
    for line in lines:
      try:
        if json.loads(line)["step"] <= step:
          keep.append(line if line.endswith("\n") else line + "\n")
      except (ValueError, KeyError):
        continue  # A row torn by a crash: samples.jsonl is a log for reading, never an input.
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(keep)
    os.replace(tmp, self.path)
