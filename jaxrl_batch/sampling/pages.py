"""Host bookkeeping of the continuous engine's paged cache: which pages each slot holds.

The pool (`model.PagedKVCache`) has, in order: the Q prompts' pages (prompt q's logical pages 0..W-1 are pages
q x W..q x W + W - 1, W = P / C, written once at the prefill and shared by every sample of the prompt), then
`pages` pages handed out to the slots as their sequences grow, then the trash page. A slot's table row names its
prompt's W pages (the device adds them: it knows each request's prompt), then its own pages in order (this
table), then the trash page. Pages are reserved a chunk ahead (the tokens a slot may feed before the next host
sync) and returned when its sequence ends or is preempted.
"""
import math

import numpy as np


class PageTable:
  """The own pages of `slots` slots: `pages` growable pages of `page_size` slots, numbered from `first` (after
  the prompt pages); page first + pages is the trash page."""

  def __init__(self, *, slots: int, first: int, pages: int, page_size: int):
    self.page_size, self.pages = page_size, pages
    self.trash = first + pages
    self._free = list(range(self.trash - 1, first - 1, -1))  # a stack: the lowest page is handed out first
    self._own: list[list[int]] = [[] for _ in range(slots)]

  @property
  def free(self) -> int:
    """Pages not held by any slot."""
    return len(self._free)

  def pages_for(self, tokens: int) -> int:
    """Own pages a slot needs to hold `tokens` tokens after its prompt."""
    return math.ceil(tokens / self.page_size)

  def extra_for(self, slot: int, tokens: int) -> int:
    """Pages slot `slot` must take to hold `tokens` tokens."""
    return max(self.pages_for(tokens) - len(self._own[slot]), 0)

  @property
  def held(self) -> int:
    """Pages held by the slots."""
    return self.pages - len(self._free)

  @property
  def widest(self) -> int:
    """The most pages one slot holds."""
    return max(map(len, self._own))

  def grow(self, slot: int, tokens: int):
    """Slot `slot` takes the pages to hold `tokens` tokens; the caller checked `extra_for` <= `free`."""
    extra = self.extra_for(slot, tokens)
    if extra > len(self._free):
      raise ValueError(f"slot {slot} needs {extra} more pages, {len(self._free)} are free.")
    self._own[slot].extend(self._free.pop() for _ in range(extra))

  def release(self, slot: int):
    """Slot `slot`'s sequence ended or was preempted: its own pages go back to the pool."""
    self._free.extend(reversed(self._own[slot]))
    self._own[slot] = []

  def rows(self, width: int) -> np.ndarray:
    """The own pages, int32 (slots, width): each slot's pages in order, then the trash page."""
    table = np.full((len(self._own), width), self.trash, np.int32)
    for slot, own in enumerate(self._own):
      table[slot, :min(len(own), width)] = own[:width]
    return table
