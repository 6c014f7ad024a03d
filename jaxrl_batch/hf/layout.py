"""Where each of our parameters lives in a Hugging Face Llama/Qwen/Qwen3-MoE checkpoint, and how the axes map.

HF stores a Linear weight as [out, in] with heads flattened into one axis; we keep [in, out] with heads split
(`wq` is (D, N, H)). A `Tensor` records, for each HF axis, which of our axes it flattens (row-major), so the same
record converts either way and lets a loader read only the rows and columns one device needs. An MoE checkpoint
stores each expert's weights as its own tensors; we stack them on a leading expert axis.
"""
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from jaxrl_batch.model import ModelConfig


class Tensor(NamedTuple):
  """One checkpoint tensor.

  name: the HF tensor name, e.g. "model.layers.0.self_attn.q_proj.weight".
  path: keys of our parameter in the params dict, e.g. ("blocks", 0, "attn", "wq").
  axes: for each HF axis, outermost first, the tuple of our axes it flattens; q_proj.weight (N*H, D) holds our
    wq (D, N, H) as ((1, 2), (0,)).
  expert: None, or the index j along our parameter's leading (expert) axis of the slice this tensor holds; `axes`
    then refer to the axes of that slice. "mlp.experts.3.gate_proj.weight" (F, D) is w_gate[3] (D, F) transposed.
  """

  name: str
  path: tuple
  axes: tuple[tuple[int, ...], ...]
  expert: int | None = None

  def shape_of(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of what this tensor holds of a parameter of `param_shape`, in our axis order."""
    return param_shape if self.expert is None else param_shape[1:]


_SAME_1D = ((0,),)
_SAME_2D = ((0,), (1,))
_TRANSPOSED = ((1,), (0,))
_HEADS_OUT = ((1, 2), (0,))  # (D, N, H) <- [N*H, D]
_HEADS_IN = ((2,), (0, 1))  # (N, H, D) <- [D, N*H]
_HEADS_BIAS = ((0, 1),)  # (N, H) <- [N*H]
_MLP = ("gate", "up", "down")


def tensors(cfg: ModelConfig) -> list[Tensor]:
  """Every tensor a checkpoint of `cfg` holds (no lm_head when the embedding is tied)."""
  out = [Tensor("model.embed_tokens.weight", ("embedding",), _SAME_2D),
         Tensor("model.norm.weight", ("final_norm", "scale"), _SAME_1D)]
  if not cfg.tie_embeddings:
    out.append(Tensor("lm_head.weight", ("lm_head",), _TRANSPOSED))
  for i in range(cfg.num_layers):
    hf, ours = f"model.layers.{i}.", ("blocks", i)
    out += [Tensor(hf + "input_layernorm.weight", ours + ("attn_norm", "scale"), _SAME_1D),
            Tensor(hf + "post_attention_layernorm.weight", ours + ("mlp_norm", "scale"), _SAME_1D),
            Tensor(hf + "self_attn.o_proj.weight", ours + ("attn", "wo"), _HEADS_IN)]
    out += _moe(cfg, hf, ours) if i in cfg.moe_layers else [
        Tensor(hf + f"mlp.{name}_proj.weight", ours + ("mlp", f"w_{name}"), _TRANSPOSED) for name in _MLP]
    for x in "qkv":
      out.append(Tensor(hf + f"self_attn.{x}_proj.weight", ours + ("attn", f"w{x}"), _HEADS_OUT))
      if cfg.qkv_bias:
        out.append(Tensor(hf + f"self_attn.{x}_proj.bias", ours + ("attn", f"b{x}"), _HEADS_BIAS))
    if cfg.qk_norm:
      out += [Tensor(hf + "self_attn.q_norm.weight", ours + ("attn", "q_norm", "scale"), _SAME_1D),
              Tensor(hf + "self_attn.k_norm.weight", ours + ("attn", "k_norm", "scale"), _SAME_1D)]
  return out


def _moe(cfg: ModelConfig, hf: str, ours: tuple) -> list[Tensor]:
  """A Qwen3-MoE layer: the router, and one (gate, up, down) triple per expert, each a slice of our stacked
  (E, ...) weights."""
  return [Tensor(hf + "mlp.gate.weight", ours + ("mlp", "router"), _TRANSPOSED)] + [
      Tensor(hf + f"mlp.experts.{j}.{name}_proj.weight", ours + ("mlp", f"w_{name}"), _TRANSPOSED, j)
      for j in range(cfg.num_experts) for name in _MLP]


def hf_shape(shape: tuple[int, ...], axes) -> tuple[int, ...]:
  """Shape in the checkpoint of a parameter of our `shape`."""
  return tuple(math.prod(shape[a] for a in group) for group in axes)


def to_hf(x: np.ndarray, axes) -> np.ndarray:
  """Our full parameter in the checkpoint layout."""
  return x.transpose([a for group in axes for a in group]).reshape(hf_shape(x.shape, axes))


def read_block(read: Callable[[tuple[slice, ...]], np.ndarray], shape: tuple[int, ...], axes,
               index: tuple[slice, ...]) -> np.ndarray:
  """The block `index` (one slice per axis of our `shape`) of a parameter, via `read(hf_index)`.

  Each HF axis is read over the range of its outermost flattened axis (inner axes whole), so a block of heads
  reads only those heads' rows; the inner axes are sliced after the reshape.
  """
  bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
  hf_index, block_shape = [], []
  for outer, *inner in axes:
    inner_size = math.prod(shape[a] for a in inner)
    start, stop = bounds[outer]
    hf_index.append(slice(start * inner_size, stop * inner_size))
    block_shape += [stop - start] + [shape[a] for a in inner]
  order = [a for group in axes for a in group]
  block = read(tuple(hf_index)).reshape(block_shape).transpose(np.argsort(order))
  outers = {group[0] for group in axes}
  return block[tuple(slice(None) if a in outers else slice(*bounds[a]) for a in range(len(shape)))]


def load_param(read: Callable[[str, tuple[slice, ...]], np.ndarray], tensors: list[Tensor],
               spec: jax.ShapeDtypeStruct) -> jax.Array:
  """One parameter from its tensor (or, stacked, its experts' tensors), each device reading only its block via
  `read(name, hf_index)` (read once per distinct block on this host)."""
  blocks = {}

  def read_tensor(tensor, index):
    return read_block(functools.partial(read, tensor.name), tensor.shape_of(spec.shape), tensor.axes, index)

  def block(index):
    key = tuple(s.indices(n)[:2] for s, n in zip(index, spec.shape))
    if key not in blocks:
      if tensors[0].expert is None:
        blocks[key] = read_tensor(tensors[0], index).astype(spec.dtype)
      else:
        by_expert = {t.expert: t for t in tensors}
        blocks[key] = np.stack([read_tensor(by_expert[j], index[1:]) for j in range(*key[0])]).astype(spec.dtype)
    return blocks[key]

  return jax.make_array_from_callback(spec.shape, spec.sharding, block)
