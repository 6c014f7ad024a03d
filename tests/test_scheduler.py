"""The continuous engine's scheduler on fake requests, no model: admission order, slot reuse, preemption and
resume, and the page accounting of a paged cache."""
import numpy as np

from jaxrl_batch.sampling.pages import PageTable
from jaxrl_batch.sampling.scheduler import EVICT, Scheduler


def _pages(slots, pages, page_size=2):
  return PageTable(slots=slots, first=0, pages=pages, page_size=page_size)


def test_carried_requests_are_resumed_first_then_new_ones_admitted_in_order():
  scheduler = Scheduler(slots=3, order=[4, 0, 3, 1, 2], held_R=[0, 0, 0, 7, 0], chunk=4, max_new_tokens=12)
  plan = scheduler.plan()
  np.testing.assert_array_equal(plan.resume_S, [3, -1, -1])
  np.testing.assert_array_equal(plan.admit_S, [-1, 4, 0])
  assert plan.resuming and plan.resumed_longest == 7 and plan.longest == 7
  assert list(scheduler.queue) == [1, 2]
  np.testing.assert_array_equal(scheduler.count_S, [7, 1, 1])


def test_a_freed_slot_takes_the_next_request_and_ended_requests_are_reported():
  scheduler = Scheduler(slots=2, order=range(4), held_R=np.zeros(4), chunk=4, max_new_tokens=12)
  np.testing.assert_array_equal(scheduler.plan().admit_S, [0, 1])
  ended = scheduler.finish(np.array([True, False]), 3)
  np.testing.assert_array_equal(ended, [1])
  np.testing.assert_array_equal(scheduler.count_S[:1], [4])  # 1 + 3 steps
  plan = scheduler.plan()
  np.testing.assert_array_equal(plan.admit_S, [-1, 2])  # slot 0 keeps decoding, slot 1 is reused
  assert not plan.resuming and plan.longest == 4
  np.testing.assert_array_equal(scheduler.finish(np.array([False, False]), 2), [0, 2])
  np.testing.assert_array_equal(scheduler.held(), [0, 0, 0, 0])
  np.testing.assert_array_equal(scheduler.plan().admit_S, [3, -1])
  scheduler.finish(np.array([False, False]), 1)
  assert scheduler.ended_R.all() and not scheduler.pending


def test_held_reports_the_tokens_of_sequences_in_flight_and_of_queued_carried_ones():
  scheduler = Scheduler(slots=1, order=[0, 1, 2], held_R=[0, 5, 3], chunk=2, max_new_tokens=12)
  scheduler.plan()  # request 1 (carried) takes the slot
  scheduler.finish(np.array([True]), 2)
  np.testing.assert_array_equal(scheduler.held(), [0, 7, 3])


def test_a_short_pool_preempts_the_latest_started_which_resumes_once_pages_free():
  # Pages of 2 tokens, chunks of 4 steps, 6 pages: two sequences fit one chunk from their first token, not a second.
  scheduler = Scheduler(slots=2, order=range(3), held_R=np.zeros(3), chunk=4, max_new_tokens=12, pages=_pages(2, 6))
  np.testing.assert_array_equal(scheduler.plan().admit_S, [0, 1])
  assert scheduler.pages.held == 4  # 2 pages each: 1 + 3 tokens
  scheduler.finish(np.array([True, True]), 4)  # 5 tokens each: the next chunk needs 4 pages each, 8 > 6
  plan = scheduler.plan()
  np.testing.assert_array_equal(plan.admit_S, [-1, EVICT])  # slot 1 started last; its request cannot re-enter yet
  assert scheduler.preempted == 1 and list(scheduler.queue) == [1, 2]
  assert scheduler.pages.held == 4 and scheduler.pages.extra_for(1, 1) == 1  # slot 0 grew, slot 1 holds nothing
  np.testing.assert_array_equal(scheduler.held(), [5, 5, 0])  # the preempted request keeps its tokens
  scheduler.finish(np.array([True, False]), 4)
  scheduler.plan()  # slot 0 takes its last pages (11 tokens, 6 pages): none left for request 1
  assert scheduler.pages.free == 0 and list(scheduler.queue) == [1, 2]
  scheduler.finish(np.array([False, False]), 2)
  assert scheduler.pages.free == 6 and scheduler.ended_R.tolist() == [True, False, False]
  plan = scheduler.plan()
  np.testing.assert_array_equal(plan.resume_S, [1, -1])  # resumed from its 5 tokens: 4 pages
  np.testing.assert_array_equal(plan.admit_S, [-1, 2])  # and the next request takes the 2 pages left
  assert plan.resumed_longest == 5 and scheduler.pages.free == 0 and scheduler.pages_peak == 6


def test_pages_cover_every_chunk_and_all_return_to_the_pool():
  # Requests of random lengths on a pool short of every slot at the longest length, the chunks run as the engine
  # runs them (until the chunk's steps, or no live slot): every live sequence holds the pages its chunk can fill,
  # the pool is never overdrawn, every request ends once, and every page comes back.
  rng = np.random.default_rng(0)
  slots, chunk, n, page_size, pool = 4, 3, 16, 2, 12
  length_R = rng.integers(1, n + 1, 20)
  pages = _pages(slots, pool, page_size)
  scheduler = Scheduler(slots=slots, order=range(20), held_R=np.zeros(20), chunk=chunk, max_new_tokens=n, pages=pages)
  ended = []
  while scheduler.pending:
    scheduler.plan()
    live_S = scheduler.live_S.copy()
    assert pages.held <= pool and live_S.any()
    for slot in np.flatnonzero(live_S):
      assert pages.extra_for(slot, min(scheduler.count_S[slot] + chunk - 1, n - 1)) == 0
    left_S = np.where(live_S, length_R[scheduler.request_S] - scheduler.count_S, 0)
    steps = min(chunk, int(left_S.max()))
    ended += scheduler.finish(live_S & (left_S > steps), steps).tolist()
  assert sorted(ended) == list(range(20)) and scheduler.ended_R.all()
  assert pages.free == pool and scheduler.preempted > 0 and scheduler.pages_peak <= pool
