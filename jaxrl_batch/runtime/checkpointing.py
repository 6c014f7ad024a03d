"""Orbax checkpoints: the train state (a pytree of arrays) plus a small JSON record, saved atomically."""
import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Keeps the latest `max_to_keep` checkpoints of (state pytree, JSON meta) under `directory`.

  Orbax writes each step to a temporary directory and renames it when complete, so an interrupted save never
  replaces a good checkpoint.
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, meta: dict) -> None:
    """Starts an asynchronous save of `state` and `meta` at `step`."""
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, abstract_state, step: int | None = None):
    """(state, meta) at `step` (default: latest), placed with the shardings of `abstract_state`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                   meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
