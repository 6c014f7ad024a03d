"""Percentile-bootstrap intervals over seeds: of a mean, and of a ratio of two members' means, independent or paired
by seed (fixed RNG seed, so reports are reproducible)."""
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


def ratio_ci(numerator: list[float], denominator: list[float], paired: bool = False) -> list[float] | None:
  """[lo, hi] of mean(numerator) / mean(denominator): the two resampled independently (two members' seeds), or with
  `paired` (equal lengths, value i of both from seed i) the same seeds drawn for both, so what the seeds share
  (their warm start) cancels in the ratio; the point ratio twice when each has one value, None when either has
  none."""
  if not numerator or not denominator:
    return None
  if paired and len(numerator) != len(denominator):
    raise ValueError(f"paired ratio_ci needs one value per seed in both: {len(numerator)} vs {len(denominator)}.")
  rng = np.random.default_rng(RNG_SEED)
  pick = lambda x: rng.integers(0, len(x), size=(RESAMPLES, len(x)))
  num, den = np.asarray(numerator, float), np.asarray(denominator, float)
  if paired:
    rows = pick(num)
    ratios = num[rows].mean(axis=1) / den[rows].mean(axis=1)
  else:
    ratios = num[pick(num)].mean(axis=1) / den[pick(den)].mean(axis=1)
  tail = 100 * (1 - LEVEL) / 2
  lo, hi = np.percentile(ratios, [tail, 100 - tail])
  return [float(lo), float(hi)]
