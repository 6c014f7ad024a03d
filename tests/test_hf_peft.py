"""LoRA adapters as PEFT adapter directories, without torch: our adapters -> PEFT files -> ours is exact, the files
hold PEFT's names, shapes and layout (stated here by hand for a 2-layer model), the merged export computes what the
adapters do, and what we cannot represent is refused by name. Parity with peft itself is in test_hf_parity.py."""
import dataclasses
import json
import logging
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from jaxrl_batch import from_pretrained, save_pretrained  # noqa: E402
from jaxrl_batch.hf import export_hf, peft  # noqa: E402
from jaxrl_batch.model import ModelConfig, Transformer, sequence_logits  # noqa: E402
from jaxrl_batch.model import lora as lora_lib  # noqa: E402
from jaxrl_batch.runtime import sharding  # noqa: E402
from jaxrl_batch.runtime.checkpointing import Checkpointer  # noqa: E402
from tests.close import assert_close
from tests.helpers import assert_trees_equal  # noqa: E402

# D 64, N*H 128 (head_dim 32 != D / N, so q's and o's flattened axes differ from D), K*H 64, F 96.
CFG = ModelConfig(vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, d_ff=96,
                  norm_eps=1e-5, tie_embeddings=False, qk_norm=True)
MOE = ModelConfig(vocab_size=128, d_model=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=96,
                  norm_eps=1e-5, tie_embeddings=False, qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_d_ff=32,
                  mlp_only_layers=(1,))
LORA = lora_lib.LoRAConfig(rank=4, alpha=8.0)
PREFIX = "base_model.model.model.layers."
_jit_logits = jax.jit(sequence_logits, static_argnums=0)


def _random_params(cfg: ModelConfig, lora, seed: int):
  """(graphdef, params) of `cfg` with `lora`'s adapters, every leaf random (b non-zero, so adapters change logits)."""
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, abstract = sharding.abstract_sharded(lambda: Transformer(cfg, nnx.Rngs(0), lora=lora), mesh,
                                                 sharding.DEFAULT_RULES)
  rng = np.random.default_rng(seed)
  return graphdef, jax.tree.map(lambda a: jax.device_put(rng.normal(0, 0.3, a.shape).astype(a.dtype), a.sharding),
                                abstract)


def _logits(graphdef, params):
  tokens = np.random.default_rng(0).integers(0, 128, (2, 10))
  valid = np.arange(10)[None] >= np.array([0, 3])[:, None]
  return np.asarray(_jit_logits(graphdef, params, tokens, valid))[valid]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(graphdef, params with adapters, base dir, adapter dir) written by save_pretrained."""
  graphdef, params = _random_params(CFG, LORA, seed=0)
  root = tmp_path_factory.mktemp("peft")
  save_pretrained(CFG, lora_lib.split(params)[1], str(root / "base"))
  save_pretrained(CFG, params, str(root / "adapter"), lora=LORA, base_model_name_or_path="tiny/base")
  return graphdef, params, str(root / "base"), str(root / "adapter")


def test_round_trip_gives_the_same_adapters_and_logits(saved):
  graphdef, params, base, adapter = saved
  assert sorted(os.listdir(adapter)) == [peft.CONFIG_FILE, peft.WEIGHTS_FILE]
  cfg, loaded_graphdef, loaded = from_pretrained(base, adapter=adapter)
  assert cfg == CFG and peft.load_adapter(adapter, CFG, lora_lib.split(params)[1])[0] == LORA
  assert_trees_equal(params, loaded)
  np.testing.assert_array_equal(_logits(loaded_graphdef, loaded), _logits(graphdef, params))
  assert np.abs(_logits(graphdef, params) - _logits(graphdef, lora_lib.base_policy(params))).max() > 0.1
  # Without an adapter, from_pretrained is unchanged: the base alone, with no adapters in its graph.
  _, base_graphdef, base_params = from_pretrained(base)
  assert not lora_lib.has_adapters(base_params)
  np.testing.assert_array_equal(_logits(base_graphdef, base_params), _logits(graphdef, lora_lib.base_policy(params)))


def test_files_hold_peft_names_shapes_and_layout(saved):
  _, params, _, adapter = saved
  with open(os.path.join(adapter, peft.CONFIG_FILE)) as f:
    config = json.load(f)
  assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias", "use_rslora",
                                 "fan_in_fan_out", "base_model_name_or_path", "inference_mode")} == dict(
      peft_type="LORA", task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, bias="none", use_rslora=False,
      fan_in_fan_out=False, base_model_name_or_path="tiny/base", inference_mode=True)
  assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                              "v_proj"]
  # PEFT's lora_A is (r, in_features), lora_B (out_features, r), with HF's in/out features of each Linear.
  in_out = dict(q_proj=(64, 128), k_proj=(64, 64), v_proj=(64, 64), o_proj=(128, 64), gate_proj=(64, 96),
                up_proj=(64, 96), down_proj=(96, 64))
  want = {}
  for i in range(2):
    for module, (n_in, n_out) in in_out.items():
      name = f"{PREFIX}{i}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
      want[name + ".lora_A.weight"], want[name + ".lora_B.weight"] = (4, n_in), (n_out, 4)
  tensors = safetensors_numpy.load_file(os.path.join(adapter, peft.WEIGHTS_FILE))
  assert {k: v.shape for k, v in tensors.items()} == want
  assert {v.dtype for v in tensors.values()} == {np.dtype(np.float32)}
  # Heads flatten head-major, as in q_proj.weight: row n*H + h of q's lora_B is b[:, n, h]; column n*H + h of o's
  # lora_A is a[n, h, :].
  attn = params["blocks"][1]["attn"]
  q_b, o_a = np.asarray(attn["wq_lora"]["b"]), np.asarray(attn["wo_lora"]["a"])
  np.testing.assert_array_equal(tensors[f"{PREFIX}1.self_attn.q_proj.lora_B.weight"][2 * 32 + 5], q_b[:, 2, 5])
  np.testing.assert_array_equal(tensors[f"{PREFIX}1.self_attn.o_proj.lora_A.weight"][:, 3 * 32 + 7], o_a[3, 7])
  np.testing.assert_array_equal(tensors[f"{PREFIX}1.mlp.down_proj.lora_B.weight"],
                                np.asarray(params["blocks"][1]["mlp"]["w_down_lora"]["b"]).T)


def test_merged_export_is_peft_update_and_gives_the_adapter_models_logits(saved, tmp_path):
  graphdef, params, base, adapter = saved
  save_pretrained(CFG, params, str(tmp_path / "merged"), lora=LORA, merged=True)
  assert not os.path.exists(tmp_path / "merged" / peft.CONFIG_FILE)
  cfg, merged_graphdef, merged = from_pretrained(str(tmp_path / "merged"))
  assert not lora_lib.has_adapters(merged)
  assert_close(_logits(merged_graphdef, merged), _logits(graphdef, params), 1e-5)
  # PEFT's merge: W + (lora_alpha / r) lora_B @ lora_A, in the HF layout.
  tensors = safetensors_numpy.load_file(os.path.join(adapter, peft.WEIGHTS_FILE))
  before = safetensors_numpy.load_file(os.path.join(base, "model.safetensors"))
  after = safetensors_numpy.load_file(os.path.join(tmp_path / "merged", "model.safetensors"))
  for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj"):
    name = f"model.layers.0.{module}"
    delta = 2.0 * tensors[f"base_model.model.{name}.lora_B.weight"] @ tensors[f"base_model.model.{name}.lora_A.weight"]
    assert_close(after[name + ".weight"], before[name + ".weight"] + delta, 2e-6)


def test_sharded_load_gives_same_adapters_and_logits(saved):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  graphdef, params, base, adapter = saved
  mesh = sharding.make_mesh(2, 2, 2)
  _, graphdef8, params8 = from_pretrained(base, mesh=mesh, adapter=adapter)
  attn = params8["blocks"][0]["attn"]
  assert attn["wq_lora"]["a"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
  assert attn["wq_lora"]["b"].addressable_shards[0].data.shape == (4, 2, 32)  # (r, N/tensor, H): its block only
  assert attn["wo_lora"]["a"].addressable_shards[0].data.shape == (2, 32, 4)  # (N/tensor, H, r)
  assert_trees_equal(params, params8)
  tokens = np.random.default_rng(0).integers(0, 128, (8, 10))
  valid = np.ones((8, 10), bool)
  with jax.set_mesh(mesh):
    logits8 = _jit_logits(graphdef8, params8, *jax.device_put((tokens, valid), sharding.batch_sharding(mesh)))
  assert_close(logits8, _jit_logits(graphdef, params, tokens, valid), 1e-5)


def test_some_targets_and_moe_layers(tmp_path):
  """Only q and v adapted: only they are written and loaded. In an MoE model the MLP targets are the dense layers'
  only, and target_modules says so with a regex that PEFT matches against module names."""
  lora = lora_lib.LoRAConfig(rank=2, alpha=3.0, targets=("q", "v"))
  graphdef, params = _random_params(CFG, lora, seed=1)
  save_pretrained(CFG, params, str(tmp_path / "qv"), lora=lora)
  with open(tmp_path / "qv" / peft.CONFIG_FILE) as f:
    assert json.load(f)["target_modules"] == ["q_proj", "v_proj"]
  assert len(safetensors_numpy.load_file(str(tmp_path / "qv" / peft.WEIGHTS_FILE))) == 2 * 2 * 2
  loaded_lora, _, loaded = peft.load_adapter(str(tmp_path / "qv"), CFG, lora_lib.split(params)[1])
  assert loaded_lora == lora
  assert_trees_equal(params, loaded)

  moe_lora = lora_lib.LoRAConfig(rank=2, alpha=4.0, targets=("k", "gate", "down"))
  graphdef, params = _random_params(MOE, moe_lora, seed=2)
  save_pretrained(MOE, params, str(tmp_path / "moe"), lora=moe_lora)
  with open(tmp_path / "moe" / peft.CONFIG_FILE) as f:
    pattern = json.load(f)["target_modules"]
  matched = [name for name in ("model.layers.1.mlp.gate_proj", "model.layers.0.mlp.experts.3.gate_proj",
                               "model.layers.0.self_attn.k_proj", "model.layers.2.self_attn.q_proj",
                               "model.layers.1.mlp.down_proj", "model.layers.0.mlp.gate", "model.layers.1.mlp.up_proj")
             if re.fullmatch(pattern, name)]
  assert matched == ["model.layers.1.mlp.gate_proj", "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"]
  names = set(safetensors_numpy.load_file(str(tmp_path / "moe" / peft.WEIGHTS_FILE)))
  assert {n.rsplit(".", 2)[0] for n in names} == {f"{PREFIX}{i}.self_attn.k_proj" for i in range(3)} | {
      f"{PREFIX}1.mlp.gate_proj", f"{PREFIX}1.mlp.down_proj"}
  save_pretrained(MOE, lora_lib.split(params)[1], str(tmp_path / "moe_base"))
  _, loaded_graphdef, loaded = from_pretrained(str(tmp_path / "moe_base"), adapter=str(tmp_path / "moe"))
  assert_trees_equal(params, loaded)
  np.testing.assert_array_equal(_logits(loaded_graphdef, loaded), _logits(graphdef, params))


def test_expert_adapters_are_one_peft_pair_per_expert(tmp_path):
  """The target "experts": PEFT's per-expert names (transformers 4's Linears, which peft fuses for transformers 5),
  a regex that leaves the dense layer's MLP out, an exact round trip, and a merged export with the same logits."""
  lora = lora_lib.LoRAConfig(rank=2, alpha=4.0, targets=("q", "experts"))
  graphdef, params = _random_params(MOE, lora, seed=3)
  save_pretrained(MOE, params, str(tmp_path / "adapter"), lora=lora)
  tensors = safetensors_numpy.load_file(str(tmp_path / "adapter" / peft.WEIGHTS_FILE))
  want = {f"{PREFIX}{i}.self_attn.q_proj.lora_{x}.weight": (2, 64) if x == "A" else (64, 2)
          for i in range(3) for x in "AB"}
  for i in (0, 2):  # MoE layers: 4 experts of D 64, moe_d_ff 32
    for j in range(4):
      for module, (n_in, n_out) in dict(gate_proj=(64, 32), up_proj=(64, 32), down_proj=(32, 64)).items():
        want[f"{PREFIX}{i}.mlp.experts.{j}.{module}.lora_A.weight"] = (2, n_in)
        want[f"{PREFIX}{i}.mlp.experts.{j}.{module}.lora_B.weight"] = (n_out, 2)
  assert {k: v.shape for k, v in tensors.items()} == want
  down = params["blocks"][2]["mlp"]["w_down_lora"]  # a (E, F, r), b (E, r, D)
  np.testing.assert_array_equal(tensors[f"{PREFIX}2.mlp.experts.3.down_proj.lora_A.weight"], np.asarray(down["a"])[3].T)
  np.testing.assert_array_equal(tensors[f"{PREFIX}2.mlp.experts.3.down_proj.lora_B.weight"], np.asarray(down["b"])[3].T)
  with open(tmp_path / "adapter" / peft.CONFIG_FILE) as f:
    pattern = json.load(f)["target_modules"]
  names = ("model.layers.0.mlp.experts.3.gate_proj", "model.layers.2.mlp.experts.down_proj",  # (transformers 5's)
           "model.layers.1.mlp.up_proj", "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.gate",
           "model.layers.0.self_attn.k_proj")
  assert [n for n in names if re.fullmatch(pattern, n)] == list(names[:2]) + [names[3]]
  every = lora_lib.LoRAConfig(rank=2, targets=tuple(lora_lib.TARGETS))  # names alone say it: no regex
  assert peft.adapter_config(MOE, every)["target_modules"] == sorted(
      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

  save_pretrained(MOE, lora_lib.split(params)[1], str(tmp_path / "base"))
  _, loaded_graphdef, loaded = from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
  assert_trees_equal(params, loaded)
  np.testing.assert_array_equal(_logits(loaded_graphdef, loaded), _logits(graphdef, params))
  save_pretrained(MOE, params, str(tmp_path / "merged"), lora=lora, merged=True)
  assert_close(_logits(*from_pretrained(str(tmp_path / "merged"))[1:]), _logits(graphdef, params), 1e-5)

  def drop_one_expert(tensors):
    del tensors[f"{PREFIX}0.mlp.experts.1.up_proj.lora_B.weight"]
  with pytest.raises(ValueError, match="experts.1.up_proj.lora_B.weight is missing"):
    from_pretrained(str(tmp_path / "base"), adapter=_edited(str(tmp_path / "adapter"), str(tmp_path / "cut"),
                                                            edit_tensors=drop_one_expert))


def _edited(adapter, out, config_update=None, edit_tensors=None):
  shutil.copytree(adapter, out)
  with open(os.path.join(out, peft.CONFIG_FILE)) as f:
    config = json.load(f)
  with open(os.path.join(out, peft.CONFIG_FILE), "w") as f:
    json.dump({**config, **(config_update or {})}, f)
  if edit_tensors:
    path = os.path.join(out, peft.WEIGHTS_FILE)
    tensors = safetensors_numpy.load_file(path)
    edit_tensors(tensors)
    safetensors_numpy.save_file(tensors, path, metadata={"format": "pt"})
  return out


def _drop_layer_1_q(tensors):
  for name in [n for n in tensors if n.startswith(f"{PREFIX}1.self_attn.q_proj.")]:
    del tensors[name]


def _add_lm_head(tensors):
  tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 64), np.float32)


@pytest.mark.parametrize("update, edit, message", [
    (dict(use_dora=True), None, "use_dora=True: DoRA"),
    (dict(use_rslora=True), None, r"use_rslora=True.*lora_alpha \* sqrt\(r\)"),
    (dict(bias="all"), None, "bias='all': only bias=\"none\""),
    (dict(rank_pattern={"q_proj": 8}), None, r"rank_pattern gives modules \['q_proj'\] their own value"),
    (dict(alpha_pattern={"q_proj": 8}, lora_alpha=16), None, "alpha_pattern gives modules"),
    (dict(target_modules=["q_proj", "embed_tokens", "lm_head"]), None, r"target_modules \['embed_tokens', 'lm_head'\]"),
    (dict(layers_to_transform=[0]), None, "layers_to_transform=.*a subset of the layers"),
    (dict(modules_to_save=["lm_head"]), None, "modules_to_save"),
    (dict(peft_type="IA3"), None, "only LoRA adapters"),
    (dict(r=8), None, r"k_proj.lora_A.weight has shape \(4, 64\), but r=8 on this model implies \(8, 64\)"),
    (None, _drop_layer_1_q, "layers.1.self_attn.q_proj.lora_A.weight is missing.*not in every layer"),
    (None, _add_lm_head, "lm_head.lora_A.weight .* is not an adapter of ours"),
])
def test_what_we_cannot_represent_is_refused_by_name(saved, tmp_path, update, edit, message):
  _, _, base, adapter = saved
  with pytest.raises(ValueError, match=message):
    from_pretrained(base, adapter=_edited(adapter, str(tmp_path / "edited"), update, edit))


def test_dropout_loads_for_inference_with_a_warning(saved, tmp_path, caplog):
  _, params, base, adapter = saved
  with caplog.at_level(logging.WARNING):
    loaded = from_pretrained(base, adapter=_edited(adapter, str(tmp_path / "d"), dict(lora_dropout=0.05)))[2]
  assert "lora_dropout=0.05 is ignored" in caplog.text
  assert_trees_equal(params, loaded)


def test_bad_saves_write_nothing_and_bad_loads_say_what_to_pass(saved, tmp_path):
  _, params, base, adapter = saved
  with pytest.raises(ValueError, match="pass lora="):
    save_pretrained(CFG, params, str(tmp_path / "a"))
  with pytest.raises(ValueError, match="adapter .* has shape .* rank 8"):
    save_pretrained(CFG, params, str(tmp_path / "b"), lora=lora_lib.LoRAConfig(rank=8))
  with pytest.raises(ValueError, match="adapter leaves differ"):
    save_pretrained(CFG, params, str(tmp_path / "c"), lora=lora_lib.LoRAConfig(rank=4, targets=("q",)))
  assert not any(os.path.exists(tmp_path / d) for d in "abc")
  with pytest.raises(ValueError, match="already hold adapters"):
    peft.load_adapter(adapter, CFG, params)
  with pytest.raises(FileNotFoundError, match="no adapter_config.json: pass a PEFT adapter directory"):
    from_pretrained(base, adapter=base)


def test_export_of_a_lora_run_writes_the_adapter_or_the_merged_checkpoint(saved, tmp_path):
  graphdef, params, base, _ = saved
  run = tmp_path / "run"
  ckpt = Checkpointer(str(run / "checkpoints"))
  ckpt.save(3, dict(params=params, opt_state=dict(mu=lora_lib.split(params)[0])), dict(step=3))
  ckpt.close()
  (run / "config.json").write_text(json.dumps(dict(config=dict(model=dataclasses.asdict(CFG),
                                                               lora=dataclasses.asdict(LORA)))))
  for merged in (False, True):
    out = str(tmp_path / f"export_{merged}")
    export_hf(str(run / "checkpoints"), out, model_config=str(run / "config.json"), params_key="params", merged=merged)
    assert os.path.exists(os.path.join(out, "model.safetensors" if merged else peft.WEIGHTS_FILE))
    _, loaded_graphdef, loaded = from_pretrained(base if not merged else out, adapter=None if merged else out)
    assert_close(_logits(loaded_graphdef, loaded), _logits(graphdef, params), 1e-5)
