"""Stop at a step boundary on SIGTERM or SIGINT: the run checkpoints, waits for the save and exits.

Preemptible TPU and GPU VMs send SIGTERM before they take the machine; Ctrl-C sends SIGINT. The first signal asks
the loop to stop after the step in progress (`should_stop`), a second one exits at once (the default action of that
signal; an unfinished save never replaces a committed checkpoint).

On many processes JAX's preemption service catches SIGTERM itself (`jax.distributed.initialize`) and every host
agrees on the step to save through `multihost_utils.reached_preemption_sync_point`; nothing is caught here then (a
stop one host decided alone would leave the others waiting in the save's collectives).
"""
import logging
import signal
import threading

import jax
from jax.experimental import multihost_utils


class Stopped(Exception):
  """The run stopped on a signal after saving its checkpoint at `step`."""

  def __init__(self, signum: int, step: int, directory: str, message: str = ""):
    self.signum, self.step = signum, step
    super().__init__(message or f"Stopped on {signal.Signals(signum).name} after saving the checkpoint of step {step} "
                     f"in {directory}; rerun the same command to resume.")


class StopSignals:
  """Context manager: while active, SIGTERM and SIGINT request a stop at the next step boundary (single process)."""

  def __init__(self):
    self.received: int | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self):
    # Python runs handlers on the main thread only; many processes stop through JAX's preemption service.
    if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def _handle(self, signum, frame):
    del frame
    if self.received is not None:  # The second signal: exit now, as that signal does by default.
      self.__exit__()
      signal.signal(signum, signal.SIG_DFL)
      signal.raise_signal(signum)
      return
    self.received = signum
    logging.warning("%s received: saving a checkpoint after this step, then stopping (send it again to exit at "
                    "once, without saving).", signal.Signals(signum).name)

  def should_stop(self, step: int) -> bool:
    """True once a signal asked to stop; on many processes, at the step every host agreed on (a collective: every
    process calls it at every step)."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.received is not None

  @property
  def signum(self) -> int:
    return self.received or signal.SIGTERM
