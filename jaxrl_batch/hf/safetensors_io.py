"""Safetensors checkpoints (one file, or shards listed by `model.safetensors.index.json`) read and written with numpy.

Reads are by slice, so a loader touches only the bytes it needs; writes go one shard at a time.
"""
import contextlib
import json
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy; safetensors' numpy reader needs it)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class Reader:
  """The tensors of a Hugging Face checkpoint directory; use as a context manager."""

  def __init__(self, directory: str):
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
      weight_map = None
    else:
      raise FileNotFoundError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; pass a Hugging Face "
                              "checkpoint directory saved with safetensors (save_pretrained's default).")
    self._stack = contextlib.ExitStack()
    self._file_of = {}  # what the files hold, whatever the index claims
    self._path_of = {}
    for file in sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]:
      path = os.path.join(directory, file)
      try:
        handle = self._stack.enter_context(safe_open(path, framework="np"))
      except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        self._stack.close()
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); it may be "
                         "truncated or still downloading: fetch it again.") from e
      self._file_of.update(dict.fromkeys(handle.keys(), handle))
      self._path_of.update(dict.fromkeys(handle.keys(), path))

  def __enter__(self) -> "Reader":
    return self

  def __exit__(self, *exc) -> None:
    self._stack.close()

  def names(self) -> set[str]:
    return set(self._file_of)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._file_of[name].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """Only the block `index` of tensor `name`, in its stored dtype."""
    try:
      return self._file_of[name].get_slice(name)[index]
    except Exception as e:  # noqa: BLE001
      raise ValueError(f"Tensor {name} of {self._path_of[name]} cannot be read ({type(e).__name__}: {e}); the file "
                       "may be truncated: fetch it again.") from e


class Entry(NamedTuple):
  """A tensor to write: its name, size in bytes, and how to produce it (called when its shard is written)."""

  name: str
  nbytes: int
  fetch: Callable[[], np.ndarray]


def _readable_by_all(path: str) -> None:
  """Gives `path` the mode a plain `open` would (0666 less the umask): safetensors writes 0600."""
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


def write(directory: str, entries: Sequence[Entry], max_shard_bytes: int, writer: bool = True) -> None:
  """Writes `entries` as `model.safetensors`, or as `model-0000i-of-0000n.safetensors` shards plus an index when
  they exceed `max_shard_bytes`. Each shard's tensors are fetched just before it is written. Every process calls
  this (fetching may be collective); only `writer` writes files."""
  shards = [[]]
  size = 0
  for entry in entries:
    if shards[-1] and size + entry.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += entry.nbytes
  n = len(shards)
  files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  if writer:
    os.makedirs(directory, exist_ok=True)
  for file, shard in zip(files, shards):
    tensors = {entry.name: np.ascontiguousarray(entry.fetch()) for entry in shard}
    if writer:
      save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
      _readable_by_all(os.path.join(directory, file))
  if writer and n > 1:
    index = dict(metadata=dict(total_size=sum(e.nbytes for e in entries)),
                 weight_map={e.name: file for file, shard in zip(files, shards) for e in shard})
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)
