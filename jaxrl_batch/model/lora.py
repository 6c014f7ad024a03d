"""Low-rank adapters (LoRA, Hu et al. 2021): W x + (alpha / r) B A x, with the base weight W frozen.

An adapter of a weight stored (in..., out...) is two parameters, `a` (in..., r) and `b` (r, out...), sharded like the
weight's in and out axes (the rank axis replicated); `b` starts at zero, so a policy with fresh adapters is its base.
Adapters live in the parameter tree under a `<weight>_lora` node beside the weight they adapt, so the tree says
which parameters train: `split` separates them, the update differentiates and the optimizer holds state for them
only, and `base_policy` (every `b` zero) is the frozen base the KL term compares with, with no second copy of the
weights.

The low-rank product is added to the base projection instead of merging the weights: a decode step then reads the
base weights once plus r (in + out) values per adapted weight (about 1% more bytes at rank 16 on Qwen2.5-0.5B), where a
merged policy would need a second copy of every adapted weight rewritten after each update.
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.model.linear import linear

# Target name -> (module attribute, weight attribute); the names are PEFT's short forms of Hugging Face's modules.
TARGETS = {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
           "gate": ("mlp", "w_gate"), "up": ("mlp", "w_up"), "down": ("mlp", "w_down"),
           "experts": ("mlp", "experts")}  # an MoE layer's w_gate, w_up, w_down: an adapter per expert (`moe.MoE`)
SUFFIX = "_lora"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """config.lora: rank r (0: no adapters, the whole policy trains), alpha (the update is scaled by alpha / r), the
  projections adapted (`TARGETS`' names) and dropout (only 0: RL's importance ratios compare the sampler's and the
  trainer's log-probs of the same policy, which dropout on the trainer's side would break)."""
  rank: int = 0
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
  dropout: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    if self.rank < 0:
      raise ValueError(f"lora.rank={self.rank} must be >= 0 (0 = no adapters: the whole policy trains).")
    unknown = sorted(set(self.targets) - set(TARGETS))
    if unknown or (self.rank and not self.targets):
      raise ValueError(f"lora.targets={list(self.targets)}: each must be one of {list(TARGETS)} and at least one "
                       "is needed.")
    if self.dropout:
      raise ValueError(f"lora.dropout={self.dropout}: only 0 is supported (the trainer's log-probs must be the "
                       "sampler's policy's for the importance ratios).")
    if self.rank and self.alpha <= 0:
      raise ValueError(f"lora.alpha={self.alpha} must be positive (the adapters' update is scaled by alpha / rank).")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def adapts(self, weight: str) -> bool:
    """Whether the weight attribute `weight` (e.g. "wq") of an attention or dense MLP module gets an adapter."""
    return bool(self.rank) and any(TARGETS[t][1] == weight for t in self.targets)

  @classmethod
  def from_config(cls, cfg) -> "LoRAConfig | None":
    """From config.lora (a ConfigDict/dict; absent in a model-only context: None); None when rank is 0."""
    if cfg is None:
      return None
    given = dict(cfg)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - fields)
    if unknown:
      raise ValueError(f"Unknown lora config keys {unknown}; valid keys are {sorted(fields)}.")
    out = cls(**given)
    return out if out.rank else None


def adapter_for(weight: nnx.Param, contract: int, cfg: LoRAConfig, rngs: nnx.Rngs) -> "Adapter":
  """The adapter of `weight` (stored (in..., out...) with `contract` in axes), named like its axes."""
  names, shape = weight.get_metadata()["out_sharding"], weight[...].shape
  return Adapter(shape[:contract], shape[contract:], names[:contract], names[contract:], cfg, rngs)


class Adapter(nnx.Module):
  """The low-rank update of one weight stored (in..., out...): x -> scale * (x A) B, A (in..., r), B (r, out...)."""

  def __init__(self, in_shape, out_shape, in_names, out_names, cfg: LoRAConfig, rngs: nnx.Rngs):
    fan_in = 1
    for d in in_shape:
      fan_in *= d
    self.scale = cfg.scale
    self.contract = len(in_shape)
    init_a = nnx.initializers.normal(stddev=fan_in**-0.5)
    # Adapters are float32 whatever the base's dtype: they are what trains.
    self.a = nnx.Param(init_a(rngs.params(), (*in_shape, cfg.rank), jnp.float32), out_sharding=(*in_names, None))
    self.b = nnx.Param(jnp.zeros((cfg.rank, *out_shape), jnp.float32), out_sharding=(None, *out_names))

  def __call__(self, x, dtype):
    """The update's contribution to the projection of x (its last `contract` axes), computed in `dtype`."""
    low = linear(x, self.a[...].astype(dtype), contract=self.contract)
    return linear(low, self.b[...].astype(dtype) * self.scale)


def is_adapter(path) -> bool:
  """Whether a leaf at tree path `path` (keys or jax path entries) belongs to an adapter."""
  return any(str(getattr(p, "key", p)).endswith(SUFFIX) for p in path)


def has_adapters(params) -> bool:
  return any(is_adapter(path) for path, _ in jax.tree_util.tree_leaves_with_path(params))


def split(params) -> tuple[dict, dict]:
  """(adapters, base): the nested dict `params` as two nested dicts, one holding the adapters' leaves and one the
  rest (empty nodes dropped). `merge(base, adapters)` inverts it."""
  def part(node, keep_adapter: bool, inside: bool = False):
    if not isinstance(node, dict):
      return node if inside == keep_adapter else None
    out = {}
    for key, child in node.items():
      sub = part(child, keep_adapter, inside or str(key).endswith(SUFFIX))
      if sub is not None and not (isinstance(sub, dict) and not sub):
        out[key] = sub
    return out
  return part(params, True), part(params, False)


def merge(base: dict, adapters: dict) -> dict:
  """The nested dict holding both trees' leaves (`split`'s inverse)."""
  out = dict(base)
  for key, child in adapters.items():
    out[key] = merge(out[key], child) if isinstance(child, dict) and key in out else child
  return out


def trainable(params):
  """What an update trains: the adapters when `params` holds any, else every parameter."""
  return split(params)[0] if has_adapters(params) else params


def with_trained(params, trained):
  """`params` with `trainable(params)` replaced by `trained`."""
  return merge(split(params)[1], trained) if has_adapters(params) else trained


def base_policy(params):
  """The policy without its adapters' updates (every `b` zero; the base weights are the same arrays, not copies):
  the frozen reference of the KL term."""
  def leaf(path, x):
    return jnp.zeros_like(x) if is_adapter(path) and getattr(path[-1], "key", None) == "b" else x
  return jax.tree_util.tree_map_with_path(leaf, params)


def merged(params, cfg: LoRAConfig):
  """The policy as plain weights: each adapted weight W + scale * A B (in W's dtype), the adapters dropped."""
  adapters, base = split(params)
  def fold(base_node, adapter_node):
    out = dict(base_node)
    for key, child in adapter_node.items():
      if str(key).endswith(SUFFIX):
        weight = key[:-len(SUFFIX)]
        w, a, b = out[weight], child["a"], child["b"]
        batched = a.ndim + b.ndim - 3 == w.ndim  # an expert stack's: a (E, in, r), b (E, r, out)
        delta = (jnp.einsum("eir,ero->eio", a, b) if batched else jnp.tensordot(a, b, axes=1)) * cfg.scale
        assert delta.shape == w.shape, (weight, delta.shape, w.shape)
        out[weight] = (w.astype(jnp.float32) + delta).astype(w.dtype)
      else:
        out[key] = fold(out[key], child)
    return out
  return fold(base, adapters)
