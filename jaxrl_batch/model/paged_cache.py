"""The paged key/value cache: a pool of fixed-size pages per layer, and a page table giving each row its pages.

Row b's logical cache slot s lives in page table_BxM[b, s // C] at offset s % C, so a row sees a cache of M x C
slots, of which only the pages it names are held: pages are allocated as a sequence grows and can be shared (the G
samples of a prompt name the same prompt pages). The last page of the pool is the trash page: writes of idle rows
(`idle_slot`) and of slots beyond the table land there, and no live span reads it. Who owns which page is the
caller's business (`jaxrl_batch.sampling.pages`); this type only reads and writes through the table.

Layout, per layer: keys (P, K, H, C) and values (P, K, C, H), a (page, kv head) block being one contiguous H x C
and C x H block, the decode kernel's reading order (`kernels.paged_attention`), as `KVCache`'s rows are.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_batch.kernels.paged_attention import paged_decode_attention
from jaxrl_batch.model.config import ModelConfig


class PagedKVCache(NamedTuple):
  """Pages of keys and values, one array per layer and kind, and the rows' page table (int32 (B, M))."""

  k_layers: tuple[jax.Array, ...]  # L x (P, K, H, C)
  v_layers: tuple[jax.Array, ...]  # L x (P, K, C, H)
  table_BxM: jax.Array

  @staticmethod
  def bytes_for(cfg: ModelConfig, pages: int, page_size: int, dtype=None) -> int:
    """Bytes of a pool of `pages` pages of `page_size` slots: L layers x (keys + values) x K x H x slots."""
    itemsize = jnp.dtype(dtype or cfg.compute_dtype).itemsize
    return 2 * cfg.num_layers * pages * page_size * cfg.num_kv_heads * cfg.head_dim * itemsize

  @property
  def page_size(self) -> int:
    """C, the slots per page."""
    return self.v_layers[0].shape[2]

  @property
  def trash(self) -> int:
    """The page that takes writes nobody reads."""
    return self.v_layers[0].shape[0] - 1

  @property
  def length(self) -> int:
    """M x C, the logical slots a row sees."""
    return self.table_BxM.shape[1] * self.page_size

  @property
  def idle_slot(self) -> int:
    """A logical slot an idle row may write to harmlessly: beyond its table, so into the trash page."""
    return self.length

  def _pages(self, slot_BxT):
    """The page and offset of each row's logical slots (int (B, T)); slots beyond the table go to the trash."""
    m, c = self.table_BxM.shape[1], self.page_size
    logical_BxT = slot_BxT // c
    page_BxT = jnp.take_along_axis(self.table_BxM, jnp.clip(logical_BxT, 0, m - 1), axis=1)
    return jnp.where((logical_BxT >= 0) & (logical_BxT < m), page_BxT, self.trash), slot_BxT % c

  def write(self, layer: int, index, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array) -> "PagedKVCache":
    """Writes T new keys/values of one layer at each row's logical slots index..index+T-1, through the table.
    `index` is an int scalar, or an int (B,) of each row's own first slot."""
    t = k_BxTxKxH.shape[1]
    slot_BxT = jnp.reshape(index, (-1, 1)) + jnp.arange(t)[None, :]
    page_BxT, offset_BxT = self._pages(jnp.broadcast_to(slot_BxT, k_BxTxKxH.shape[:2]))
    k, v = self.k_layers[layer], self.v_layers[layer]
    k = k.at[page_BxT, :, :, offset_BxT].set(k_BxTxKxH.astype(k.dtype))  # (B, T) then (K, H), as k_BxTxKxH
    v = v.at[page_BxT, :, offset_BxT, :].set(v_BxTxKxH.astype(v.dtype))
    return self._replace(k_layers=(*self.k_layers[:layer], k, *self.k_layers[layer + 1:]),
                         v_layers=(*self.v_layers[:layer], v, *self.v_layers[layer + 1:]))

  def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
    """One layer's keys (B, K, H, M x C) and values (B, K, M x C, H) in `KVCache`'s dense layout: the table's
    pages gathered (for prefills over the cache; decode steps read the pages in place)."""
    b, m = self.table_BxM.shape
    k_BxMxKxHxC = self.k_layers[layer][self.table_BxM]
    v_BxMxKxCxH = self.v_layers[layer][self.table_BxM]
    _, _, kv, h, c = k_BxMxKxHxC.shape
    return (jnp.transpose(k_BxMxKxHxC, (0, 2, 3, 1, 4)).reshape(b, kv, h, m * c),
            jnp.transpose(v_BxMxKxCxH, (0, 2, 1, 3, 4)).reshape(b, kv, m * c, h))

  def decode_attention(self, layer: int, q_BxNxH, starts_B, ends_B, *, backend: str, window: int | None = None):
    """One-token attention of each row over its logical slots [starts_B, ends_B), read page by page
    (`kernels.paged_decode_attention`); `window` is for a slot cache (pages are read through the table). Returns
    out_BxNxH."""
    del window
    return paged_decode_attention(q_BxNxH, self.k_layers[layer], self.v_layers[layer], self.table_BxM, ends_B,
                                  starts_B, backend=backend)
