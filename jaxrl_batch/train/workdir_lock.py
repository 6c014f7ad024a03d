"""One process at a time in a run directory: an advisory lock on `<workdir>/lock`.

The lock is `flock` on the file, so the kernel releases it when its holder exits, however it exits (kill -9
included): a lock file left behind by a dead process is never mistaken for a live holder. The file names the holder
(pid, host, start time) for the message a second process gets. In a multi-process run only process 0 takes it.
"""
import fcntl
import json
import os
import socket
import time

from jaxrl_batch.runtime.distributed import is_main_process
from jaxrl_batch.train import rundir


class WorkdirBusy(RuntimeError):
  """Another live process holds the run directory."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _describe(holder: dict) -> str:
  """'pid 123 on host h (alive, since 2026-12-04 16:44:01)'."""
  pid, host = holder.get("pid"), holder.get("host", "?")
  state = ""
  if host == socket.gethostname() and isinstance(pid, int):
    state = "alive, " if _alive(pid) else "not running here any more, its lock still held by a child process, "
  since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
  return f"pid {pid} on host {host} ({state}since {since})"


class WorkdirLock:
  """`acquire()` takes the lock or raises WorkdirBusy naming the holder; `release()` gives it back."""

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self.path = rundir.lock_path(run_dir)
    self._fd: int | None = None

  def acquire(self) -> None:
    if not is_main_process() or self._fd is not None:
      return
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._holder(fd)
      os.close(fd)
      raise WorkdirBusy(
          f"{self.run_dir} is in use by {_describe(holder)}: two runs in one directory would overwrite each other's "
          f"metrics and checkpoints. Wait for it to finish (or stop it: it saves a checkpoint on SIGTERM), or use "
          f"another --workdir.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), since=time.time())).encode(), 0)
    self._fd = fd

  @staticmethod
  def _holder(fd: int) -> dict:
    try:
      return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
      return {}

  def release(self) -> None:
    if self._fd is None:
      return
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()
