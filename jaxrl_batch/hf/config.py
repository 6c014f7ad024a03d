"""Hugging Face `config.json` <-> `ModelConfig` for the Llama, Qwen2, Qwen3 and Qwen3-MoE families.

Reads both the transformers 4 layout (top-level `rope_theta`, `rope_scaling`) and the transformers 5 one
(`rope_parameters` holding `rope_theta`, `num_local_experts`); writes the transformers 4 layout, which both
versions load.
"""
import dataclasses

from jaxrl_batch.model import ModelConfig, RopeScaling
from jaxrl_batch.model.rope import ROPE_TYPES

# Architecture -> (model_type, q/k/v bias, QK-norm).
FAMILIES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
}
MOE = "Qwen3MoeForCausalLM"
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def architecture(hf: dict) -> str:
  """The single supported architecture named by config.json."""
  archs = hf.get("architectures") or []
  if len(archs) != 1 or archs[0] not in FAMILIES:
    raise ValueError(f"config.json architectures={archs}: supported are {sorted(FAMILIES)}; other families need "
                     "their own entry in jaxrl_batch/hf/config.py and jaxrl_batch/hf/layout.py.")
  return archs[0]


def _field(hf: dict, key: str):
  if hf.get(key) is None:
    raise ValueError(f"config.json lacks {key!r}, which {architecture(hf)} needs; add it to config.json.")
  return hf[key]


def _refuse(hf: dict, arch: str, key: str, allowed, why: str) -> None:
  if hf.get(key, allowed) != allowed:
    raise ValueError(f"config.json {key}={hf[key]!r} is not supported for {arch} ({why}); only {allowed!r} is.")


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4).

  As in transformers, `rope_scaling` wins when both are present.
  """
  v5 = hf.get("rope_parameters") or {}
  params = hf.get("rope_scaling") or v5
  theta = float(params.get("rope_theta") or hf.get("rope_theta") or v5.get("rope_theta") or 10_000.0)
  rope_type = params.get("rope_type", params.get("type", "default"))
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise ValueError(f"config.json partial_rotary_factor={partial} is not supported; only full-width RoPE (1.0) is.")
  if rope_type == "default":
    return theta, None
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"config.json rope type {rope_type!r} is not supported; supported are 'default' and "
                     f"{ROPE_TYPES} (yarn, dynamic and longrope are not implemented).")

  def get(key):
    if params.get(key) is None:
      raise ValueError(f"config.json rope scaling of type {rope_type!r} lacks {key!r}; add it to config.json.")
    return params[key]

  if rope_type == "linear":
    return theta, RopeScaling("linear", float(get("factor")))
  context = params.get("original_max_position_embeddings") or _field(hf, "max_position_embeddings")
  return theta, RopeScaling("llama3", float(get("factor")), float(get("low_freq_factor")),
                            float(get("high_freq_factor")), int(context))


def to_model_config(hf: dict, dtype: str = "float32", param_dtype: str | None = None) -> ModelConfig:
  """ModelConfig of a Llama/Qwen2/Qwen3 config.json; features we do not implement are refused by name."""
  arch = architecture(hf)
  _, qkv_bias, qk_norm = FAMILIES[arch]
  _refuse(hf, arch, "hidden_act", "silu", "the MLP is SwiGLU")
  if arch != "Qwen2ForCausalLM":  # Qwen2's q/k/v biases are implied by the architecture
    _refuse(hf, arch, "attention_bias", False, "an o_proj bias is not implemented")
  _refuse(hf, arch, "mlp_bias", False, "MLP biases are not implemented")
  _refuse(hf, arch, "use_sliding_window", False, "sliding-window attention is not implemented")
  layer_types = set(hf.get("layer_types") or ["full_attention"])
  if layer_types != {"full_attention"}:
    raise ValueError(f"config.json layer_types={sorted(layer_types)} is not supported for {arch}; only "
                     "full_attention layers are implemented.")
  heads = _field(hf, "num_attention_heads")
  theta, scaling = _rope(hf)
  moe = _moe(hf) if arch == MOE else {}
  return ModelConfig(
      vocab_size=_field(hf, "vocab_size"),
      d_model=_field(hf, "hidden_size"),
      num_layers=_field(hf, "num_hidden_layers"),
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or _field(hf, "hidden_size") // heads,
      d_ff=_field(hf, "intermediate_size"),
      rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=dtype,
      param_dtype=param_dtype or dtype,
      qkv_bias=qkv_bias,
      qk_norm=qk_norm,
      rope_scaling=scaling,
      **moe)


def _moe(hf: dict) -> dict:
  """ModelConfig's mixture-of-experts fields of a Qwen3-MoE config.json."""
  experts = hf.get("num_experts") or hf.get("num_local_experts")
  if not experts:
    raise ValueError(f"config.json lacks 'num_experts' (or 'num_local_experts'), which {MOE} needs; add it.")
  return dict(num_experts=experts, num_experts_per_tok=_field(hf, "num_experts_per_tok"),
              moe_d_ff=_field(hf, "moe_intermediate_size"), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
              mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def from_model_config(cfg: ModelConfig, base: dict | None = None, torch_dtype: str | None = None) -> dict:
  """config.json for `cfg`: Qwen3-MoE if it has experts, else Qwen3 if it has QK-norm, Qwen2 if q/k/v biases,
  else Llama.

  Fields of `base` (e.g. the source checkpoint's config.json: token ids, max_position_embeddings) are kept unless
  `cfg` defines them.
  """
  if cfg.num_experts and (cfg.qkv_bias or not cfg.qk_norm):
    raise ValueError(f"{MOE}, the only mixture-of-experts family supported, has QK-norm and no q/k/v biases; "
                     "export needs qk_norm=True and qkv_bias=False.")
  arch = MOE if cfg.num_experts else next(
      (a for a, (_, bias, norm) in FAMILIES.items() if a != MOE and (bias, norm) == (cfg.qkv_bias, cfg.qk_norm)), None)
  if arch is None:
    raise ValueError("No supported Hugging Face family has both q/k/v biases and QK-norm; export needs "
                     "qkv_bias=False or qk_norm=False.")
  hf = {k: v for k, v in (base or {}).items() if k not in _ROPE_KEYS + ("dtype", "transformers_version")}
  hf.update(
      architectures=[arch],
      model_type=FAMILIES[arch][0],
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      intermediate_size=cfg.d_ff,
      hidden_act="silu",
      rms_norm_eps=cfg.norm_eps,
      rope_theta=cfg.rope_theta,
      rope_scaling=dataclasses.asdict(cfg.rope_scaling) if cfg.rope_scaling else None,
      tie_word_embeddings=cfg.tie_embeddings,
      torch_dtype=torch_dtype or cfg.param_dtype)
  if arch != "Qwen2ForCausalLM":
    hf["attention_bias"] = False
  if arch == "LlamaForCausalLM":
    hf["mlp_bias"] = False
  else:
    hf["use_sliding_window"] = False
  if arch == MOE:
    hf.pop("num_local_experts", None)
    hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
              moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.norm_topk_prob,
              decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))
  return hf
