"""Batch-size families: how the learning rate scales when the batch grows.

A family is a base member (batch B0, learning rate lr0) plus a rule; the member at batch B gets
  none:   lr0
  linear: lr0 * B / B0
  sqrt:   lr0 * sqrt(B / B0)
  adam_sde: lr0 * sqrt(B / B0), and Adam's 1 - beta1 and 1 - beta2 multiplied by kappa = B / B0, epsilon divided
            by sqrt(kappa) (the square-root scaling rule of Adam's SDE approximation, Malladi et al. 2022)
Batch sizes count rollouts per optimizer update. An explicit learning rate overrides the rule, and the
derivation records both so logs show what the rule would have given.
"""
import dataclasses
import math

RULES = ("none", "linear", "sqrt", "adam_sde")


def _check_rule(rule: str) -> None:
  if rule not in RULES:
    raise ValueError(f"Unknown lr rule {rule!r}; use one of {RULES}.")


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
  """Learning rate for `batch` rollouts/update, scaled from (`base_lr`, `base_batch`) by `rule`."""
  _check_rule(rule)
  if base_lr <= 0:
    raise ValueError(f"base_lr must be > 0, got {base_lr}; set the base member's learning rate.")
  if base_batch <= 0 or batch <= 0:
    raise ValueError(
        f"Batch sizes must be > 0, got base_batch={base_batch}, batch={batch} (rollouts per update).")
  if rule == "none":
    return base_lr
  if rule == "linear":
    return base_lr * batch / base_batch
  return base_lr * math.sqrt(batch / base_batch)


def scale_adam(b1: float, b2: float, eps: float, base_batch: int, batch: int, rule: str) -> tuple[float, float, float]:
  """Adam's (beta1, beta2, epsilon) for `batch`: changed only by the adam_sde rule."""
  _check_rule(rule)
  if rule != "adam_sde":
    return b1, b2, eps
  kappa = batch / base_batch
  scaled = (1.0 - kappa * (1.0 - b1), 1.0 - kappa * (1.0 - b2))
  if min(scaled) <= 0.0:
    raise ValueError(f"adam_sde at batch {batch} (kappa = {kappa:g} x base_batch {base_batch}) makes "
                     f"beta1, beta2 = {scaled[0]:g}, {scaled[1]:g}, which must stay in (0, 1); raise "
                     "optim.b1/b2 or shrink the batch range.")
  return scaled[0], scaled[1], eps / math.sqrt(kappa)


def _fmt(x: float) -> str:
  """Short scientific notation: 2.8284e-4 -> '2.83e-4', 2e-4 -> '2e-4'."""
  mantissa, exponent = f"{x:.2e}".split("e")
  return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


@dataclasses.dataclass(frozen=True)
class LearningRate:
  """The learning rate of one family member and how it was obtained.

  Attributes:
    lr: the peak learning rate actually used.
    rule: the family's scaling rule (one of RULES).
    base_lr: learning rate of the base member.
    base_batch: rollouts per update of the base member.
    batch: rollouts per update of this member.
    overridden: True when `lr` was given explicitly instead of derived by the rule.
  """
  lr: float
  rule: str
  base_lr: float
  base_batch: int
  batch: int
  overridden: bool

  def rule_lr(self) -> float:
    """The learning rate the rule gives for this member (equal to `lr` unless overridden)."""
    return scale_lr(self.base_lr, self.base_batch, self.batch, self.rule)

  def derivation(self) -> str:
    """The rule's formula with this member's numbers, e.g. '2e-4 * sqrt(256/128)'."""
    base = _fmt(self.base_lr)
    if self.rule == "linear":
      return f"{base} * {self.batch}/{self.base_batch}"
    if self.rule == "sqrt":
      return f"{base} * sqrt({self.batch}/{self.base_batch})"
    if self.rule == "adam_sde":
      return f"{base} * sqrt({self.batch}/{self.base_batch}), Adam betas and eps rescaled"
    return f"{base} at any batch"

  def describe(self) -> str:
    """One line for logs, e.g. 'lr=2.83e-4 (sqrt rule: 2e-4 * sqrt(256/128))'."""
    if self.overridden:
      return (f"lr={_fmt(self.lr)} (explicit override; the {self.rule} rule would give "
              f"{_fmt(self.rule_lr())})")
    return f"lr={_fmt(self.lr)} ({self.rule} rule: {self.derivation()})"


def derive_lr(base_lr: float, base_batch: int, batch: int, rule: str,
              lr_override: float | None) -> LearningRate:
  """The member's learning rate: `lr_override` if it is not None and > 0, else the rule's value.

  The rule and the base values are validated even when overridden, so a typo never hides.
  """
  rule_lr = scale_lr(base_lr, base_batch, batch, rule)
  overridden = lr_override is not None and lr_override > 0
  return LearningRate(
      lr=float(lr_override) if overridden else rule_lr,
      rule=rule, base_lr=base_lr, base_batch=base_batch, batch=batch, overridden=overridden)
