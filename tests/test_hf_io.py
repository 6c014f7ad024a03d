"""Hugging Face checkpoint I/O without torch: exact round trips per family, sharded loads on 8 fake devices (an
MoE's experts over the expert axis),
bfloat16, config.json layouts, the errors for checkpoints we cannot load, and the `launch.convert` CLI."""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from jaxrl_batch import from_pretrained, save_pretrained  # noqa: E402
from jaxrl_batch.hf import export_hf  # noqa: E402
from jaxrl_batch.hf.config import to_model_config  # noqa: E402
from jaxrl_batch.model import ModelConfig, RopeScaling, Transformer, sequence_logits  # noqa: E402
from jaxrl_batch.model.rope import inverse_frequencies  # noqa: E402
from jaxrl_batch.runtime import sharding  # noqa: E402
from jaxrl_batch.runtime.checkpointing import Checkpointer  # noqa: E402
from tests.close import assert_close
from tests.helpers import assert_trees_equal  # noqa: E402

_BASE = dict(vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=96,
             norm_eps=1e-5)
CONFIGS = {
    "llama": ModelConfig(**_BASE, tie_embeddings=False, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
    "qwen2": ModelConfig(**_BASE, tie_embeddings=True, rope_theta=1e6, qkv_bias=True),
    "qwen3": ModelConfig(**{**_BASE, "head_dim": 32}, tie_embeddings=False, qk_norm=True),
    "qwen3_moe": ModelConfig(**{**_BASE, "num_layers": 3}, tie_embeddings=False, qk_norm=True, num_experts=8,
                             num_experts_per_tok=2, moe_d_ff=32, norm_topk_prob=False, mlp_only_layers=(1,)),
}


def _random_params(cfg: ModelConfig, seed: int):
  """Random params on one device (non-zero biases, norm scales not 1), made on the host: nothing to compile."""
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  _, abstract = sharding.abstract_sharded(lambda: Transformer(cfg, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: jax.device_put(rng.normal(0, 0.3, a.shape).astype(a.dtype), a.sharding), abstract)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """name -> (cfg, params, HF dir written by save_pretrained, split into several files)."""
  out = {}
  for i, (name, cfg) in enumerate(sorted(CONFIGS.items())):
    path = str(tmp_path_factory.mktemp(name))
    params = _random_params(cfg, seed=i)
    save_pretrained(cfg, params, path, max_shard_bytes=64 << 10)
    out[name] = cfg, params, path
  return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_then_load_is_exact(exported, name):
  cfg, params, path = exported[name]
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
  loaded_cfg, _, loaded = from_pretrained(path)
  assert loaded_cfg == cfg
  assert_trees_equal(params, loaded)
  assert sum(x.size for x in jax.tree.leaves(loaded)) == cfg.num_params()


def test_sharded_load_gives_same_params_and_logits(exported):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  cfg, params, path = exported["qwen3"]
  mesh = sharding.make_mesh(2, 2, 2)
  graphdef8, params8 = from_pretrained(path, mesh=mesh)[1:]
  wq = params8["blocks"][0]["attn"]["wq"]
  assert wq.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  assert wq.addressable_shards[0].data.shape == (32, 2, 32)  # (D/fsdp, N/tensor, H): each device read its block
  assert_trees_equal(params, params8)
  tokens = jax.random.randint(jax.random.key(0), (8, 12), 0, cfg.vocab_size)
  valid = jnp.arange(12)[None] >= jnp.array([0, 4] * 4)[:, None]
  logits = jax.jit(sequence_logits, static_argnums=0)
  with jax.set_mesh(mesh):
    logits8 = logits(graphdef8, params8, *jax.device_put((tokens, valid), sharding.batch_sharding(mesh)))
  assert_close(logits8, logits(graphdef8, params, tokens, valid), 5e-6)


def test_moe_load_sharded_over_experts_gives_same_params_and_logits(exported):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  cfg, params, path = exported["qwen3_moe"]
  mesh = sharding.make_mesh(1, 1, 2, expert=4)
  graphdef8, params8 = from_pretrained(path, mesh=mesh)[1:]
  w_gate = params8["blocks"][0]["mlp"]["w_gate"]
  assert w_gate.sharding.spec == jax.sharding.PartitionSpec("expert", "fsdp", "tensor")
  assert w_gate.addressable_shards[0].data.shape == (2, 64, 16)  # (E/expert, D, F/tensor): two experts' blocks
  assert_trees_equal(params, params8)
  tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.vocab_size)
  valid = jnp.arange(12)[None] >= jnp.array([0, 4] * 4)[:, None]
  logits = jax.jit(sequence_logits, static_argnums=0)
  with jax.set_mesh(mesh):
    logits8 = logits(graphdef8, params8, *jax.device_put((tokens, valid), sharding.batch_sharding(mesh)))
  assert_close(logits8, logits(graphdef8, params, tokens, valid), 5e-6)


def test_bfloat16_checkpoint(exported, tmp_path):
  cfg, params, _ = exported["qwen2"]
  save_pretrained(cfg, params, str(tmp_path), dtype="bfloat16")
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  as_bf16 = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), params)
  assert_trees_equal(as_bf16, from_pretrained(str(tmp_path), param_dtype="bfloat16")[2])
  assert_trees_equal(jax.tree.map(lambda x: x.astype(np.float32), as_bf16), from_pretrained(str(tmp_path))[2])


def test_llama3_rope_keeps_short_wavelengths_scales_long_ones_and_blends_between():
  base = inverse_frequencies(16, 1e4)
  scaled = inverse_frequencies(16, 1e4, RopeScaling("llama3", 8.0, 1.0, 4.0, 32))
  wavelength = 2 * math.pi / base
  short, long = wavelength < 32 / 4, wavelength > 32 / 1
  middle = ~short & ~long
  assert short.any() and long.any() and middle.any()
  assert_close(scaled[short], base[short], 1e-7)
  assert_close(scaled[long], base[long] / 8, 1e-6)
  assert np.all((scaled[middle] > base[middle] / 8) & (scaled[middle] < base[middle]))
  assert_close(inverse_frequencies(16, 1e4, RopeScaling("linear", 4.0)), base / 4, 1e-6)


def test_transformers_4_and_5_config_layouts_agree():
  common = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5)
  llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
  v4 = to_model_config(dict(common, rope_theta=5e5, rope_scaling=dict(rope_type="llama3", **llama3)))
  v5 = to_model_config(dict(common, rope_parameters=dict(rope_type="llama3", rope_theta=5e5, **llama3)))
  assert v4 == v5 == dataclasses.replace(CONFIGS["llama"], rope_theta=5e5)
  plain = to_model_config(dict(common, rope_parameters=dict(rope_type="default", rope_theta=1e6)))
  assert plain.rope_scaling is None and plain.rope_theta == 1e6 and plain.head_dim == 16


def _edited_copy(path, out, config_update=None, drop=None):
  shutil.copytree(path, out)
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({**config, **(config_update or {})}, f)
  if drop:
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
      file = os.path.join(out, json.load(f)["weight_map"][drop])
    tensors = safetensors_numpy.load_file(file)
    del tensors[drop]
    safetensors_numpy.save_file(tensors, file, metadata={"format": "pt"})
  return out


@pytest.mark.parametrize("update, drop, message", [
    (dict(architectures=["MistralForCausalLM"]), None, "MistralForCausalLM"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), None, "'yarn' is not supported"),
    (dict(use_sliding_window=True), None, "use_sliding_window"),
    (dict(intermediate_size=80), None, r"mlp.gate_proj.weight has shape \(96, 64\).*\(80, 64\)"),
    (dict(tie_word_embeddings=False), None, "lm_head.weight is missing"),
    (None, "model.layers.1.self_attn.k_proj.bias", "model.layers.1.self_attn.k_proj.bias is missing"),
    (dict(architectures=["LlamaForCausalLM"]), None, "unexpected tensor model.layers.0.self_attn.k_proj.bias"),
])
def test_unloadable_checkpoints_are_refused_by_name(exported, tmp_path, update, drop, message):
  with pytest.raises(ValueError, match=message):
    from_pretrained(_edited_copy(exported["qwen2"][2], str(tmp_path / "edited"), update, drop))


@pytest.mark.parametrize("keep", [4, 0.9])
def test_a_truncated_safetensors_file_is_named(exported, tmp_path, keep):
  out = shutil.copytree(exported["qwen2"][2], str(tmp_path / "cut"))
  file = os.path.join(out, "model-00002-of-" + sorted(os.listdir(out))[-2].split("-of-")[1])
  size = os.path.getsize(file)
  with open(file, "r+b") as f:
    f.truncate(keep if isinstance(keep, int) else int(size * keep))  # the header cut, or the last tensor's data
  with pytest.raises(ValueError, match=f"{file}.*(not a readable safetensors file|truncated)"):
    from_pretrained(out)


def test_exported_files_are_readable_by_all(exported):
  umask = os.umask(0)
  os.umask(umask)
  for name in os.listdir(exported["qwen2"][2]):
    assert os.stat(os.path.join(exported["qwen2"][2], name)).st_mode & 0o777 == 0o666 & ~umask, name


@pytest.mark.slow
def test_convert_cli_then_export_of_a_training_run(exported, tmp_path):
  cfg, params, path = exported["qwen2"]
  source = str(tmp_path / "source")
  shutil.copytree(path, source)
  (tmp_path / "source" / "tokenizer.json").write_text("{}")
  ours = str(tmp_path / "ours")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", "launch.convert", f"--hf_dir={source}", f"--out={ours}"],
                        capture_output=True, text=True, check=False, cwd=root)
  assert proc.returncode == 0, proc.stderr[-2000:]
  # The converted directory restores like a cached base policy (here sharded fsdp=8 by the CLI's default mesh).
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
  assert_trees_equal(params, Checkpointer(ours).restore(abstract)[0])
  export_hf(ours, str(tmp_path / "back"))
  assert (tmp_path / "back" / "tokenizer.json").read_text() == "{}"
  assert_trees_equal(params, from_pretrained(str(tmp_path / "back"))[2])
  # A training run's state holds an optimizer state next to the params: only the params are read.
  run = tmp_path / "run"
  ckpt = Checkpointer(str(run / "checkpoints"))
  ckpt.save(7, dict(params=params, opt_state=dict(mu=params)), dict(step=7))
  ckpt.close()
  (run / "config.json").write_text(json.dumps(dict(config=dict(model=dataclasses.asdict(cfg)))))
  export_hf(str(run / "checkpoints"), str(tmp_path / "run_hf"), model_config=str(run / "config.json"),
            params_key="params")
  assert_trees_equal(params, from_pretrained(str(tmp_path / "run_hf"))[2])
