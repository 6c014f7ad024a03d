"""A step's record in metrics.jsonl: the one place that names the keys of a row (docs/run_directory.md lists them).

A row is built from typed records, one per group of fields, each in the row's order and each saying which of its
fields a row leaves out: a training row joins the run's `Progress`, the rollout side's `RolloutStats` (host figures of
the step's rollouts), the step's `Timing`, the gradient `Noise` scale and the `UpdateMetrics` (fetched from the device
once and one step late); an evaluation row holds step, samples and wall_s and the `HeldOut` figures.
"""
import dataclasses
from collections.abc import Mapping

import numpy as np

from jaxrl_batch.rl.advantages import zero_std_group_frac
from jaxrl_batch.rl.overlong import overlong_penalty
from jaxrl_batch.sampling import EngineStats


def _present(record) -> dict:
  """The record's fields that are not None, in declaration order."""
  return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if getattr(record, f.name) is not None}


@dataclasses.dataclass(frozen=True)
class Progress:
  """The run's counters after a step, cumulative across resumes: rollout steps done, rollouts trained on
  (`samples`) and generated, seconds since the run started, and whether the step is the first of a session (`cold`:
  its seconds include compilation)."""
  step: int
  samples: int
  samples_generated: int
  wall_s: float
  cold: bool

  def to_row(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Timing:
  """The step's update: its seconds (awaited, so exact), learning rate, KL coefficient and seconds spent compiling;
  with generation ahead of the learner, the share of the step's wall time in which both ran (absent otherwise)."""
  update_s: float
  lr: float
  kl_coef: float
  compile_s: float
  overlap_frac: float | None = None

  def to_row(self) -> dict:
    return _present(self)


@dataclasses.dataclass(frozen=True)
class Noise:
  """The gradient noise scale (`rl.noise_scale`) in rollouts and, with rl.noise_split, its inter-prompt and
  intra-prompt parts. A value without an estimate is None, written as null: the fields are present whenever their
  mode is on, so that a row's keys follow the config alone."""
  noise_scale: float | None
  noise_inter: float | None = None
  noise_intra: float | None = None
  split: bool = False  # Whether the row carries noise_inter and noise_intra.

  @classmethod
  def of(cls, fields: Mapping[str, float | None]) -> "Noise":
    """The record of the noise-scale fields as `NoiseScale.update` gives them (keyed by their row names; the parts
    present with the split). An unknown name is a TypeError."""
    return cls(**fields, split="noise_inter" in fields)

  def to_row(self) -> dict:
    names = ("noise_scale", "noise_inter", "noise_intra") if self.split else ("noise_scale",)
    return {k: getattr(self, k) for k in names}


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateMetrics:
  """The update's metrics, means over its `updates` optimizer updates. A metric the step's update does not compute
  is None and absent from the row (the actor's during the critic warm-up, PPO's with GRPO, the mixture of experts'
  with a dense model); `kl` is 0 without a KL term, and `logp_gap_mean` (null when not measured) compares the
  sampler's log-probs with the trainer's before the step's updates."""
  returns_mean: float | None = None
  vf_explained_var: float | None = None
  loss: float
  policy_loss: float | None = None
  entropy: float | None = None
  clip_frac: float | None = None
  clip_frac_low: float | None = None
  clip_frac_high: float | None = None
  ratio_mean: float | None = None
  tis_capped_frac: float | None = None
  grad_norm: float | None = None
  value_loss: float | None = None
  critic_grad_norm: float | None = None
  updates: int
  router_mismatch_frac: float | None = None
  expert_load_cv: float | None = None
  router_aux_loss: float | None = None
  kl: float = 0.0
  logp_gap_mean: float | None = None

  @classmethod
  def from_fetched(cls, out: Mapping[str, float], updates_per_step: int) -> "UpdateMetrics":
    """The record of the step's device metrics fetched as floats (other names, such as the raw noise estimates,
    feed other records); clip_frac is the sum of its two sides where they are measured."""
    names = {f.name for f in dataclasses.fields(cls)} - {"updates"}
    fields = {k: v for k, v in out.items() if k in names}
    if "clip_frac_low" in fields:
      fields["clip_frac"] = fields["clip_frac_low"] + fields["clip_frac_high"]
    return cls(**fields, updates=updates_per_step)

  def to_row(self) -> dict:
    return dict(_present(self), kl=self.kl, logp_gap_mean=self.logp_gap_mean)


@dataclasses.dataclass(frozen=True)
class HeldOut:
  """An evaluation of the held-out set (`train.evaluation.evaluate`): greedy accuracy and reward errors; with
  eval.num_samples > 0 the sampled figures (eval_maj_at_k where the task extracts answers), absent otherwise."""
  eval_accuracy: float
  eval_reward_errors: int
  eval_pass1: float | None = None
  eval_pass_at_k: float | None = None
  eval_maj_at_k: float | None = None

  def to_row(self) -> dict:
    return _present(self)


@dataclasses.dataclass
class RolloutStats:
  """Host figures of a step's rollouts. Reward, length and truncation statistics are over every rollout generated
  for the step (all dynamic-sampling rounds; with partial rollouts, those that ended this step); `response_lens` lists
  the lengths of the step's batches in batch order, a prompt's group side by side (every dynamic-sampling round's
  batch in turn; with partial rollouts, the trained batch), which `predict.lengths` replays; engine figures
  (`sampling.EngineStats`) summed over its engine calls; times in seconds. `trained_samples` (rollouts whose tokens
  enter the loss) and `examples` (the logged samples) feed the run's counters and samples.jsonl, not the row. The
  optional fields exist only in some modes: partial rollouts (`reprefill_s` .. `carried_over`), generation ahead
  of the learner (`update_wait_s` .. `policy_lag_samples_mean`) and decoding in a layout of its own
  (`reshard_s`)."""
  rollout_s: float
  reward_s: float
  samples_generated: int
  sampling_rounds: int
  reward_mean: float
  reward_std: float
  response_len_mean: float
  truncated_frac: float
  zero_std_group_frac: float
  reward_errors: int
  reward_timeouts: int
  useful_token_frac: float
  rollout_chunks: int
  preempted: int
  trained_samples: int
  examples: list
  response_len_max: int = 0  # defaults: a checkpoint's rollouts in flight saved before these were logged
  response_lens: list = dataclasses.field(default_factory=list)
  reprefill_s: float | None = None
  policy_lag_mean: float | None = None
  policy_lag_max: int | None = None
  partial_frac: float | None = None
  carried_over: int | None = None
  update_wait_s: float | None = None
  rollout_wait_s: float | None = None
  policy_version: int | None = None
  policy_lag_samples_mean: float | None = None
  reshard_s: float | None = None

  @classmethod
  def of(cls, *, rewards_E, lengths_E, truncated_E, engine: list[EngineStats], zero_std_frac: float, **fields
         ) -> "RolloutStats":
    """The statistics of E generated rollouts (E = 0: zeros) and of the engine calls that produced them; `fields`
    gives the rest (times, counts, the optional fields)."""
    mean = lambda x: float(np.mean(x)) if len(x) else 0.0
    return cls(reward_mean=mean(rewards_E), reward_std=float(np.std(rewards_E)) if len(rewards_E) else 0.0,
               response_len_mean=mean(lengths_E), response_len_max=int(max(lengths_E, default=0)),
               truncated_frac=mean(np.asarray(truncated_E, float)),
               zero_std_group_frac=zero_std_frac,
               useful_token_frac=sum(e.decoded for e in engine) / max(sum(e.slot_steps for e in engine), 1),
               rollout_chunks=sum(e.chunks for e in engine), preempted=sum(e.preempted for e in engine), **fields)

  def to_json(self) -> dict:
    """The fields (examples included) as JSON values, for a checkpoint's run state."""
    item = lambda v: v.item() if isinstance(v, np.generic) else v
    return {k: item(v) for k, v in dataclasses.asdict(self).items()}

  def to_row(self) -> dict:
    """The fields a row holds: the optional ones of the run's mode; not the step's counts (`Progress` holds the
    run's) nor the logged samples."""
    return {k: v for k, v in _present(self).items() if k not in ("trained_samples", "examples", "samples_generated")}


def group_zero_std_frac(rewards_B: np.ndarray, group_size: int) -> float:
  """The share of groups whose rewards are all equal (0 with one sample per prompt: no group baseline)."""
  return float(zero_std_group_frac(rewards_B, group_size)) if group_size > 1 else 0.0


def trained_rewards(algo, rewards_B: np.ndarray, lengths_B: np.ndarray, truncated_B: np.ndarray,
                    response_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(rewards_B, trained_B) after the overlong handling `rl.overlong`: 'penalty' adds the soft length penalty,
  'mask' keeps truncated rollouts out of the loss."""
  trained_B = np.ones(len(rewards_B), bool)
  if algo.overlong == "penalty":
    rewards_B = rewards_B + overlong_penalty(lengths_B, truncated_B, response_len, algo.overlong_buffer,
                                             algo.overlong_penalty)
  elif algo.overlong == "mask":
    trained_B = trained_B & ~truncated_B
  return rewards_B, trained_B


def training_row(progress: Progress, rollout: RolloutStats, timing: Timing, noise: Noise,
                 update: UpdateMetrics) -> dict:
  """The row of a training step: its groups in turn (a name in two groups is a TypeError)."""
  return dict(**progress.to_row(), **rollout.to_row(), **timing.to_row(), **noise.to_row(), **update.to_row())


def eval_row(step: int, samples: int, wall_s: float, held_out: HeldOut) -> dict:
  """The row of an evaluation of the held-out set after `step` steps and `samples` samples."""
  return dict(step=step, samples=samples, wall_s=wall_s, **held_out.to_row())
