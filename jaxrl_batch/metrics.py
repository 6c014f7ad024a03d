"""`workdir/metrics.jsonl`: one JSON object per line, appended as the run goes, trimmed on resume.

In a multi-process run only process 0 writes; every process may read.
"""
import json
import math
import os

import numpy as np

from jaxrl_batch.distributed import is_main_process


def _plain(value):
  value = value.item() if isinstance(value, np.generic | np.ndarray) else value
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class MetricsLog:
  """Appends rows to `path`; each row is flushed so a killed run loses nothing it logged."""

  def __init__(self, path: str):
    self.path = path

  def write(self, row: dict) -> None:
    if not is_main_process():
      return
    with open(self.path, "a") as f:
      f.write(json.dumps({k: _plain(v) for k, v in row.items()}) + "\n")

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def truncate_after(self, step: int) -> None:
    """Drops rows logged after `step` (work a resumed run will redo); atomic replace."""
    if not is_main_process():
      return
    rows = [r for r in self.read() if r.get("step", 0) <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, self.path)
