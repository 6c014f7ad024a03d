"""Overlong responses: mask them out of the loss, or penalise length near the budget (DAPO's soft punishment)."""
import numpy as np


def overlong_penalty(lengths_B: np.ndarray, truncated_B: np.ndarray, max_len: int, buffer: int,
                     penalty: float) -> np.ndarray:
  """Reward offsets float32_B: 0 up to max_len - buffer tokens, then linear down to -penalty at max_len; a truncated
  response (no EOS within max_len) gets -penalty."""
  start = max_len - buffer
  ramp_B = np.clip((lengths_B - start) / max(buffer, 1), 0.0, 1.0) if buffer > 0 else np.zeros(len(lengths_B))
  return (-penalty * np.where(truncated_B, 1.0, ramp_B)).astype(np.float32)
