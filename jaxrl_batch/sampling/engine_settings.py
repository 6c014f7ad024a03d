"""How the rollout engine runs (which engine, its slots, chunks, KV cache pages and attention backend), and the
`sampling.*` config group read into a sampling `Strategy` and these settings."""
import dataclasses
from collections.abc import Mapping

from jaxrl_batch.kernels.decode_attention import BACKENDS, default_backend
from jaxrl_batch.sampling.strategies import Strategy

ENGINES = ("static", "continuous")


def resolved_backend(attention_backend: str) -> str:
  """The decode attention backend, "auto" resolved for the default JAX platform (`kernels.default_backend()`)."""
  return default_backend() if attention_backend == "auto" else attention_backend


@dataclasses.dataclass(frozen=True)
class EngineSettings:
  """How a batch of requests is decoded; tokens do not depend on it (beyond the attention backend's rounding).

  Attributes:
    engine: "static", one block of all rows run to its longest response (`generate`), or "continuous", `slots`
      sequences in flight per device, a finished one's slot taking the next request (`continuous.generate_continuous`).
    slots: sequences decoding at once per device under the continuous engine (0 = every request of the batch).
    chunk: decode steps of the continuous engine between two host syncs (one small transfer each way).
    page_size: > 0 pages the continuous engine's KV cache (`model.PagedKVCache`) in pages of this many slots:
      sequences hold pages as they grow and a prompt's samples share its pages, so more slots fit the memory of
      the slot cache (0 = a slot cache of the longest length per slot). One device per rollout.
    pages: the paged cache's pool, in pages per device (0 = enough for every slot at the longest length: never
      short). A smaller pool holds what the sequences use; when it runs short the latest started sequences are
      preempted and re-prefilled later (`EngineStats.preempted`).
    attention_backend: the `kernels.decode_attention` backend of a decode step: "xla" (every slot of a cache
      grown in power-of-two buckets, masked to the live span), "pallas" (the kernel, reading only the live span of
      the full cache: Triton on GPU, Mosaic on TPU; interpret mode on CPU, for tests only) or "auto" (pallas on
      GPU and TPU, else xla).
  """

  engine: str = "static"
  slots: int = 0
  chunk: int = 16
  page_size: int = 0
  pages: int = 0
  attention_backend: str = "auto"

  def __post_init__(self):
    if self.attention_backend not in ("auto",) + BACKENDS:
      raise ValueError(f"sampling.attention_backend must be 'auto' or one of {BACKENDS}, got "
                       f"{self.attention_backend!r}.")
    if self.engine not in ENGINES:
      raise ValueError(f"sampling.engine must be one of {ENGINES}, got {self.engine!r}.")
    if self.slots < 0:
      raise ValueError(f"sampling.slots must be >= 0 (0 = every request at once), got {self.slots}.")
    if self.chunk < 1:
      raise ValueError(f"sampling.chunk must be >= 1 decode step, got {self.chunk}.")
    if self.page_size < 0 or self.pages < 0:
      raise ValueError(f"sampling.page_size ({self.page_size}) and sampling.pages ({self.pages}) must be >= 0 "
                       "(0 = the slot cache; 0 pages = enough for every slot).")
    if self.page_size and self.engine != "continuous":
      raise ValueError(f"sampling.page_size={self.page_size} pages the continuous engine's cache: set "
                       "sampling.engine='continuous' (or sampling.page_size=0).")

  @property
  def backend(self) -> str:
    """The decode attention backend, "auto" resolved for the default JAX platform."""
    return resolved_backend(self.attention_backend)


def from_config(group: Mapping) -> tuple[Strategy, EngineSettings]:
  """The `sampling.*` config group as (Strategy, EngineSettings): each key goes to the type that holds its field;
  an unknown key is an error."""
  names = [{f.name for f in dataclasses.fields(cls)} for cls in (Strategy, EngineSettings)]
  unknown = sorted(set(group) - names[0] - names[1])
  if unknown:
    raise ValueError(f"Unknown sampling config keys {unknown}; valid keys are {sorted(names[0] | names[1])}.")
  return tuple(cls(**{k: v for k, v in group.items() if k in fields})
               for cls, fields in zip((Strategy, EngineSettings), names))
