"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018), from micro- vs full-batch norms.

For mean gradients over b and B samples (b < B), E|G_b|^2 = |G|^2 + tr(Sigma) / b, so two measured squared norms
give unbiased estimates
  |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
  tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B).
Both are noisy; their ratio is taken after exponential moving averages, as the paper recommends. Units: rollouts.
"""
import dataclasses


def unbiased_estimates(small_sq: float, big_sq: float, small: int, big: int) -> tuple[float, float]:
  """(|G|^2, tr(Sigma)) from the squared norms of mean gradients over `small` and `big` rollouts."""
  if not 0 < small < big:
    raise ValueError(f"Need 0 < small < big batch sizes, got {small} and {big} (use >= 2 micro-batches).")
  grad_sq = (big * big_sq - small * small_sq) / (big - small)
  trace = (small_sq - big_sq) / (1.0 / small - 1.0 / big)
  return grad_sq, trace


@dataclasses.dataclass
class NoiseScale:
  """Running B_simple: EMAs of |G|^2 and tr(Sigma) with decay `decay`, bias-corrected like Adam's moments."""

  decay: float = 0.95
  grad_sq: float = 0.0
  trace: float = 0.0

  def update(self, small_sq: float, big_sq: float, small: int, big: int) -> float:
    """Folds in one step's norms; returns the current B_simple estimate (rollouts), or nan while |G|^2 <= 0."""
    grad_sq, trace = unbiased_estimates(small_sq, big_sq, small, big)
    self.grad_sq = self.decay * self.grad_sq + (1 - self.decay) * grad_sq
    self.trace = self.decay * self.trace + (1 - self.decay) * trace
    # The bias corrections of the two EMAs are equal and cancel in the ratio.
    return self.trace / self.grad_sq if self.grad_sq > 0 else float("nan")
