"""A Hugging Face model converted to our format on disk, and back.

Layout of a converted directory:
  0/                 orbax checkpoint (`checkpointing.Checkpointer`, step 0, state = params): the layout of the
                     cached SFT base policy, restorable with `Checkpointer(dir).restore(abstract_params)`.
  model_config.json  the ModelConfig (`ModelConfig.from_config(json.load(f))`).
  hf/                the source's config.json and tokenizer files, reused on export.
"""
import dataclasses
import json
import os
import shutil

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxrl_batch.hf.convert import from_pretrained, save_pretrained
from jaxrl_batch.model import ModelConfig, Transformer
from jaxrl_batch.model.lora import LoRAConfig
from jaxrl_batch.runtime import sharding
from jaxrl_batch.runtime.checkpointing import Checkpointer

MODEL_CONFIG = "model_config.json"
HF_DIR = "hf"
# Non-weight files of a Hugging Face directory carried through a conversion.
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
            "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")


def import_hf(hf_dir: str, out_dir: str, *, mesh=None, rules=None, dtype: str = "float32") -> ModelConfig:
  """Converts a Hugging Face checkpoint directory into a converted directory (see the module docstring)."""
  cfg, _, params = from_pretrained(hf_dir, mesh=mesh, rules=rules, dtype=dtype)
  ckpt = Checkpointer(out_dir, max_to_keep=1)
  ckpt.save(0, params, dict(source=os.path.abspath(hf_dir)))
  ckpt.close()
  if jax.process_index() == 0:
    with open(os.path.join(out_dir, MODEL_CONFIG), "w") as f:
      json.dump(dataclasses.asdict(cfg), f, indent=2)
    os.makedirs(os.path.join(out_dir, HF_DIR), exist_ok=True)
    for name in HF_FILES:
      if os.path.exists(os.path.join(hf_dir, name)):
        shutil.copy(os.path.join(hf_dir, name), os.path.join(out_dir, HF_DIR, name))
  return cfg


def read_model_config(path: str) -> ModelConfig:
  """ModelConfig from a `model_config.json`, or from a `launch.train` run's `config.json` (its `config.model`)."""
  with open(path) as f:
    data = json.load(f)
  return ModelConfig.from_config(data["config"]["model"] if "config" in data else data)


def read_lora_config(path: str) -> LoRAConfig | None:
  """The LoRAConfig of a `launch.train` run's `config.json` (its `config.lora`); None without adapters or for a
  `model_config.json`."""
  with open(path) as f:
    data = json.load(f)
  return LoRAConfig.from_config(data.get("config", {}).get("lora"))


def export_hf(ckpt_dir: str, out_dir: str, *, model_config: str | None = None, step: int | None = None,
              params_key: str | None = None, mesh=None, rules=None, dtype: str | None = None,
              max_shard_bytes: int = 2 << 30, merged: bool = False) -> ModelConfig:
  """Writes a Hugging Face directory from an orbax checkpoint of params; a run that trained LoRA adapters
  (`config.lora` in its config.json) is written as a PEFT adapter directory, or with `merged` as the full checkpoint
  of the merged weights.

  Args:
    ckpt_dir: a converted directory, a cached base policy, or a training run's `checkpoints/`.
    out_dir: the Hugging Face directory to write.
    model_config: JSON of the ModelConfig (default: ckpt_dir/model_config.json); see `read_model_config`.
    step: checkpoint step (default: latest).
    params_key: where params sit in the checkpointed state: None when the state is the params (converted
      directories, base policies), "params" for training runs (only that subtree is read).
    mesh, rules: where params are restored (default: the first device, `sharding.DEFAULT_RULES`).
    dtype: dtype written (default: the params' own).
    max_shard_bytes: largest safetensors file before splitting into shards.
    merged: with adapters, write the merged full checkpoint instead of the adapters.
  """
  cfg = read_model_config(model_config or os.path.join(ckpt_dir, MODEL_CONFIG))
  lora = read_lora_config(model_config or os.path.join(ckpt_dir, MODEL_CONFIG))
  mesh = mesh or sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  _, abstract = sharding.abstract_sharded(lambda: Transformer(cfg, nnx.Rngs(0), lora=lora), mesh,
                                          sharding.DEFAULT_RULES if rules is None else rules)
  if params_key is None:
    ckpt = Checkpointer(ckpt_dir)
    params, _ = ckpt.restore(abstract, step)
    ckpt.close()
  else:
    params = _restore_subtree(ckpt_dir, step, {params_key: abstract})[params_key]
  base = None
  base_path = os.path.join(ckpt_dir, HF_DIR, "config.json")
  if os.path.exists(base_path):
    with open(base_path) as f:
      base = json.load(f)
  save_pretrained(cfg, params, out_dir, base_config=base, dtype=dtype, max_shard_bytes=max_shard_bytes, lora=lora,
                  merged=merged, base_model_name_or_path=(base or {}).get("_name_or_path", ""))
  if jax.process_index() == 0:
    for name in HF_FILES:
      if name != "config.json" and os.path.exists(os.path.join(ckpt_dir, HF_DIR, name)):
        shutil.copy(os.path.join(ckpt_dir, HF_DIR, name), os.path.join(out_dir, name))
  return cfg


def _restore_subtree(ckpt_dir: str, step: int | None, target: dict) -> dict:
  """Only `target`'s keys of a `Checkpointer` state (e.g. params without the optimizer state)."""
  with ocp.CheckpointManager(os.path.abspath(ckpt_dir)) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {ckpt_dir}.")
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=True)
    return manager.restore(step, args=ocp.args.Composite(state=args))["state"]
