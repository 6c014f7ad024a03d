"""A full disk as one error: `DiskFull` names the path, the bytes the write needs, the bytes free and what a rerun
does, in place of what the writing library raises (orbax: a ValueError 'RESOURCE_EXHAUSTED ... No space left on
device' after pages of asyncio tracebacks from its writer threads).
"""
import errno
import os
import shutil

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE = os.strerror(errno.ENOSPC)  # 'No space left on device', also in the text of tensorstore's errors.


def size(num_bytes: int) -> str:
  """'812 bytes', '1.4 MB': a byte count for a person."""
  if num_bytes < 1000:
    return f"{num_bytes} bytes"
  for unit in ("kB", "MB", "GB", "TB"):
    num_bytes /= 1000
    if num_bytes < 1000 or unit == "TB":
      return f"{num_bytes:.1f} {unit}"


def free_bytes(path: str) -> int:
  """Bytes free to this user on the filesystem of `path` (or of its nearest existing parent)."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return shutil.disk_usage(path).free


def used_bytes(path: str) -> int:
  """Bytes the files under directory `path` occupy on disk (allocated blocks, not file lengths)."""
  return sum(os.stat(os.path.join(root, name)).st_blocks * 512 for root, _, names in os.walk(path)
             for name in names)


def is_full(error: BaseException) -> bool:
  """Whether `error` (or an error it was raised from) is a write refused for want of space."""
  seen = set()
  while error is not None and id(error) not in seen:
    if (isinstance(error, OSError) and error.errno in FULL_ERRNOS) or NO_SPACE in str(error):
      return True
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return False


class DiskFull(OSError):
  """A write that does not fit: `what` at `path` needs `needed` bytes (None: not known), `free` are free. `resume`
  says what a rerun does once space is freed."""

  def __init__(self, what: str, path: str, needed: int | None, free: int, resume: str = ""):
    super().__init__(errno.ENOSPC, NO_SPACE, path)
    self.what, self.path, self.needed, self.free, self.resume = what, path, needed, free, resume

  @classmethod
  def from_error(cls, error: BaseException, resume: str = "") -> "DiskFull":
    """`error` (`is_full`) as a DiskFull naming the file it names, if any."""
    if isinstance(error, DiskFull):
      return cls(error.what, error.path, error.needed, error.free, resume or error.resume)
    path = getattr(error, "filename", None) or ""
    return cls("a write to" if path else "a write", path, None, free_bytes(path or "."), resume)

  def __str__(self) -> str:
    needs = f"it needs about {size(self.needed)}, and " if self.needed is not None else ""
    where = f" {self.path}" if self.path else ""
    return (f"No space left on device for {self.what}{where}: {needs}{size(self.free)} are free on that filesystem. "
            "Nothing already saved was lost or changed. Free space there (or move the run directory to a larger "
            f"disk), then rerun the same command{': ' + self.resume if self.resume else ''}.")
