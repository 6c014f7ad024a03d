"""A step's rollout time from its response lengths, through the engines' own scheduling.

Why: decode steps, not tokens, cost time, and how many a step runs depends on the engine: the static engine runs
each block of rows to its longest; the continuous engine refills free slots between chunks, drives its real host
`scheduler.Scheduler` here with requests whose lengths are given. Either way each decode step runs every slot of
the compiled step (an ended or free slot still computes), so a step costs `decode_seconds(rows, cache_length)`
with rows = the program's rows, and each prefill program `prefill_seconds(prompts)` (distinct prompts: a group's
samples share one). Left out: the paged cache (preemption), partial rollouts (`rollout.partial`).
"""
import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl_batch.sampling.generate import cache_buckets
from jaxrl_batch.sampling.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Segment:
  """Decode steps run at one cache length: a continuous engine's chunk, or the stretch of a static block within
  one cache bucket. rows: the program's rows (slots); live: rows decoding when it starts; admitted: requests
  that took a free slot before it (their first token from the prefill)."""
  steps: int
  rows: int
  live: int
  cache_length: int
  admitted: int


@dataclasses.dataclass(frozen=True)
class RolloutTime:
  """Seconds of a rollout's decode steps and of its prefills."""
  decode_s: float
  prefill_s: float

  @property
  def seconds(self) -> float:
    return self.decode_s + self.prefill_s


@dataclasses.dataclass(frozen=True)
class Schedule:
  """What an engine runs for one rollout: its segments in order, the prompts of each prefill program, and
  `chunks` (host round trips: the continuous engine's chunks, 0 for the static engine's single program)."""
  segments: tuple[Segment, ...]
  prefills: tuple[int, ...]
  chunks: int
  decoded: int

  @property
  def decode_steps(self) -> int:
    return sum(s.steps for s in self.segments)

  @property
  def slot_steps(self) -> int:
    """Rows x decode steps, as `EngineStats.slot_steps` counts them."""
    return sum(s.rows * s.steps for s in self.segments)

  def time(self, decode_seconds: Callable[[int, int], float], prefill_seconds: Callable[[int], float]
           ) -> RolloutTime:
    """Seconds at `decode_seconds(rows, cache_length)` per decode step and `prefill_seconds(prompts)` per prefill."""
    return RolloutTime(sum(s.steps * decode_seconds(s.rows, s.cache_length) for s in self.segments),
                       sum(prefill_seconds(q) for q in self.prefills))


def _lengths(lengths_R, max_new_tokens: int) -> np.ndarray:
  lengths_R = np.asarray(lengths_R, np.int64)
  if len(lengths_R) and (lengths_R.min() < 1 or lengths_R.max() > max_new_tokens):
    raise ValueError(f"response lengths must be in [1, max_new_tokens={max_new_tokens}], got {lengths_R.min()} .. "
                     f"{lengths_R.max()}.")
  return lengths_R


def continuous(lengths_R, *, slots: int, chunk: int, max_new_tokens: int, prompt_len: int, group_size: int = 1,
               backend: str = "xla") -> Schedule:
  """The continuous engine's schedule (`continuous.decode`, slot cache) of requests of response lengths `lengths_R`
  (tokens, EOS included) in request order, groups of `group_size` sharing a prompt of `prompt_len` slots: one
  prefill of all the prompts, then chunks of up to `chunk` decode steps on `slots` slots, each chunk's cache sized
  to the bucket (`cache_buckets` of the resolved `backend`) that holds its longest sequence by the chunk's end."""
  lengths_R, n = _lengths(lengths_R, max_new_tokens), max_new_tokens
  buckets = cache_buckets(prompt_len, n, backend)
  scheduler = Scheduler(slots=slots, order=range(len(lengths_R)), held_R=np.zeros(len(lengths_R)), chunk=chunk,
                        max_new_tokens=n)
  segments = []
  while scheduler.pending:
    plan = scheduler.plan()
    needed = min(prompt_len + plan.longest + chunk - 1, buckets[-1])
    left_S = np.where(scheduler.live_S, lengths_R[scheduler.request_S] - scheduler.count_S, 0)
    steps = min(chunk, int(left_S.max(initial=0)))  # the chunk's loop stops once every slot has ended
    segments.append(Segment(steps, slots, int((left_S > 0).sum()), next(b for b in buckets if b >= needed),
                            int((plan.admit_S >= 0).sum())))
    scheduler.finish(left_S > steps, steps)
  return Schedule(tuple(segments), (-(-len(lengths_R) // group_size),), len(segments), int((lengths_R - 1).sum()))


def static(lengths_B, *, max_new_tokens: int, prompt_len: int, slots: int = 0, group_size: int = 1,
           backend: str = "xla") -> Schedule:
  """The static engine's schedule (`generate` per block of `slots` rows, 0 = all): each block prefills its
  prompts once per group, then decodes until its longest row ends, step t (1, 2, ...) reading the cache bucket
  that holds slot prompt_len + t - 1 (`cache_buckets` of the resolved `backend`)."""
  lengths_B, n = _lengths(lengths_B, max_new_tokens), max_new_tokens
  buckets = cache_buckets(prompt_len, n, backend)
  block = slots or len(lengths_B)
  segments, prefills = [], []
  for first in range(0, len(lengths_B), block):
    rows = lengths_B[first:first + block]
    prefills.append(-(-len(rows) // group_size))
    done = 0  # decode steps run so far: step t feeds slot prompt_len + t - 1
    for size in buckets:
      steps = min(int(rows.max()) - 1, size - prompt_len) - done
      if steps > 0:
        segments.append(Segment(steps, len(rows), int((rows - 1 > done).sum()), size, len(rows) if not done else 0))
        done += steps
  return Schedule(tuple(segments), tuple(prefills), 0, int((lengths_B - 1).sum()))
