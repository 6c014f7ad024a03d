"""Per-seed results and their aggregate per member (rule, batch).

A seed's S (samples-to-target) and T (time-to-target, the training clock at S) are None when it never reaches the
target (censored); censored seeds are counted, never dropped. A member's S and T are the means over the seeds that
reached the target, its throughput R the mean over all seeds (R does not depend on the target); each comes with
a 90% percentile-bootstrap interval over those seeds.
"""
import dataclasses
import functools

import numpy as np

from jaxrl_batch.analysis import bootstrap, clock, curves
from jaxrl_batch.analysis.runs import Run


@dataclasses.dataclass(frozen=True)
class SeedResult:
  """One run's numbers at a target.

  Attributes:
    run: the run.
    curve: (samples, accuracy) evaluation curve after smoothing.
    samples_to_target: S in samples, None if censored.
    time_to_target_s: T in training seconds, None if censored.
    throughput: R in samples/s.
    seconds_per_sample: (3,) rollout / reward / update seconds per sample.
  """
  run: Run
  curve: curves.Curve
  samples_to_target: float | None
  time_to_target_s: float | None
  throughput: float
  seconds_per_sample: np.ndarray

  def to_json(self) -> dict:
    return dict(dir=self.run.name, seed=self.run.seed, samples_to_target=self.samples_to_target,
                time_to_target_s=self.time_to_target_s, throughput_samples_per_s=self.throughput,
                finished=self.run.finished, censored=self.samples_to_target is None)


def seed_result(run: Run, target: float, smooth: int) -> SeedResult:
  """S, T and R of `run` at `target`, on its curve smoothed over `smooth` evaluation points."""
  accuracy = curves.smooth(run.eval_accuracy, smooth)
  s = curves.samples_to_target(run.eval_samples, accuracy, target)
  t = None if s is None else float(clock.clock_at(run.train_samples, run.phase_s, s, run.cold))
  return SeedResult(run=run, curve=(run.eval_samples, accuracy), samples_to_target=s, time_to_target_s=t,
                    throughput=clock.throughput(run.train_samples, run.phase_s, run.cold),
                    seconds_per_sample=clock.seconds_per_sample(run.train_samples, run.phase_s, run.cold))


def _mean(values: list[float]) -> float | None:
  return float(np.mean(values)) if values else None


@dataclasses.dataclass(frozen=True)
class MemberResults:
  """The results of one member (rule, batch, staleness) of a study: its seeds' `SeedResult`s and their aggregate."""
  rule: str
  batch: int
  seeds: tuple[SeedResult, ...]
  staleness: int = 0

  @property
  def name(self) -> str:
    return self.seeds[0].run.member

  @functools.cached_property
  def curve(self) -> curves.Curve:
    """Seed-mean evaluation curve."""
    return curves.mean_curve([r.curve for r in self.seeds])

  @functools.cached_property
  def clock_curve(self) -> tuple[np.ndarray, np.ndarray]:
    """(seed-mean training seconds, seed-mean accuracy) at the samples of `curve`."""
    samples, accuracy = self.curve
    seconds = np.mean([clock.clock_at(r.run.train_samples, r.run.phase_s, samples, r.run.cold)
                       for r in self.seeds], axis=0)
    return seconds, accuracy

  def summary(self) -> dict:
    """The member's aggregate fields of analysis.json (without the per-seed list)."""
    reached = [r for r in self.seeds if r.samples_to_target is not None]
    s = [r.samples_to_target for r in reached]
    t = [r.time_to_target_s for r in reached]
    rates = [r.throughput for r in self.seeds]
    rollout, reward, update = np.mean([r.seconds_per_sample for r in self.seeds], axis=0)
    return dict(
        member=self.name, rule=self.rule, batch=self.batch, staleness=self.staleness,
        samples_to_target=_mean(s), samples_to_target_ci=bootstrap.mean_ci(s),
        time_to_target_s=_mean(t), time_to_target_ci=bootstrap.mean_ci(t),
        throughput_samples_per_s=_mean(rates), throughput_ci=bootstrap.mean_ci(rates),
        rollout_s_per_sample=float(rollout), reward_s_per_sample=float(reward), update_s_per_sample=float(update),
        n_seeds=len(self.seeds), n_censored=len(self.seeds) - len(reached))


def _member_key(result: SeedResult) -> tuple[str, int, int]:
  return result.run.rule, result.run.batch, result.run.staleness


def group(results: list[SeedResult]) -> list[MemberResults]:
  """Members of `results`, sorted by rule, batch, then staleness."""
  return [MemberResults(rule, batch, tuple(r for r in results if _member_key(r) == (rule, batch, k)), k)
          for rule, batch, k in sorted({_member_key(r) for r in results})]
