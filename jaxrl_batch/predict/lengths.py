"""Response lengths for a predicted step, from a stated distribution.

A spec names the distribution of one rollout's response length in tokens (EOS included), clipped to [1, budget]:
`lognormal:MEDIAN:SIGMA` (RL responses' long tail), `uniform:LOW:HIGH`, or `fixed:N`. A step's B lengths are drawn
from a seeded generator, so every member of a sweep sees the same distribution and a rerun the same lengths.
"""
import numpy as np

FORMS = "lognormal:MEDIAN:SIGMA, uniform:LOW:HIGH or fixed:N"


def response_lengths(spec: str, batch: int, budget: int, seed: int = 0) -> np.ndarray:
  """`batch` response lengths (int) drawn from `spec`, clipped to [1, budget]."""
  kind, *args = spec.split(":")
  try:
    values = [float(a) for a in args]
  except ValueError:
    values = None
  arity = dict(lognormal=2, uniform=2, fixed=1).get(kind)
  if arity is None or values is None or len(values) != arity or min(values) <= 0:
    raise ValueError(f"Response lengths {spec!r}: give {FORMS} (positive numbers).")
  rng = np.random.default_rng(seed)
  if kind == "lognormal":
    drawn = rng.lognormal(np.log(values[0]), values[1], batch)
  elif kind == "uniform":
    drawn = rng.uniform(values[0], values[1], batch)
  else:
    drawn = np.full(batch, values[0])
  return np.clip(np.rint(drawn), 1, budget).astype(np.int64)
