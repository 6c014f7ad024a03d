"""Orbax checkpoints: the train state (a pytree of arrays) plus a small JSON record, saved atomically.

A checkpoint is never saved with non-finite state (`all_finite` is the caller's check), and restoring falls back
from an unusable latest checkpoint (unreadable, or holding non-finite values) to the newest usable one, setting the
unusable ones aside under `<directory>_unusable/` (kept, never deleted) so that later saves can take their steps.
A save that the filesystem has no room for is refused before anything is written (`disk_space.DiskFull`).
"""
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxrl_batch.runtime import disk_space


class NoUsableCheckpoint(RuntimeError):
  """Every checkpoint of a directory failed to restore or held non-finite values."""


@jax.jit
def all_finite(tree) -> jax.Array:
  """Scalar bool: every floating-point leaf of `tree` is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def saved_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints in `directory`, oldest first, read from the disk (orbax renames a step's
  directory to its number once the save is complete)."""
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(name) for name in names if name.isdigit())


# Bytes a checkpoint adds to its arrays' (an upper bound: orbax compresses): metadata per array, and per checkpoint
# its small files, each a filesystem block at least.
_BYTES_PER_ARRAY, _BYTES_PER_CHECKPOINT = 1024, 128 * 1024


def _reason(error: Exception) -> str:
  first = (str(error).strip().splitlines() or [""])[0]
  return f"{type(error).__name__}: {first[:300]}"


class Checkpointer:
  """Keeps the latest `max_to_keep` checkpoints of (state pytree, JSON meta) under `directory`.

  Orbax writes each step to a temporary directory and renames it when complete, so an interrupted save never
  replaces a good checkpoint.
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))
    self._pending = None  # (step, bytes needed) of the save in progress.

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of the directory's checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state, meta: dict) -> None:
    """Starts an asynchronous save of `state` and `meta` at `step` once the previous save is complete. DiskFull when
    the filesystem lacks a checkpoint's space (the latest checkpoint's, or for the first the state's arrays'): then
    nothing is written. The kept checkpoints are deleted only after a new one is complete, so one more must fit."""
    self.wait_until_finished()
    needed = self._checkpoint_bytes(state, meta)
    free = disk_space.free_bytes(self.directory)
    if jax.process_count() > 1:  # Every process takes process 0's decision: a save is collective. In float32, as
      # JAX without x64 would make an int64 an int32 (overflowing past 2 GiB); 24 bits of precision are plenty here.
      free = int(multihost_utils.broadcast_one_to_all(np.float32(free)))
    if free < needed:
      raise disk_space.DiskFull(f"the checkpoint of step {step} in", self.directory, needed, free)
    self._pending = (step, needed)
    with self._full_as_disk_full():
      self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       meta=ocp.args.JsonSave(meta)), force=True)

  def _checkpoint_bytes(self, state, meta: dict) -> int:
    """The space a checkpoint of `state` and `meta` takes: the latest checkpoint's, else an upper bound."""
    steps = saved_steps(self.directory)
    if steps:
      return disk_space.used_bytes(self.step_path(steps[-1]))
    leaves = jax.tree.leaves(state)
    arrays = sum(getattr(x, "nbytes", 8) for x in leaves)
    return arrays + _BYTES_PER_ARRAY * len(leaves) + len(json.dumps(meta, default=str)) + _BYTES_PER_CHECKPOINT

  @contextlib.contextmanager
  def _full_as_disk_full(self):
    """Raises a save that failed for want of space (the save in progress, or a pending asynchronous one) as
    DiskFull: orbax's own error follows pages of tracebacks from its writer threads."""
    try:
      yield
    except Exception as e:  # noqa: BLE001  (tensorstore's ValueError, an OSError, ...)
      if self._pending is None or not disk_space.is_full(e):
        raise
      step, needed = self._pending
      raise disk_space.DiskFull(f"the checkpoint of step {step} in", self.directory, needed,
                                disk_space.free_bytes(self.directory)) from e

  def wait_until_finished(self) -> None:
    """Waits for a pending asynchronous save (DiskFull if it failed for want of space)."""
    with self._full_as_disk_full():
      self._manager.wait_until_finished()
    self._pending = None

  def restore(self, abstract_state, step: int | None = None):
    """(state, meta) at `step` (default: latest), placed with the shardings of `abstract_state`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                   meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

  def restore_usable(self, abstract_state, problem: Callable[[object], str | None]):
    """(state, meta) of the newest checkpoint that restores and for which `problem(state)` is None.

    Newer unusable checkpoints are reported by path and moved to `<directory>_unusable/<step>-<time>/`. When none
    is usable, nothing is moved and NoUsableCheckpoint lists each checkpoint's path and problem.
    """
    rejected = []
    for step in reversed(self.all_steps()):
      try:
        state, meta = self.restore(abstract_state, step)
        reason = problem(state)
      except Exception as e:  # noqa: BLE001  (orbax raises many types for a damaged checkpoint)
        reason = _reason(e)
      if reason is None:
        for bad, why in rejected:
          self._set_aside(bad, why, fallback=step)
        return state, meta
      rejected.append((step, reason))
    listing = "; ".join(f"{self.step_path(s)}: {why}" for s, why in rejected)
    raise NoUsableCheckpoint(
        f"No usable checkpoint in {self.directory} ({listing}). Nothing was changed. Restore a copy of the "
        "directory if you have one, or start over in a new --workdir.")

  def _set_aside(self, step: int, reason: str, fallback: int) -> None:
    """Moves step's checkpoint out of the managed directory (only process 0 moves files; every process reloads)."""
    path = self.step_path(step)
    target = os.path.join(self.directory + "_unusable", f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.move(path, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
    logging.warning("Checkpoint %s is unusable (%s): moved to %s; resuming from step %d instead.", path, reason,
                    target, fallback)
    self._manager.reload()

  def close(self) -> None:
    self.wait_until_finished()
    self._manager.close()
