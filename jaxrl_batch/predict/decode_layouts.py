"""The decode layouts a member's rollout can take on its chips (`rollout_mesh.layout`), as configs to predict: the
trainer's layout, and each rollout mesh of its own over the same n chips that keeps the weights whole over data and
splits them over tensor and expert only (`train.decode_layout`): data n / (t e) x tensor t x expert e, with t
dividing the attention heads and e the experts (1 for a dense model). Fsdp is left out: it gathers the weights at
every decode step, which is what a layout of its own is for avoiding. A generator on chips of its own
(`rollout_mesh.devices`) takes each such mesh of its chips."""
import math

import ml_collections

from jaxrl_batch.model import ModelConfig

AXES = ("data", "fsdp", "tensor", "expert")
AUTO = "auto"  # rollout_mesh.layout: the fastest candidate, chosen before a run (`step_time.choose_layout`).


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def with_layout(config: ml_collections.ConfigDict, layout: str, **mesh) -> ml_collections.ConfigDict:
  """A copy of `config` decoding in `layout` ('trainer', or 'own' on the rollout mesh `mesh`: data, tensor, expert;
  fsdp 1)."""
  out = ml_collections.ConfigDict(config.to_dict())
  out.rollout_mesh.layout = layout
  if layout == "own":  # The mesh as `describe` gives it (fsdp included) or as the candidates name it.
    out.rollout_mesh.update({**dict(data=1, fsdp=1, tensor=1, expert=1), **mesh})
  return out


def _meshes(cfg: ModelConfig, chips: int):
  """Each data x tensor x expert mesh of `chips` (fsdp 1) whose tensor divides the heads and expert the experts."""
  for tensor in _divisors(chips):
    if cfg.num_heads % tensor:
      continue
    for expert in _divisors(chips // tensor):
      if expert == 1 or (cfg.num_experts and cfg.num_experts % expert == 0):
        yield dict(data=chips // (tensor * expert), fsdp=1, tensor=tensor, expert=expert)


def candidates(config: ml_collections.ConfigDict, num_devices: int) -> list[ml_collections.ConfigDict]:
  """The trainer's layout first, then each layout of its own on `num_devices` chips (module docstring), fewest
  weights split first; a mesh equal to the trainer's is the trainer's layout (no reshard), not repeated. Generating
  on chips of its own (rollout_mesh.devices = n): each such mesh of the n generator chips."""
  cfg = ModelConfig.from_config(config.model)
  if config.rollout_mesh.devices:
    return [with_mesh(config, mesh) for mesh in _meshes(cfg, config.rollout_mesh.devices)]
  trainer = {axis: int(config.mesh[axis]) for axis in AXES}
  known = math.prod(size for size in trainer.values() if size != -1)
  trainer = {axis: num_devices // known if size == -1 else size for axis, size in trainer.items()}
  return [with_layout(config, "trainer")] + [with_layout(config, "own", **mesh) for mesh in _meshes(cfg, num_devices)
                                             if mesh != trainer]


def with_mesh(config: ml_collections.ConfigDict, mesh: dict) -> ml_collections.ConfigDict:
  """A copy of `config` whose generator decodes on the rollout mesh `mesh`."""
  out = ml_collections.ConfigDict(config.to_dict())
  out.rollout_mesh.update(mesh)
  return out


def describe(config: ml_collections.ConfigDict) -> tuple[str, dict[str, int]]:
  """(the layout's name, the mesh it decodes on as configured: the trainer's, or rollout_mesh's (a layout or chips of
  its own))."""
  layout = config.rollout_mesh.layout
  mesh = config.rollout_mesh if layout == "own" or config.rollout_mesh.devices else config.mesh
  return layout, {axis: int(mesh[axis]) for axis in AXES}
