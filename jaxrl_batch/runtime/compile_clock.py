"""Seconds this process has spent turning programs into executables: JAX's tracing and lowering and XLA's compiling.

Why: XLA compiles a program the first time it meets its shapes, and some shapes come late in a run (a longer
response reaching a larger KV-cache bucket, another count of packed micro-batches), so a step's wall time can hold
seconds of compiling that the steady state does not pay. Each training row's `compile_s` says how many, so a
throughput sweep, and a prediction checked against it, can be read without them. Counted from JAX's own duration
events (`jax.monitoring`), in every thread of the process.
"""
import threading

import jax

_EVENTS = frozenset(("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                     "/jax/core/compile/backend_compile_duration"))
_lock = threading.Lock()
_total = [0.0]
_listening = []


def _record(event: str, duration_secs: float, **kwargs) -> None:
  del kwargs
  if event in _EVENTS:
    with _lock:
      _total[0] += duration_secs


def seconds() -> float:
  """Seconds spent compiling since the first call (which starts the count)."""
  with _lock:
    if not _listening:
      jax.monitoring.register_event_duration_secs_listener(_record)
      _listening.append(True)
    return _total[0]
