"""The training clock and throughput of a run, from its training rows' phase seconds.

Only rollout_s + reward_s + update_s count; evaluation, checkpointing and logging time is excluded. *Cold* rows,
the first training row of a run and of every resumed session (`cold: true` in metrics.jsonl; the first row when
the field is absent), are dominated by XLA compilation, so their seconds are excluded:
- Throughput R (samples/s) = samples consumed by warm rows / their summed phase seconds; the per-phase costs
  (s/sample) divide each phase's seconds over the same rows by the same samples.
- Training clock (s) as a function of samples: 0 at samples 0; a cold row's samples are charged at the run's
  steady-state rate (samples / R) instead of their compile-inflated seconds; a warm row adds its phase seconds.
  Between rows it is linearly interpolated in samples. With a constant step time the clock at samples S is exactly
  S / R, so no member gets its first batch (or the batch after a resume) for free.
"""
import numpy as np


def first_row_cold(n: int) -> np.ndarray:
  """(N,) bool: only the first row is cold (logs without the `cold` field)."""
  return np.arange(n) == 0


def _cold(train_samples: np.ndarray, cold: np.ndarray | None) -> np.ndarray:
  return first_row_cold(len(train_samples)) if cold is None else np.asarray(cold, bool)


def seconds_per_sample(train_samples: np.ndarray, phase_s: np.ndarray, cold: np.ndarray | None = None) -> np.ndarray:
  """(3,) rollout / reward / update seconds per sample over the warm training rows."""
  warm = ~_cold(train_samples, cold)
  step_samples = np.diff(train_samples, prepend=0.0)
  return phase_s[warm].sum(axis=0) / step_samples[warm].sum()


def throughput(train_samples: np.ndarray, phase_s: np.ndarray, cold: np.ndarray | None = None) -> float:
  """Samples per second of the warm training rows (rollout + reward + update)."""
  return float(1 / seconds_per_sample(train_samples, phase_s, cold).sum())


def clock_knots(train_samples: np.ndarray, phase_s: np.ndarray,
                cold: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(samples, training seconds) at samples 0 and after each training row."""
  cold = _cold(train_samples, cold)
  step_samples = np.diff(train_samples, prepend=0.0)
  step_s = np.where(cold, step_samples / throughput(train_samples, phase_s, cold), phase_s.sum(axis=1))
  return np.concatenate([[0.0], train_samples]), np.concatenate([[0.0], np.cumsum(step_s)])


def clock_at(train_samples: np.ndarray, phase_s: np.ndarray, samples, cold: np.ndarray | None = None):
  """Training seconds at `samples` (scalar or array), interpolated between training rows."""
  return np.interp(samples, *clock_knots(train_samples, phase_s, cold))
