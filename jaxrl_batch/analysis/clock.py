"""The training clock and throughput of a run, from its training rows' phase seconds.

Only rollout_s + reward_s + update_s count; evaluation, checkpointing and logging time is excluded. The first
training row of a run is dominated by XLA compilation, so its seconds are excluded:
- Throughput R (samples/s) = samples consumed by training rows 2..N / their summed phase seconds; the per-phase
  costs (s/sample) divide each phase's seconds over the same rows by the same samples.
- Training clock (s) as a function of samples: 0 at samples 0; the first row's samples are charged at the run's
  steady-state rate (samples / R) instead of their compile-inflated seconds; from there it adds each later row's
  phase seconds. Between rows it is linearly interpolated in samples. With a constant step time the clock at
  samples S is exactly S / R, so no member gets its first batch for free.
"""
import numpy as np


def seconds_per_sample(train_samples: np.ndarray, phase_s: np.ndarray) -> np.ndarray:
  """(3,) rollout / reward / update seconds per sample over training rows 2..N."""
  return phase_s[1:].sum(axis=0) / (train_samples[-1] - train_samples[0])


def throughput(train_samples: np.ndarray, phase_s: np.ndarray) -> float:
  """Samples per second of training rows 2..N (rollout + reward + update)."""
  return float(1 / seconds_per_sample(train_samples, phase_s).sum())


def clock_knots(train_samples: np.ndarray, phase_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(samples, training seconds) at samples 0 and after each training row."""
  first = train_samples[0] / throughput(train_samples, phase_s)
  seconds = first + np.concatenate([[0.0], np.cumsum(phase_s[1:].sum(axis=1))])
  return np.concatenate([[0.0], train_samples]), np.concatenate([[0.0], seconds])


def clock_at(train_samples: np.ndarray, phase_s: np.ndarray, samples):
  """Training seconds at `samples` (scalar or array), interpolated between training rows."""
  return np.interp(samples, *clock_knots(train_samples, phase_s))
