"""Percentile-bootstrap interval of a mean over seeds (fixed RNG seed, so reports are reproducible)."""
import numpy as np

LEVEL = 0.9  # Two-sided coverage of the interval.
RESAMPLES = 2000  # Bootstrap resamples of the seeds.
RNG_SEED = 0


def mean_ci(values: list[float]) -> list[float] | None:
  """[lo, hi] of the mean of `values` resampled with replacement; [x, x] for one value, None for none."""
  if not values:
    return None
  values = np.asarray(values, float)
  rng = np.random.default_rng(RNG_SEED)
  means = values[rng.integers(0, len(values), size=(RESAMPLES, len(values)))].mean(axis=1)
  tail = 100 * (1 - LEVEL) / 2
  lo, hi = np.percentile(means, [tail, 100 - tail])
  return [float(lo), float(hi)]
