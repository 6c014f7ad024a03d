"""Hugging Face Llama/Qwen2/Qwen3/Qwen3-MoE checkpoints in (`from_pretrained`) and out (`save_pretrained`), with
LoRA adapters as PEFT adapter directories (`hf.peft`).

Loading is sharded as it goes: params are laid out by `sharding.abstract_sharded`, and each device's block of each
tensor is read straight from the safetensors files, so no host ever holds a full copy of a sharded parameter.
"""
import json
import math
import os

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxrl_batch.hf import config as hf_config
from jaxrl_batch.hf import layout, peft, safetensors_io
from jaxrl_batch.model import ModelConfig, Transformer
from jaxrl_batch.model import lora as lora_lib
from jaxrl_batch.runtime import sharding

# Tensors some checkpoints carry that the model recomputes or ties.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _keys(path) -> tuple:
  return tuple(k.key for k in path)


def _check_tensors(reader: safetensors_io.Reader, tensors: list[layout.Tensor], abstract, cfg: ModelConfig,
                   directory: str) -> None:
  """Every expected tensor present with the right shape, and nothing unexplained left over."""
  found = reader.names()
  expected = {t.name for t in tensors}
  missing = sorted(expected - found)
  if missing:
    raise ValueError(f"{directory}: tensor {missing[0]} is missing ({len(missing)} missing in all), but config.json "
                     f"implies it (tie_word_embeddings={cfg.tie_embeddings}, num_hidden_layers={cfg.num_layers}); "
                     "fix config.json or supply the complete checkpoint.")
  ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
  extra = sorted(n for n in found - expected - ignored if not n.endswith(_IGNORED_SUFFIXES))
  if extra:
    raise ValueError(f"{directory}: unexpected tensor {extra[0]} ({len(extra)} unexpected in all); config.json "
                     "describes a model without it (check architectures, attention_bias, tie_word_embeddings).")
  shapes = {_keys(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  for t in tensors:
    want = layout.hf_shape(t.shape_of(shapes[t.path]), t.axes)
    if reader.shape(t.name) != want:
      raise ValueError(f"{directory}: tensor {t.name} has shape {reader.shape(t.name)}, but config.json implies "
                       f"{want}; config.json does not match the weights.")


def from_pretrained(path: str, *, mesh: jax.sharding.Mesh | None = None, rules=None, dtype: str = "float32",
                    param_dtype: str | None = None, adapter: str | None = None):
  """Loads a Hugging Face LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM directory.

  Args:
    path: directory with config.json and model.safetensors (or model.safetensors.index.json + shards).
    mesh: where params live (default: the first device); each parameter is sharded by `rules` as it loads.
    rules: logical axis -> mesh axis rules (default: `sharding.DEFAULT_RULES`).
    dtype: activation dtype of the model ("float32" or "bfloat16").
    param_dtype: dtype params are stored in (default: `dtype`); checkpoint values are cast to it.
    adapter: a PEFT LoRA adapter directory to load onto the checkpoint (`peft.load_adapter`; float32 adapters).
  Returns:
    (ModelConfig, graphdef, params) with params a nested dict, usable as `nnx.merge(graphdef, params)`; with an
    adapter, the graphdef is the model's with adapters (`Transformer(cfg, rngs, lora=...)`) and params hold them.
  """
  with open(os.path.join(path, "config.json")) as f:
    cfg = hf_config.to_model_config(json.load(f), dtype, param_dtype)
  mesh = mesh or sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, abstract = sharding.abstract_sharded(lambda: Transformer(cfg, nnx.Rngs(0)), mesh,
                                                 sharding.DEFAULT_RULES if rules is None else rules)
  tensors = layout.tensors(cfg)
  by_path = {}
  for t in tensors:
    by_path.setdefault(t.path, []).append(t)
  with safetensors_io.Reader(path) as reader:
    _check_tensors(reader, tensors, abstract, cfg, path)
    params = jax.tree_util.tree_map_with_path(lambda p, spec: layout.load_param(reader.read, by_path[_keys(p)], spec), abstract)
  if adapter is not None:
    _, graphdef, params = peft.load_adapter(adapter, cfg, params, mesh=mesh, rules=rules)
  return cfg, graphdef, params


def _to_host(x: jax.Array) -> np.ndarray:
  return np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))


def save_pretrained(cfg: ModelConfig, params, out_dir: str, *, base_config: dict | None = None,
                    dtype: str | None = None, max_shard_bytes: int = 2 << 30, lora: lora_lib.LoRAConfig | None = None,
                    merged: bool = False, base_model_name_or_path: str = "") -> None:
  """Writes config.json and safetensors that `transformers.AutoModelForCausalLM.from_pretrained` loads; or, for
  params with LoRA adapters, the PEFT adapter directory that `peft.PeftModel.from_pretrained` loads onto that base.

  The family follows the config: Qwen3-MoE with experts, Qwen3 with QK-norm, Qwen2 with q/k/v biases, else Llama.
  Params are gathered to the host one shard file (at most `max_shard_bytes`) at a time; every process must call this,
  process 0 writes.

  Args:
    cfg: the model's config.
    params: nested dict of arrays as returned by `from_pretrained` or `sharding.create_sharded`.
    out_dir: output directory (created).
    base_config: a config.json dict whose other fields (token ids, max_position_embeddings, ...) are kept.
    dtype: dtype written ("float32" or "bfloat16"; default: each param's own).
    max_shard_bytes: largest safetensors file before the checkpoint is split into shards.
    lora: the LoRAConfig of params that hold adapters (`lora.has_adapters`; required for them).
    merged: with adapters, write the full checkpoint of the merged weights (`lora.merged`) instead of the adapters.
    base_model_name_or_path: with adapters, the base model recorded in adapter_config.json.
  """
  if lora_lib.has_adapters(params):
    if lora is None:
      raise ValueError("params hold LoRA adapters: pass lora= (the LoRAConfig they were built with) to write them as "
                       "a PEFT adapter directory, or with merged=True as a full checkpoint.")
    if not merged:
      peft.save_adapter(cfg, lora, params, out_dir, base_model_name_or_path=base_model_name_or_path, dtype=dtype)
      return
    params = lora_lib.merged(params, lora)
  leaves = {_keys(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  tensors = layout.tensors(cfg)
  if set(leaves) != {t.path for t in tensors}:
    raise ValueError(f"params do not match the config: keys {sorted(set(leaves) ^ {t.path for t in tensors})[:4]} "
                     "differ; pass the config the params were built with.")
  out_dtype = np.dtype(dtype or cfg.param_dtype)

  def held(t):
    return leaves[t.path] if t.expert is None else leaves[t.path][t.expert]

  def fetch(t):
    return lambda: layout.to_hf(_to_host(held(t)), t.axes).astype(out_dtype)

  entries = [safetensors_io.Entry(t.name, math.prod(t.shape_of(leaves[t.path].shape)) * out_dtype.itemsize, fetch(t))
             for t in tensors]
  writer = jax.process_index() == 0
  safetensors_io.write(out_dir, entries, max_shard_bytes, writer)
  if writer:
    with open(os.path.join(out_dir, "config.json"), "w") as f:
      json.dump(hf_config.from_model_config(cfg, base_config, out_dtype.name), f, indent=2)
