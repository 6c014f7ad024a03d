"""The continuous engine's scheduler: which request each slot decodes, chunk by chunk, as plain host Python.

Before a chunk, `plan` preempts (with a paged cache: while the pool cannot cover the live sequences' next chunk,
the latest started one gives its pages back and queues first again), then admits queued requests into free slots,
those holding tokens first (they are re-prefilled: "resumed"; a request kept in its slot from an earlier call
starts there instead). After it, `finish` takes which slots are still live
and frees the others. `continuous.decode` carries the decisions out on the device; nothing here touches a model, so
the policy is tested with fake requests.
"""
import collections
import dataclasses

import numpy as np

from jaxrl_batch.sampling.pages import PageTable

EVICT = -2  # admit_S of a slot whose sequence is preempted


@dataclasses.dataclass(frozen=True)
class Plan:
  """One chunk's decisions. admit_S: int32 (S,), a new request's index for the slot, EVICT for a preempted one, -1
  to leave it; resume_S: int32 (S,), a request holding tokens, re-prefilled into the slot (-1 otherwise); longest:
  the most tokens an occupied slot holds; resumed_longest: the most a resumed request holds (0 without one)."""
  admit_S: np.ndarray
  resume_S: np.ndarray
  longest: int
  resumed_longest: int

  @property
  def resuming(self) -> bool:
    return bool((self.resume_S >= 0).any())


class Scheduler:
  """Host state of `slots` slots decoding the requests of `order` (indices), `held_R` tokens each so far (0 for a
  new request), in chunks of up to `chunk` decode steps of sequences of at most `max_new_tokens` tokens; `pages`
  holds the own pages of a paged cache (None: a slot cache, which never runs short). `slot_R` (int (R,), -1: none)
  names the slot each request kept from an earlier call already decodes in (`continuous.KeptSlots`): it starts
  there, live, holding its held_R tokens, and never queues."""

  def __init__(self, *, slots: int, order, held_R, chunk: int, max_new_tokens: int, pages: PageTable | None = None,
               slot_R=None):
    self.held_R = np.array(held_R, np.int64)
    slot_R = np.full(len(self.held_R), -1, np.int64) if slot_R is None else np.asarray(slot_R, np.int64)
    queued = [i for i in order if slot_R[i] < 0]
    self.queue = collections.deque(sorted(queued, key=lambda i: self.held_R[i] == 0))  # the carried first, in order
    self.request_S = np.full(slots, -1, np.int64)
    self.count_S = np.zeros(slots, np.int64)  # tokens each slot's sequence holds
    self.live_S = np.zeros(slots, bool)
    kept = np.flatnonzero(slot_R >= 0)
    if (self.held_R[kept] < 1).any() or len(set(slot_R[kept].tolist())) < len(kept):
      raise ValueError("Kept requests must hold tokens, each in a slot of its own.")
    self.request_S[slot_R[kept]], self.count_S[slot_R[kept]], self.live_S[slot_R[kept]] = kept, self.held_R[kept], True
    self.ended_R = np.zeros(len(self.held_R), bool)
    self.pages, self.preempted, self.pages_peak = pages, 0, 0
    self._started_S, self._started = np.zeros(slots, np.int64), 0  # start order: preemption takes the latest
    self._chunk, self._n = chunk, max_new_tokens

  @property
  def pending(self) -> bool:
    """Whether a request is queued or decoding."""
    return bool(self.queue) or bool(self.live_S.any())

  def _reach(self, count: int) -> int:
    """Tokens a sequence holding `count` may have fed by the end of the chunk."""
    return min(count + self._chunk - 1, self._n - 1)

  def plan(self) -> Plan:
    """The next chunk's preemptions and admissions; the pages it fills are reserved."""
    admit_S, resume_S = np.full(len(self.live_S), -1, np.int32), np.full(len(self.live_S), -1, np.int32)
    if self.pages is not None:
      self._preempt(admit_S)
    self._admit(admit_S, resume_S)
    if self.pages is not None:
      self.pages_peak = max(self.pages_peak, self.pages.held)
    resumed = resume_S >= 0
    return Plan(admit_S, resume_S, int(self.count_S[self.live_S].max(initial=0)),
                int(self.count_S[resumed].max(initial=0)))

  def _preempt(self, admit_S: np.ndarray):
    """While the free pages cannot cover the live sequences' chunk, the latest started gives its pages back and
    queues first, keeping its tokens; then the others take their pages."""
    live = list(np.flatnonzero(self.live_S))
    while sum(self.pages.extra_for(x, self._reach(self.count_S[x])) for x in live) > self.pages.free:
      victim = max(live, key=lambda x: self._started_S[x])
      live.remove(victim)
      self.pages.release(victim)
      self.queue.appendleft(self.request_S[victim])
      self.held_R[self.request_S[victim]], admit_S[victim] = self.count_S[victim], EVICT
      self.live_S[victim], self.request_S[victim], self.preempted = False, -1, self.preempted + 1
    for x in live:
      self.pages.grow(x, self._reach(self.count_S[x]))

  def _admit(self, admit_S: np.ndarray, resume_S: np.ndarray):
    """Free slots, in order, take the queue's head while the pool (if any) has its chunk's pages."""
    for slot in np.flatnonzero(~self.live_S):
      if not self.queue:
        break
      held = max(int(self.held_R[self.queue[0]]), 1)
      if self.pages is not None:
        if self.pages.extra_for(slot, self._reach(held)) > self.pages.free:
          break
        self.pages.grow(slot, self._reach(held))
      request = self.request_S[slot] = self.queue.popleft()
      (resume_S if self.held_R[request] > 0 else admit_S)[slot] = request
      self.count_S[slot], self.live_S[slot], self._started_S[slot] = held, True, self._started
      self._started += 1

  def finish(self, live_S: np.ndarray, steps: int) -> np.ndarray:
    """The chunk ran `steps` decode steps and left `live_S` (bool (S,)) decoding: the other occupied slots' requests
    ended and their slots and pages are free. Returns the ended requests' indices, in slot order."""
    ended_S = self.live_S & ~live_S
    ended = self.request_S[ended_S].copy()
    self.ended_R[ended] = True
    self.request_S[ended_S] = -1
    if self.pages is not None:
      for slot in np.flatnonzero(ended_S):
        self.pages.release(slot)
    self.count_S += steps * live_S
    self.live_S = np.array(live_S, bool)
    return ended

  def held(self) -> np.ndarray:
    """int64 (R,): the tokens each request in flight or queued with tokens holds (0 for the others)."""
    held_R = np.zeros(len(self.held_R), np.int64)
    held_R[self.request_S[self.live_S]] = self.count_S[self.live_S]
    for i in self.queue:  # carried or preempted, not resumed yet: they keep their tokens
      held_R[i] = self.held_R[i]
    return held_R
