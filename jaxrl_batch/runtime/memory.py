"""How much memory a device has left: the figure a start-up check compares a planned allocation with."""
import os

import jax


def free_bytes(device: jax.Device) -> int | None:
  """Bytes the device can still allocate: its allocator's limit minus what is in use (GPU, TPU), or the host's
  available RAM for a CPU device; None when neither is known."""
  stats = device.memory_stats()
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  if device.platform == "cpu":
    try:
      return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
      return None
  return None
