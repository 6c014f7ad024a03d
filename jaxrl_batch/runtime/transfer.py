"""The named host<->device crossings of a run.

Every transfer of a training step goes through `to_device(name, ...)` or `to_host(name, ...)`, and coarse phases
that move whole trees (evaluation, checkpoints, the warm start) run inside `scope(name)`. Each call is counted by
name (`counts()`), so a test can run steps under `jax.transfer_guard("disallow_explicit")`, with every other
device-to-host read refused, and check that only the named crossings happen. Inside a named crossing transfers are
allowed; `current()` names it.

A GRPO or PPO step (one sampling round) crosses five times: prompts (+ the sampling key's data) up, response
tokens down (for decoding and scoring), rewards up, the KL coefficient and the mini-batch orders up (from the
trainer), and the step's metrics down, once, one step late.
"""
import collections
import contextlib
import threading

import jax
import numpy as np

from jaxrl_batch.runtime import distributed

_counts: collections.Counter = collections.Counter()
_state = threading.local()


def current() -> str | None:
  """The name of the crossing in progress on this thread, or None."""
  return getattr(_state, "name", None)


@contextlib.contextmanager
def scope(name: str):
  """A named crossing: counted once; host<->device transfers inside it are allowed. A crossing inside another (the
  engine's chunk crossings inside `eval`) is part of the outer one and not counted again."""
  outer = current()
  if outer is None:
    _counts[name] += 1
  _state.name = name
  try:
    with jax.transfer_guard("allow"):
      yield
  finally:
    _state.name = outer


def place(tree, shardings):
  """Host arrays (numpy or Python scalars) placed as global arrays with `shardings`: one per leaf, one for all, or
  a function of the leaf's ndim. Not counted: call it inside a named crossing (`to_device` or `scope`).

  Every process holds the same full arrays (computed from (seed, step)) and copies only the shards of its own
  devices, so a multi-host step needs no cross-host transfer for them.
  """
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [np.asarray(x) for x in leaves]
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = [shardings] * len(leaves)
  elif callable(shardings):
    shardings = [shardings(x.ndim) for x in leaves]
  else:
    shardings = jax.tree.leaves(shardings)
  return jax.tree.unflatten(treedef, [jax.make_array_from_callback(x.shape, s, lambda idx, x=x: x[idx])
                                      for x, s in zip(leaves, shardings)])


def to_device(name: str, tree, shardings):
  """`place` as the named crossing `name`."""
  with scope(name):
    return place(tree, shardings)


def to_host(name: str, tree):
  """Device arrays read back as numpy (a collective on many hosts: every process calls it with the same tree)."""
  with scope(name):
    return distributed.to_host(tree)


def counts() -> dict[str, int]:
  """Crossings so far, by name."""
  return dict(_counts)


def reset() -> None:
  _counts.clear()
