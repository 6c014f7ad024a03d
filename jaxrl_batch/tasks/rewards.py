"""Rewards that never stop a run, scored on host threads while the caller goes on.

A reward function that raises, returns a non-finite value or runs past `timeout_s` scores 0 for that sample, and
is counted (`Scores.errors`, `Scores.timeouts`). Python cannot stop a thread: a worker whose reward runs past the
timeout is abandoned (its late result is dropped) and a fresh worker takes its place, so a slow verifier costs a
thread, never the run. A verifier that hangs for good would leak threads without end: past `max_hung` abandoned
threads still running, the next result raises an error that says so.

A `RewardScorer` is long-lived (one per run); each set of B samples is a `ScoringBatch`: its completions arrive in
parts (`submit`, e.g. as the rollout engine finishes sequences) as thunks that are decoded on the scorer's decoder
thread, then scored on `workers` reward threads; `result()` waits for every sample.
"""
import collections
import dataclasses
import logging
import math
import queue
import threading
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np


class Scores(NamedTuple):
  """rewards_B: float32 (0 where the reward raised or timed out); errors, timeouts: counts; first_error: the first
  error or timeout message, None if there was none; completions_B: the scored texts."""
  rewards_B: np.ndarray
  errors: int
  timeouts: int
  first_error: str | None
  completions_B: list[str]

  def failures(self) -> str:
    """What went wrong, for a log line: e.g. "raised on 2 and ran past task.reward_timeout_s on 1 of 32 samples
    (scored 0); first: ..."; "" when nothing did."""
    parts = [f"raised on {self.errors}" if self.errors else "",
             f"ran past task.reward_timeout_s on {self.timeouts}" if self.timeouts else ""]
    if not any(parts):
      return ""
    return (f"{' and '.join(p for p in parts if p)} of {len(self.rewards_B)} samples (scored 0); "
            f"first: {self.first_error}")


@dataclasses.dataclass(eq=False)
class _Job:
  batch: "ScoringBatch"
  index: int
  completion: str


@dataclasses.dataclass(eq=False)
class _Worker:
  job: _Job | None = None
  started: float = 0.0
  abandoned: bool = False
  timed_out: bool = False


class ScoringBatch:
  """The rewards of `len(problems)` samples, sample i answering problems[i]."""

  def __init__(self, scorer: "RewardScorer", problems: Sequence):
    self._scorer, self.problems = scorer, list(problems)
    self._rewards = np.zeros(len(self.problems), np.float32)
    self._done = np.zeros(len(self.problems), bool)
    self._submitted = np.zeros(len(self.problems), bool)
    self._completions = [""] * len(self.problems)
    self.errors = self.timeouts = 0
    self.first_error: str | None = None
    self.decode_error: BaseException | None = None

  def submit(self, indices: Sequence[int], completions: Callable[[], Sequence[str]]) -> None:
    """Queues samples `indices`; `completions()` (run on the decoder thread) returns their texts, in that order."""
    indices = [int(i) for i in indices]
    twice = sorted({i for i in indices if self._submitted[i]})
    if twice:
      raise ValueError(f"samples {twice} were submitted twice.")
    self._submitted[indices] = True
    self._scorer._decode_queue.put((self, indices, completions))

  def result(self) -> Scores:
    """Waits for every sample's reward (a sample's wait is bounded by the timeout once its scoring starts)."""
    if not self._submitted.all():
      raise ValueError(f"{int((~self._submitted).sum())} of {len(self.problems)} samples were never submitted.")
    scorer = self._scorer
    with scorer._lock:
      while not self._done.all() and self.decode_error is None and scorer.failure is None:
        scorer._done.wait()
    if scorer.failure is not None:
      raise RuntimeError(scorer.failure)
    if self.decode_error is not None:
      raise RuntimeError("Decoding completions for scoring failed") from self.decode_error
    return Scores(self._rewards.copy(), self.errors, self.timeouts, self.first_error, list(self._completions))

  def _record(self, index: int, value: float, error: str | None, timed_out: bool = False) -> None:
    """Called under the scorer's lock."""
    if self._done[index]:
      return
    self._rewards[index], self._done[index] = value, True
    if error is not None:
      self.timeouts += timed_out
      self.errors += not timed_out
      self.first_error = self.first_error or error


class RewardScorer:
  """Scores completions with `reward(completion, problem) -> float` on `workers` daemon threads; timeout_s 0 = none.
  `stream`: whether a rollout engine should hand it responses as they end (read by the collector). `max_hung`:
  abandoned threads still running that it tolerates; one more makes every `result()` raise (`failure`)."""

  def __init__(self, reward: Callable[[str, object], float], workers: int = 1, timeout_s: float = 0.0,
               stream: bool = True, max_hung: int = 64):
    if not (isinstance(workers, int) and workers >= 1):
      raise ValueError(f"task.reward_workers={workers!r}: threads scoring rewards, an integer >= 1.")
    if not (isinstance(timeout_s, int | float) and timeout_s >= 0):
      raise ValueError(f"task.reward_timeout_s={timeout_s!r}: seconds a sample's reward may take, >= 0 (0 = none).")
    if not isinstance(stream, bool):
      raise ValueError(f"task.stream_rewards={stream!r}: true or false.")
    self._reward, self.timeout_s, self.workers, self.stream = reward, float(timeout_s), workers, stream
    self._lock = threading.Lock()
    self._ready = threading.Condition(self._lock)  # workers wait for jobs
    self._done = threading.Condition(self._lock)  # batches wait for rewards
    self._jobs: collections.deque[_Job] = collections.deque()
    self._workers: list[_Worker] = []
    self._decode_queue: queue.SimpleQueue = queue.SimpleQueue()
    self._open = False
    self.abandoned = 0  # threads abandoned past the timeout, ever
    self.hung, self.max_hung = 0, max_hung  # of those, the ones still running
    self.failure: str | None = None

  def batch(self, problems: Sequence) -> ScoringBatch:
    """A new set of samples to score (starts the threads on first use, or after `close`)."""
    with self._lock:
      if not self._open:
        self._open = True
        threading.Thread(target=self._decode_loop, name="reward-decode", daemon=True).start()
        if self.timeout_s:
          threading.Thread(target=self._watch, name="reward-watchdog", daemon=True).start()
        for _ in range(self.workers):
          self._spawn()
    return ScoringBatch(self, problems)

  def close(self) -> None:
    """Lets the threads end once idle (a later `batch` starts new ones)."""
    with self._lock:
      if self._open:
        self._open = False
        self._decode_queue.put(None)
        for worker in self._workers:
          worker.abandoned = True
        self._workers.clear()
        self._ready.notify_all()

  def score(self, completions: Sequence[str], problems: Sequence) -> Scores:
    """The rewards of ready completions, all at once."""
    batch = self.batch(problems)
    completions = list(completions)
    batch.submit(range(len(completions)), lambda: completions)
    return batch.result()

  def _spawn(self) -> None:
    worker = _Worker()
    self._workers.append(worker)
    threading.Thread(target=self._work, args=(worker,), name="reward", daemon=True).start()

  def _decode_loop(self) -> None:
    while True:
      item = self._decode_queue.get()
      if item is None:
        return
      batch, indices, completions = item
      try:
        texts = list(completions())
        if len(texts) != len(indices):
          raise ValueError(f"{len(texts)} completions for {len(indices)} samples.")
      except BaseException as e:  # Surfaced by the batch's result().
        with self._lock:
          batch.decode_error = e
          self._done.notify_all()
        continue
      with self._lock:
        for i, text in zip(indices, texts):
          batch._completions[i] = text
        self._jobs.extend(_Job(batch, i, text) for i, text in zip(indices, texts))
        self._ready.notify(len(texts))

  def _work(self, worker: _Worker) -> None:
    while True:
      with self._lock:
        while not self._jobs and not worker.abandoned:
          self._ready.wait()
        if worker.abandoned:  # closed
          return
        job = self._jobs.popleft()
        worker.job, worker.started = job, time.monotonic()
      value, error = self._call(job)
      with self._lock:
        if worker.abandoned:  # timed out (scored 0 already, and replaced) or closed
          if worker.timed_out:
            self.hung -= 1
          return
        worker.job = None
        job.batch._record(job.index, value, error)
        self._done.notify_all()

  def _call(self, job: _Job) -> tuple[float, str | None]:
    try:
      value = float(self._reward(job.completion, job.batch.problems[job.index]))
    except Exception as e:  # A user reward function must never crash the run.
      return 0.0, f"{type(e).__name__}: {e}"
    if not math.isfinite(value):
      return 0.0, f"the reward function returned {value} for {job.completion[:80]!r}"
    return value, None

  def _watch(self) -> None:
    """Looks for rewards past the timeout every tenth of it (10 ms .. 1 s): a reward is stopped at most that late,
    and starting one costs no wake-up."""
    interval = min(max(self.timeout_s / 10, 0.01), 1.0)
    while True:
      time.sleep(interval)
      with self._lock:
        if not self._open:
          return
        self._reap()

  def _reap(self) -> None:
    """Under the lock: scores 0 (timed out) every sample whose reward runs past the timeout and replaces its
    worker."""
    now = time.monotonic()
    for worker in list(self._workers):
      if worker.job is None or worker.started + self.timeout_s > now:
        continue
      worker.abandoned = worker.timed_out = True
      self._workers.remove(worker)
      self.abandoned += 1
      self.hung += 1
      worker.job.batch._record(worker.job.index, 0.0, f"the reward function ran past task.reward_timeout_s="
                               f"{self.timeout_s:g} s", timed_out=True)
      logging.warning("A reward ran past task.reward_timeout_s=%g s: scored 0, its thread abandoned (%d so far, %d "
                      "still running); raise the timeout if the verifier is just slow.", self.timeout_s,
                      self.abandoned, self.hung)
      if self.hung > self.max_hung and self.failure is None:
        self.failure = (f"{self.hung} reward threads are still running past task.reward_timeout_s="
                        f"{self.timeout_s:g} s (at most {self.max_hung} are tolerated): the reward function hangs on "
                        f"some completions (e.g. {worker.job.completion[:80]!r}) rather than running slowly. Make it "
                        "return (or raise) within the timeout, then rerun: the run resumes from its last checkpoint.")
      if self.failure is None:  # Once failed, no more threads for it to hang.
        self._spawn()
      self._done.notify_all()
