"""The KL coefficient: fixed, or adapted towards a target KL (Ziegler et al. 2019, the controller of PPO-RLHF)."""
import dataclasses


@dataclasses.dataclass
class KLController:
  """beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon) after each step of n samples.

  target = 0 keeps beta fixed. `coef` is part of the run state (saved with every checkpoint).
  """

  coef: float
  target: float = 0.0
  horizon: int = 10_000

  def update(self, kl: float, samples: int) -> float:
    """Folds in the step's measured KL (per token, nats) over `samples` rollouts; returns the new coefficient."""
    if self.target > 0:
      error = min(max(kl / self.target - 1.0, -0.2), 0.2)
      self.coef *= 1.0 + error * samples / self.horizon
    return self.coef
