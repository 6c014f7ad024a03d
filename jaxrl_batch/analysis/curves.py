"""Evaluation curves (held-out accuracy as a function of samples): smoothing, target crossing, seed means, gaps.

- Smoothing `k` (odd): centred moving average over k evaluation points; near the ends the window shrinks
  symmetrically to the points available, so the first and last points are kept as they are. k = 1 is none.
- Samples-to-target S: the first crossing of the target, linearly interpolated between the two evaluation points
  around it; S is the first point's samples if that point is already >= target, None (censored) if never reached.
- Mean curve of seeds: each seed's curve linearly interpolated onto the union of their evaluation samples, over
  the range all seeds cover, then averaged.
- Gap between two curves: mean |accuracy difference| over the sample range both cover (exact integral of the
  piecewise-linear difference divided by the range's length, in accuracy units).
"""
import numpy as np

Curve = tuple[np.ndarray, np.ndarray]  # (samples (E,), accuracy (E,)), samples increasing.


def check_smooth(k: int) -> None:
  if k < 1 or k % 2 == 0:
    raise ValueError(f"smooth must be an odd number of evaluation points >= 1, got {k}; use 1 (none), 3 or 5.")


def smooth(accuracy: np.ndarray, k: int) -> np.ndarray:
  """Centred moving average over `k` evaluation points (window shrinks symmetrically at the ends)."""
  check_smooth(k)
  accuracy = np.asarray(accuracy, float)
  n, half = len(accuracy), k // 2
  radius = [min(half, i, n - 1 - i) for i in range(n)]
  return np.array([accuracy[i - r:i + r + 1].mean() for i, r in enumerate(radius)])


def samples_to_target(samples: np.ndarray, accuracy: np.ndarray, target: float) -> float | None:
  """First sample count at which `accuracy` reaches `target` (linear interpolation); None if never."""
  hits = np.flatnonzero(accuracy >= target)
  if hits.size == 0:
    return None
  i = int(hits[0])
  if i == 0:
    return float(samples[0])
  s0, s1, a0, a1 = samples[i - 1], samples[i], accuracy[i - 1], accuracy[i]
  return float(s0 + (target - a0) / (a1 - a0) * (s1 - s0))


def _grid(curves: list[Curve], lo: float, hi: float) -> np.ndarray:
  """Union of the curves' samples within [lo, hi], with both ends."""
  points = np.concatenate([s for s, _ in curves] + [np.array([lo, hi])])
  return np.unique(points[(points >= lo) & (points <= hi)])


def mean_curve(curves: list[Curve]) -> Curve:
  """Seed-mean of `curves` over the sample range they all cover."""
  lo, hi = max(s[0] for s, _ in curves), min(s[-1] for s, _ in curves)
  grid = _grid(curves, lo, hi)
  return grid, np.mean([np.interp(grid, s, a) for s, a in curves], axis=0)


def mean_abs_gap(a: Curve, b: Curve) -> float | None:
  """Mean |a - b| over the samples both curves cover; None if they share no range."""
  lo, hi = max(a[0][0], b[0][0]), min(a[0][-1], b[0][-1])
  if hi <= lo:
    return None
  grid = _grid([a, b], lo, hi)
  d = np.interp(grid, *a) - np.interp(grid, *b)
  d0, d1, width = d[:-1], d[1:], np.diff(grid)
  same_sign = d0 * d1 >= 0
  total = np.abs(d0) + np.abs(d1)
  # Over a segment the difference is linear: a trapezoid, or two triangles when it changes sign.
  crossing = np.divide(d0**2 + d1**2, 2 * total, out=np.zeros_like(total), where=total > 0)
  area = np.where(same_sign, total / 2, crossing) * width
  return float(area.sum() / (hi - lo))
