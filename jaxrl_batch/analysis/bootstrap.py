"""Percentile-bootstrap intervals over seeds: of a mean, and of a ratio of two members' means (fixed RNG seed, so
reports are reproducible)."""
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


def ratio_ci(numerator: list[float], denominator: list[float]) -> list[float] | None:
  """[lo, hi] of mean(numerator) / mean(denominator), the two resampled independently (two members' seeds); the
  point ratio twice when each has one value, None when either has none."""
  if not numerator or not denominator:
    return None
  rng = np.random.default_rng(RNG_SEED)
  draw = lambda x: np.asarray(x, float)[rng.integers(0, len(x), size=(RESAMPLES, len(x)))].mean(axis=1)
  ratios = draw(numerator) / draw(denominator)
  tail = 100 * (1 - LEVEL) / 2
  lo, hi = np.percentile(ratios, [tail, 100 - tail])
  return [float(lo), float(hi)]
