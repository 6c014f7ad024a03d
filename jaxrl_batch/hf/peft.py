"""PEFT LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors`) in and out.

PEFT adapts a Hugging Face Linear `<m>` (weight (out, in)) with `base_model.model.<m>.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r) and adds (lora_alpha / r) B A x; ours adapts a weight stored (in..., out...) with `a`
(in..., r) and `b` (r, out...) scaled by alpha / rank (`model.lora`). So lora_A is our `a` laid out like the weight's
in axes, lora_B our `b` laid out like its out axes, each flattened the way `layout` flattens the weight itself: wq
(D, N, H) is q_proj.weight (N*H, D), its `b` (r, N, H) is q_proj.lora_B.weight (N*H, r). An expert stack's adapter
(a (E, in, r), b (E, r, out)) is one such pair per expert, `mlp.experts.{j}.gate_proj.lora_A.weight` and so on.

What we cannot represent (other modules, per-module ranks, DoRA, rsLoRA, biases, a subset of layers, ...) is
refused when loading, naming the field and what to do.
"""
import json
import logging
import os
import re

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_batch.hf import layout
from jaxrl_batch.model import ModelConfig, Transformer
from jaxrl_batch.model import lora as lora_lib
from jaxrl_batch.runtime import sharding

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# Our target names (`lora.TARGETS`) -> the Hugging Face module each adapts, under model.layers.{i}.
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_MODULE_NAMES = sorted(m.split(".")[1] for m in HF_MODULES.values())
_MLP = ("gate_proj", "up_proj", "down_proj")
# The target "experts": each expert's gate/up/down_proj of an MoE layer, one adapter per expert, as PEFT names them
# on transformers 4's per-expert Linears (peft converts them for transformers 5's fused experts as it loads).
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.lora_A\.weight$")
# adapter_config.json fields whose non-default values change what an adapter computes in ways we cannot represent.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA) adapters",
    "use_rslora": "rank-stabilised scaling (alpha / sqrt(r)); the same adapter with use_rslora=false and "
                  "lora_alpha = lora_alpha * sqrt(r) is equivalent and loads",
    "fan_in_fan_out": "Conv1D-layout (GPT-2) weights",
    "lora_bias": "biases on lora_B",
    "layers_to_transform": "adapters on a subset of the layers",
    "layer_replication": "replicated layers",
    "modules_to_save": "fully trained copies of modules (e.g. lm_head) saved beside the adapters",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "adapters on parameters (e.g. fused MoE experts) rather than Linear modules",
    "alora_invocation_tokens": "activated LoRA (adapters switched on by invocation tokens)",
    "use_qalora": "quantisation-aware LoRA",
    "megatron_config": "Megatron parallel layers",
}


def adapter_tensors(cfg: ModelConfig, abstract) -> list[layout.Tensor]:
  """The PEFT tensors of each adapter leaf of `abstract` (a params tree with adapters), with the axes that lay them
  out as PEFT stores them: one tensor per leaf, or for an expert stack's adapter one per expert (`Tensor.expert`)."""
  weights = {}
  for t in layout.tensors(cfg):
    weights.setdefault(t.path, []).append(t)
  out = []
  for path, _ in jax.tree_util.tree_flatten_with_path(lora_lib.split(abstract)[0])[0]:
    keys = tuple(k.key for k in path)
    node, leaf = keys[-2], keys[-1]
    for weight in weights[keys[:-2] + (node.removesuffix(lora_lib.SUFFIX),)]:
      out_group, in_group = weight.axes
      contract = len(in_group)
      assert min(out_group) >= contract > max(in_group), weight  # a Linear's [out, in]
      module = _PREFIX + weight.name.removesuffix("weight")
      if leaf == "a":  # (in..., r) -> [r, in]
        axes, name = ((contract,), in_group), module + "lora_A.weight"
      else:  # (r, out...) -> [out, r]
        axes, name = (tuple(1 + a - contract for a in out_group), (0,)), module + "lora_B.weight"
      out.append(layout.Tensor(name, keys, axes, weight.expert))
  return out


def _abstract(cfg: ModelConfig, lora: lora_lib.LoRAConfig, mesh, rules):
  mesh = mesh or sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  return sharding.abstract_sharded(lambda: Transformer(cfg, nnx.Rngs(0), lora=lora), mesh,
                                   sharding.DEFAULT_RULES if rules is None else rules)


def adapter_config(cfg: ModelConfig, lora: lora_lib.LoRAConfig, base_model_name_or_path: str = "") -> dict:
  """The adapter_config.json of `lora` on a model of `cfg`, as PEFT writes it for a LoRA of a causal LM.

  target_modules lists module names, as PEFT matches them against the end of each module's name. A name such as
  "gate_proj" matches the dense MLPs' and the experts' alike, so where the two differ (an MoE model with dense
  layers, or experts adapted and dense MLPs not) a regex names each instead.
  """
  names = [HF_MODULES[t].split(".")[1] for t in lora.targets if t in HF_MODULES]
  attn = sorted(n for n in names if n not in _MLP)
  has_dense = len(cfg.moe_layers) < cfg.num_layers
  dense = sorted(n for n in names if n in _MLP) if has_dense else []
  experts = list(_MLP) if cfg.moe_layers and "experts" in lora.targets else []
  mlp = set(dense) | set(experts)
  targets = sorted(set(attn) | mlp)
  if (has_dense and set(dense) != mlp) or (cfg.moe_layers and set(experts) != mlp):
    parts = [rf"{where}({'|'.join(group)})" for where, group in (
        (r"self_attn\.", attn), (r"mlp\.", dense), (r"mlp\.experts\.(\d+\.)?", experts)) if group]
    targets = rf".*\.layers\.\d+\.({'|'.join(parts)})"
  alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
  return dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path or None,
              r=lora.rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none",
              fan_in_fan_out=False, use_rslora=False, use_dora=False, init_lora_weights=True, inference_mode=True,
              rank_pattern={}, alpha_pattern={}, layers_to_transform=None, layers_pattern=None,
              modules_to_save=None)


def _to_host(x: jax.Array) -> np.ndarray:
  return np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))


def save_adapter(cfg: ModelConfig, lora: lora_lib.LoRAConfig, params, out_dir: str, *,
                 base_model_name_or_path: str = "", dtype: str | None = None) -> None:
  """Writes `params`' adapters as a PEFT adapter directory that `peft.PeftModel.from_pretrained` loads onto the
  transformers model of the base (`save_pretrained` of the params without adapters).

  Every process must call this (sharded adapters are gathered); process 0 writes. Nothing is written unless the
  adapters match `cfg` and `lora`; each file appears whole (written beside, then renamed).

  Args:
    dtype: dtype written (default: the adapters' own, float32).
  """
  adapters = lora_lib.split(params)[0]
  _, abstract = _abstract(cfg, lora, None, None)
  tensors = adapter_tensors(cfg, abstract)
  leaves = {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(adapters)[0]}
  expected = {t.path for t in tensors}
  if set(leaves) != expected:
    differ = sorted(set(leaves) ^ expected, key=str)
    raise ValueError(f"params' adapters do not match {lora} on this model: {len(differ)} adapter leaves differ, e.g. "
                     f"{'/'.join(map(str, differ[0]))}; pass the LoRAConfig (rank, targets) the params were built "
                     "with.")
  shapes = {tuple(k.key for k in p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  wrong = [t.path for t in tensors if leaves[t.path].shape != shapes[t.path]]
  if wrong:
    raise ValueError(f"adapter {'/'.join(map(str, wrong[0]))} has shape {leaves[wrong[0]].shape}, but rank "
                     f"{lora.rank} on this model implies {shapes[wrong[0]]}; pass the LoRAConfig the params were "
                     "built with.")
  out_dtype = np.dtype(dtype or np.float32)
  host = {path: _to_host(x) for path, x in leaves.items()}
  weights = {t.name: np.ascontiguousarray(layout.to_hf(host[t.path] if t.expert is None else host[t.path][t.expert],
                                                       t.axes).astype(out_dtype))
             for t in tensors}
  config = adapter_config(cfg, lora, base_model_name_or_path)
  if jax.process_index() != 0:
    return
  os.makedirs(out_dir, exist_ok=True)
  weights_path, config_path = os.path.join(out_dir, WEIGHTS_FILE), os.path.join(out_dir, CONFIG_FILE)
  save_file(weights, weights_path + ".partial", metadata={"format": "pt"})
  with open(config_path + ".partial", "w") as f:
    json.dump(config, f, indent=2)
  os.chmod(weights_path + ".partial", os.stat(config_path + ".partial").st_mode)  # safetensors writes 0600
  os.replace(weights_path + ".partial", weights_path)
  os.replace(config_path + ".partial", config_path)


def _read_config(adapter_dir: str) -> tuple[int, float]:
  """(rank, alpha) of a PEFT adapter directory (its targets are read from the weights, see `load_adapter`), refusing
  what an adapter of ours cannot represent."""
  path = os.path.join(adapter_dir, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{adapter_dir} has no {CONFIG_FILE}: pass a PEFT adapter directory (what "
                            "PeftModel.save_pretrained or our save_pretrained of params with adapters writes).")
  with open(path) as f:
    config = json.load(f)
  if config.get("peft_type") != "LORA":
    raise ValueError(f"{path}: peft_type={config.get('peft_type')!r}; only LoRA adapters (peft_type \"LORA\") load.")
  for field, what in _UNSUPPORTED.items():
    if config.get(field) not in (None, False, [], {}):
      raise ValueError(f"{path}: {field}={config[field]!r}: {what} cannot be represented by our adapters; retrain "
                       f"or re-save the adapter without {field}.")
  if config.get("bias", "none") != "none":
    raise ValueError(f"{path}: bias={config['bias']!r}: only bias=\"none\" loads (we train no biases); re-save the "
                     "adapter with bias=\"none\".")
  rank, alpha = config["r"], float(config["lora_alpha"])
  for field, value in (("rank_pattern", rank), ("alpha_pattern", alpha)):
    differ = {k: v for k, v in (config.get(field) or {}).items() if v != value}
    if differ:
      raise ValueError(f"{path}: {field} gives modules {sorted(differ)[:3]} their own value ({differ}); our adapters "
                       f"share one rank and alpha (r={rank}, lora_alpha={alpha}): retrain with one value.")
  if config.get("lora_dropout"):
    logging.warning("%s: lora_dropout=%s is ignored: loaded adapters compute without dropout, and training with "
                    "them uses none (lora.dropout must be 0).", path, config["lora_dropout"])
  modules = config.get("target_modules")
  if isinstance(modules, list):
    unknown = sorted({m.rsplit(".", 1)[-1] for m in modules} - set(_MODULE_NAMES))
    if unknown:
      raise ValueError(f"{path}: target_modules {unknown} cannot be adapted here: our adapters cover {_MODULE_NAMES} "
                       "only (not embed_tokens or lm_head); retrain the adapter without them.")
  return rank, alpha


def load_adapter(adapter_dir: str, cfg: ModelConfig, base_params, *, mesh: jax.sharding.Mesh | None = None,
                 rules=None):
  """Reads a PEFT LoRA adapter directory (ours or one peft wrote) onto the base params of a model of `cfg`.

  The adapted projections are those the weights file holds; it must adapt them in every layer (the MLP ones: in every
  dense layer; the experts, in PEFT's per-expert names: each expert's gate, up and down_proj of every MoE layer) and
  nothing else. Each adapter is sharded by `rules` over `mesh` as it loads (default: the
  first device), float32 whatever the file's dtype.

  Returns:
    (LoRAConfig, graphdef of the model with adapters, params: `base_params` with the adapters).
  """
  rank, alpha = _read_config(adapter_dir)
  path = os.path.join(adapter_dir, WEIGHTS_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{adapter_dir} has no {WEIGHTS_FILE} (an adapter_model.bin of older peft: load it with "
                            "peft and save it again, which writes safetensors).")
  if lora_lib.has_adapters(base_params):
    raise ValueError("base_params already hold adapters; pass the base alone (lora.split(params)[1]).")
  with safe_open(path, framework="np") as reader:
    names = set(reader.keys())
    found = {t for t, m in HF_MODULES.items() if any(n.endswith(f".{m}.lora_A.weight") for n in names)}
    found |= {"experts"} if any(_EXPERT.search(n) for n in names) else set()
    if not found:
      raise ValueError(f"{path} holds no adapter of {_MODULE_NAMES}; its tensors include {sorted(names)[:3]}.")
    lora = lora_lib.LoRAConfig(rank=rank, alpha=alpha, targets=tuple(t for t in lora_lib.TARGETS if t in found))
    graphdef, abstract = _abstract(cfg, lora, mesh, rules)
    _check_base(abstract, base_params)
    tensors = adapter_tensors(cfg, abstract)
    _check_tensors(path, reader, tensors, abstract, lora)

    read = lambda name, index: reader.get_slice(name)[index]
    by_path = {}
    for t in tensors:
      by_path.setdefault(t.path, []).append(t)
    specs = {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    adapters = {}
    for path, parts in by_path.items():
      node = adapters
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = layout.load_param(read, parts, specs[path])
  return lora, graphdef, lora_lib.merge(base_params, adapters)


def _check_base(abstract, base_params) -> None:
  want = {tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(lora_lib.split(abstract)[1])[0]}
  got = {tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(base_params)[0]}
  if want != got:
    raise ValueError(f"base_params do not match the config: keys {sorted(want ^ got, key=str)[:3]} differ; pass the "
                     "params from_pretrained returned for this config.")


def _check_tensors(path: str, reader, tensors: list[layout.Tensor], abstract, lora: lora_lib.LoRAConfig) -> None:
  """Every adapter of the targets found, in every layer, with PEFT's shapes; no other tensor."""
  names = set(reader.keys())
  expected = {t.name for t in tensors}
  extra = sorted(names - expected)
  if extra:
    raise ValueError(f"{path}: tensor {extra[0]} ({len(extra)} unexpected in all) is not an adapter of ours: we adapt "
                     f"{sorted(HF_MODULES.values())} of each layer and each expert's {list(_MLP)} (the router, "
                     "embed_tokens and lm_head get none); retrain the adapter without it.")
  missing = sorted(expected - names)
  if missing:
    raise ValueError(f"{path}: tensor {missing[0]} is missing ({len(missing)} in all): the adapter targets "
                     f"{list(lora.targets)} but not in every layer (experts: not every expert's gate, up and "
                     "down_proj); adapters on a subset cannot be represented: retrain it on every layer.")
  shapes = {tuple(k.key for k in p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  for t in tensors:
    want = layout.hf_shape(t.shape_of(shapes[t.path]), t.axes)
    got = tuple(reader.get_slice(t.name).get_shape())
    if got != want:
      raise ValueError(f"{path}: tensor {t.name} has shape {got}, but r={lora.rank} on this model implies {want}; "
                       "the adapter was trained on another base model or adapter_config.json's r is wrong.")
