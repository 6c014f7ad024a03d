"""Parity with `transformers` for tiny random Llama (llama3 RoPE, untied head), Qwen2 (q/k/v bias, tied head),
Qwen3 (QK-norm, head_dim != hidden / heads) and Qwen3-MoE (normalised top-k with a dense layer among the sparse
ones; unnormalised top-k with decoder_sparse_step 2): logits with and without left padding, greedy generation, an
export that transformers loads back, and LoRA adapters both ways with `peft`. Checkpoint I/O without torch is in
test_hf_io.py, adapter files without torch in test_hf_peft.py."""
import copy
import json
import os

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from flax import nnx  # noqa: E402

from jaxrl_batch import from_pretrained, save_pretrained  # noqa: E402
from jaxrl_batch.hf import peft as hf_peft  # noqa: E402
from jaxrl_batch.model import Transformer, sequence_logits  # noqa: E402
from jaxrl_batch.model import lora as lora_lib  # noqa: E402
from jaxrl_batch.runtime import sharding  # noqa: E402
from jaxrl_batch.sampling import Strategy, generate  # noqa: E402
from tests.close import assert_close

V, PAD, EOS = 128, 0, 127
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, attn_implementation="eager")
MOE = dict(COMMON, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           tie_word_embeddings=False)
FAMILIES = {
    # theta 1e4 with head_dim 16 puts wavelengths on both sides of and between the llama3 thresholds (32/4, 32).
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=False, rope_theta=10_000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32)),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, tie_word_embeddings=False, head_dim=32),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**MOE, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3_moe_unnormed": lambda: transformers.Qwen3MoeConfig(**MOE, norm_topk_prob=False, decoder_sparse_step=2),
}
EXPECTED = {"llama": (False, False, False, ()), "qwen2": (True, False, True, ()), "qwen3": (False, True, False, ()),
            "qwen3_moe": (False, True, False, (0, 2)), "qwen3_moe_unnormed": (False, True, False, (1,))}
_jit_logits = jax.jit(sequence_logits, static_argnums=0)


def _randomize(model: "torch.nn.Module", seed: int) -> None:
  """Random weights, norm scales around 1 and non-zero biases, so no parameter is trivially 0 or 1."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.5 * noise)
      else:
        p.copy_(noise * p.shape[-1] ** -0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """name -> (HF model, (cfg, graphdef, params) loaded from its save_pretrained directory); built once per family."""
  built = {}

  def get(name):
    if name not in built:
      model = transformers.AutoModelForCausalLM.from_config(FAMILIES[name]()).eval()
      _randomize(model, seed=sorted(FAMILIES).index(name))
      path = str(tmp_path_factory.mktemp(name))
      model.save_pretrained(path)
      built[name] = model, from_pretrained(path)
    return built[name]

  return get


def _batch(b, t, pad, seed=0):
  """Random tokens (never PAD/EOS), row 1 left-padded by `pad`."""
  tokens = np.random.default_rng(seed).integers(1, V - 1, (b, t))
  valid = np.ones((b, t), bool)
  valid[1, :pad] = False
  return np.where(valid, tokens, PAD), valid


def _hf_logits(model, tokens, valid):
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(np.int64)),
                position_ids=torch.tensor(positions))
  return out.logits.float().numpy()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers_with_and_without_left_padding(checkpoint, name):
  model, (cfg, graphdef, params) = checkpoint(name)
  assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_embeddings, cfg.moe_layers) == EXPECTED[name]
  tokens, valid = _batch(2, 12, pad=4)
  ours = np.asarray(_jit_logits(graphdef, params, tokens, valid))
  want = _hf_logits(model, tokens, valid)
  assert_close(ours[valid], want[valid], 2e-5)
  # Left padding changes nothing: row 1's real tokens alone give the same logits.
  alone = _hf_logits(model, tokens[1:, 4:], valid[1:, 4:])
  assert_close(ours[1, 4:], alone[0], 2e-5)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.slow
def test_greedy_generation_matches_transformers(checkpoint, name):
  model, (_, graphdef, params) = checkpoint(name)
  prompt, valid = _batch(2, 6, pad=2, seed=1)
  n = 8
  ours = generate(graphdef, params, prompt, valid, jax.random.key(0), max_new_tokens=n, eos_id=EOS, pad_id=PAD,
                  sampling=Strategy(temperature=0.0))
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(prompt), attention_mask=torch.tensor(valid.astype(np.int64)),
                         max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
  hf_new = out[:, prompt.shape[1]:].numpy()
  got = np.asarray(ours.tokens_BxN)
  np.testing.assert_array_equal(got[:, : hf_new.shape[1]], hf_new)
  assert (got[:, hf_new.shape[1]:] == PAD).all()  # transformers stops once every row hit EOS


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_export_round_trip_loads_in_transformers(checkpoint, name, tmp_path):
  model, (cfg, _, params) = checkpoint(name)
  out = str(tmp_path / "export")
  save_pretrained(cfg, params, out, max_shard_bytes=64 << 10)  # small shards: exercises the index file
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["architectures"] == [type(model).__name__]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    exported_names = set(json.load(f)["weight_map"])
  model.save_pretrained(tmp_path / "hf")  # the names transformers writes (MoE experts one by one; no tied lm_head)
  with safetensors.safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
    assert exported_names == set(f.keys())
  tokens, valid = _batch(2, 12, pad=4)
  assert_close(_hf_logits(reloaded, tokens, valid)[valid], _hf_logits(model, tokens, valid)[valid], 5e-6)


PEFT_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
ATTENTION, MLP = ("q", "k", "v", "o"), ("gate", "up", "down")
# peft 0.21 on transformers 5 loads per-expert adapters (our target "experts") by fusing them onto the fused expert
# parameters; but it maps every gate/up/down_proj target of a Qwen3-MoE model onto those experts (a dense layer's MLP
# then gets none), and it saves expert adapters fused (`target_parameters`, which we refuse). So the MoE family's
# adapters are attention + experts from ours, attention only from peft.
OURS_TARGETS = {name: ATTENTION + (("experts",) if name == "qwen3_moe" else MLP) for name in PEFT_FAMILIES}
PEFT_TARGETS = {name: ATTENTION if name == "qwen3_moe" else ATTENTION + MLP for name in PEFT_FAMILIES}


@pytest.mark.parametrize("name", PEFT_FAMILIES)
def test_our_adapter_loads_in_peft_with_our_logits(checkpoint, name, tmp_path):
  """Random adapters (b non-zero), saved by save_pretrained, loaded by PeftModel.from_pretrained onto the
  transformers model of the same base (an MoE model's: one adapter per expert, which peft fuses as it loads)."""
  peft = pytest.importorskip("peft")
  model, (cfg, base_graphdef, params) = checkpoint(name)
  lora = lora_lib.LoRAConfig(rank=4, alpha=8.0, targets=OURS_TARGETS[name])
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, abstract = sharding.abstract_sharded(lambda: Transformer(cfg, nnx.Rngs(0), lora=lora), mesh,
                                                 sharding.DEFAULT_RULES)
  rng = np.random.default_rng(0)
  adapters = jax.tree.map(lambda a: jax.device_put(rng.normal(0, 0.3, a.shape).astype(np.float32), a.sharding),
                          lora_lib.split(abstract)[0])
  ours = lora_lib.merge(params, adapters)
  save_pretrained(cfg, ours, str(tmp_path / "adapter"), lora=lora)
  theirs = peft.PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path / "adapter")).eval()
  tokens, valid = _batch(2, 12, pad=4)
  got = np.asarray(_jit_logits(graphdef, ours, tokens, valid))[valid]
  base = np.asarray(_jit_logits(base_graphdef, params, tokens, valid))[valid]
  assert np.abs(got - base).max() > 0.1  # the adapters matter
  assert_close(got, _hf_logits(theirs, tokens, valid)[valid], 5e-5)


@pytest.mark.parametrize("name", PEFT_FAMILIES)
def test_peft_adapter_loads_in_ours_with_peft_logits(checkpoint, name, tmp_path):
  """An adapter peft made (random A and B), saved by peft, loaded onto our base params."""
  peft = pytest.importorskip("peft")
  model, (cfg, _, params) = checkpoint(name)
  targets = [hf_peft.HF_MODULES[t].split(".")[1] for t in PEFT_TARGETS[name]]
  config = peft.LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, task_type="CAUSAL_LM", target_modules=targets)
  theirs = peft.get_peft_model(copy.deepcopy(model), config).eval()
  gen = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for module, p in theirs.named_parameters():
      if "lora_" in module:
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
  theirs.save_pretrained(str(tmp_path / "adapter"))
  lora, graphdef, ours = hf_peft.load_adapter(str(tmp_path / "adapter"), cfg, params)
  assert lora == lora_lib.LoRAConfig(rank=4, alpha=12.0, targets=PEFT_TARGETS[name])
  tokens, valid = _batch(2, 12, pad=4)
  got = np.asarray(_jit_logits(graphdef, ours, tokens, valid))[valid]
  assert np.abs(got - _hf_logits(model, tokens, valid)[valid]).max() > 0.1  # the adapter matters
  assert_close(got, _hf_logits(theirs, tokens, valid)[valid], 5e-5)


def test_peft_adapter_on_moe_experts_is_refused(checkpoint, tmp_path):
  peft = pytest.importorskip("peft")
  model, (cfg, _, params) = checkpoint("qwen3_moe")
  config = peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=["q_proj", "gate_proj", "up_proj"])
  peft.get_peft_model(copy.deepcopy(model), config).save_pretrained(str(tmp_path / "adapter"))
  with pytest.raises(ValueError, match="target_parameters=.*cannot be represented"):
    hf_peft.load_adapter(str(tmp_path / "adapter"), cfg, params)
