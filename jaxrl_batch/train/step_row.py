"""A step's record in metrics.jsonl: the one place that names the keys of a row (docs/run_directory.md lists them).

A training row joins the run's progress, the rollout side's `RolloutStats` (host figures of the step's rollouts) and
the update's metrics, fetched from the device once and one step late; an evaluation row holds the held-out figures.
"""
import dataclasses

import numpy as np

from jaxrl_batch.rl.advantages import zero_std_group_frac
from jaxrl_batch.rl.overlong import overlong_penalty
from jaxrl_batch.sampling import EngineStats

# Update metrics copied into training rows as they come (those of the actor are absent during the critic warm-up).
UPDATE_KEYS = ("returns_mean", "vf_explained_var", "loss", "policy_loss", "entropy", "clip_frac", "clip_frac_low",
               "clip_frac_high", "ratio_mean", "tis_capped_frac", "grad_norm", "value_loss", "critic_grad_norm", "updates",
               "router_mismatch_frac", "expert_load_cv", "router_aux_loss")


@dataclasses.dataclass
class RolloutStats:
  """Host figures of a step's rollouts. Reward, length and truncation statistics are over every rollout generated
  for the step (all dynamic-sampling rounds; with partial rollouts, those that ended this step); `response_lens` lists
  the lengths of the step's batches in batch order, a prompt's group side by side (every dynamic-sampling round's
  batch in turn; with partial rollouts, the trained batch), which `predict.lengths` replays; engine figures
  (`sampling.EngineStats`) summed over its engine calls; times in seconds. `trained_samples` (rollouts whose tokens
  enter the loss) and `examples` (the logged samples) feed the run's counters and samples.jsonl, not the row. The
  optional fields exist only in some modes: partial rollouts (`reprefill_s` .. `carried_over`) and generation ahead
  of the learner (`update_wait_s` .. `policy_lag_samples_mean`)."""
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


def training_row(counters: dict, rollout: RolloutStats, timing: dict, update: dict, noise: dict,
                 updates_per_step: int) -> dict:
  """The row of a training step. counters: step, samples, samples_generated (cumulative), wall_s, cold; timing: update_s, lr,
  kl_coef, compile_s and, with generation ahead of the learner, overlap_frac; update: the step's fetched device metrics;
  noise: the noise-scale fields (`rl.noise_scale.NoiseScale.update`)."""
  rollout_fields = {k: v for k, v in dataclasses.asdict(rollout).items()
                    if v is not None and k not in ("trained_samples", "examples", "samples_generated")}
  update = dict(update, updates=updates_per_step)
  if "clip_frac_low" in update:
    update["clip_frac"] = update["clip_frac_low"] + update["clip_frac_high"]
  copied = {k: update[k] for k in UPDATE_KEYS if k in update}
  # kl is 0 without a KL term; logp_gap_mean compares the sampler with the trainer's log-probs before this step's
  # updates: recomputed (`rl.old_logp='trainer'`) or, without that, from the first update's forward.
  return dict(counters, **rollout_fields, **timing, **noise, **copied, kl=update.get("kl", 0.0),
              logp_gap_mean=update.get("logp_gap_mean"))


def eval_row(step: int, samples: int, wall_s: float, held_out: dict) -> dict:
  """The row of an evaluation of the held-out set (`train.evaluation.evaluate`'s fields)."""
  return dict(step=step, samples=samples, wall_s=wall_s, **held_out)
