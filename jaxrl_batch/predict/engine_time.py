"""A step's rollout time from its response lengths, through the engines' own scheduling.

Why: decode steps, not tokens, cost time, and how many a step runs depends on the engine: the static engine runs
each block of rows to its longest; the continuous engine refills free slots between chunks (its real host
`scheduler.Scheduler` is driven here, with requests whose lengths are given). Either way each decode step runs
every slot of the compiled step (an ended or free slot still computes), so a step costs
`decode_seconds(rows, cache_length)` with rows = the program's rows, and each prefill program
`prefill_seconds(prompts)` (distinct prompts: a group's samples share one). A partial rollout's engine call
(`rollout.partial`) is `continuous` with the carried sequences' tokens (`held_R`, re-prefilled as they take slots,
or kept in theirs: `slot_R`) and the collector's stop test; chaining the calls of successive steps is left to the
caller. Left out: the paged cache (preemption).
"""
import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl_batch.sampling.continuous import fed_bucket
from jaxrl_batch.sampling.generate import cache_buckets
from jaxrl_batch.sampling.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Segment:
  """Decode steps run at one cache length: a continuous engine's chunk, or the stretch of a static block within
  one cache bucket. rows: the program's rows (slots); live: rows decoding when it starts; admitted: new requests
  that took a free slot before it (their first token from the prefill); resumed: carried requests re-prefilled
  into a slot before it, `fed` tokens a row (`continuous.fed_bucket`; 0 without them)."""
  steps: int
  rows: int
  live: int
  cache_length: int
  admitted: int
  resumed: int = 0
  fed: int = 0


@dataclasses.dataclass(frozen=True)
class RolloutTime:
  """Seconds of a rollout's decode steps, its prefills and its re-prefills of carried sequences."""
  decode_s: float
  prefill_s: float
  reprefill_s: float = 0.0

  @property
  def seconds(self) -> float:
    return self.decode_s + self.prefill_s + self.reprefill_s


@dataclasses.dataclass(frozen=True)
class Schedule:
  """What an engine runs for one rollout: its segments in order, the prompts of each prefill program, `chunks`
  (host round trips: the continuous engine's chunks, 0 for the static engine's single program), `decoded` (tokens
  chosen by decode steps), and per request whether it `ended` and the tokens it `held` at the stop (0 if ended or
  never started)."""
  segments: tuple[Segment, ...]
  prefills: tuple[int, ...]
  chunks: int
  decoded: int
  ended: tuple[bool, ...] = ()
  held: tuple[int, ...] = ()

  @property
  def decode_steps(self) -> int:
    return sum(s.steps for s in self.segments)

  @property
  def slot_steps(self) -> int:
    """Rows x decode steps, as `EngineStats.slot_steps` counts them."""
    return sum(s.rows * s.steps for s in self.segments)

  def time(self, decode_seconds: Callable[[int, int], float], prefill_seconds: Callable[[int], float],
           reprefill_seconds: Callable[[int, int, int], float] | None = None,
           segment_seconds: Callable[[int, int], float] | None = None) -> RolloutTime:
    """Seconds at `decode_seconds(rows, cache_length)` per decode step, `prefill_seconds(prompts)` per prefill,
    `reprefill_seconds(rows, fed, cache_length)` per chunk that re-prefills carried sequences (needed only then) and
    `segment_seconds(rows, cache_length)` once per segment besides its steps (a program's setup per execution)."""
    resumed = [s for s in self.segments if s.resumed]
    if resumed and reprefill_seconds is None:
      raise ValueError(f"{len(resumed)} chunks re-prefill carried sequences: give reprefill_seconds.")
    once = segment_seconds or (lambda rows, length: 0.0)
    return RolloutTime(sum(s.steps * decode_seconds(s.rows, s.cache_length) + once(s.rows, s.cache_length)
                           for s in self.segments if s.steps),
                       sum(prefill_seconds(q) for q in self.prefills),
                       sum(reprefill_seconds(s.rows, s.fed, s.cache_length) for s in resumed))


def _lengths(lengths_R, max_new_tokens: int) -> np.ndarray:
  lengths_R = np.asarray(lengths_R, np.int64)
  if len(lengths_R) and (lengths_R.min() < 1 or lengths_R.max() > max_new_tokens):
    raise ValueError(f"response lengths must be in [1, max_new_tokens={max_new_tokens}], got {lengths_R.min()} .. "
                     f"{lengths_R.max()}.")
  return lengths_R


def continuous(lengths_R, *, slots: int, chunk: int, max_new_tokens: int, prompt_len: int, group_size: int = 1,
               backend: str = "xla", prompts: int = 0, held_R=None, slot_R=None, order=None, stop=None) -> Schedule:
  """The continuous engine's schedule (`continuous.decode`, slot cache) of requests of response lengths `lengths_R`
  (tokens, EOS included), groups of `group_size` sharing a prompt of `prompt_len` slots: one prefill of the
  prompts (`prompts` rows, 0 = one a group), then chunks of up to `chunk` decode steps on `slots` slots, each
  chunk's cache sized to the bucket (`cache_buckets` of the resolved `backend`) that holds its longest sequence by
  the chunk's end. As `decode`'s: `held_R` (tokens each request already holds), `slot_R` (kept slots), `order`
  (admission order, default all in turn) and `stop(ended_R, decode_steps)`, asked after each chunk."""
  lengths_R, n, r = _lengths(lengths_R, max_new_tokens), max_new_tokens, len(lengths_R)
  buckets = cache_buckets(prompt_len, n, backend)
  scheduler = Scheduler(slots=slots, order=range(r) if order is None else order,
                        held_R=np.zeros(r) if held_R is None else held_R, chunk=chunk, max_new_tokens=n,
                        slot_R=slot_R)
  segments, decoded = [], 0
  while scheduler.pending:
    plan = scheduler.plan()
    fed = fed_bucket(plan.resumed_longest, n) if plan.resuming else 0
    needed = min(max(prompt_len + plan.longest + chunk - 1, prompt_len + fed), buckets[-1])
    left_S = np.where(scheduler.live_S, lengths_R[scheduler.request_S] - scheduler.count_S, 0)
    steps = min(chunk, int(left_S.max(initial=0)))  # the chunk's loop stops once every slot has ended
    segments.append(Segment(steps, slots, int((left_S > 0).sum()), next(b for b in buckets if b >= needed),
                            int((plan.admit_S >= 0).sum()), int((plan.resume_S >= 0).sum()), fed))
    decoded += int(np.minimum(left_S, steps).sum())
    scheduler.finish(left_S > steps, steps)
    if stop is not None and stop(scheduler.ended_R, sum(s.steps for s in segments)):
      break
  return Schedule(tuple(segments), (prompts or -(-r // group_size),), len(segments), decoded,
                  tuple(scheduler.ended_R.tolist()), tuple(scheduler.held().tolist()))


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
  return Schedule(tuple(segments), tuple(prefills), 0, int((lengths_B - 1).sum()), (True,) * len(lengths_B),
                  (0,) * len(lengths_B))
