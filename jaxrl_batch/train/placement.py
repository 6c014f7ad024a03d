"""Where a run's rollouts are generated and which collector produces them, chosen once from the config.

- `Collector`: generation and update take turns on the learner's devices (the default), with the trainer's layout,
  or (`rollout_mesh.layout='own'`, wrapped in a `ResharedCollector`) on a mesh of their own over them.
- `PartialCollector` (`rollout.partial`): the continuous engine's sequences carry over between steps (in either
  layout).
- `AsyncCollector` (`rl.max_staleness` = k >= 1): generation runs k steps ahead on a host thread, on the learner's
  devices (in the trainer's layout or, rollout_mesh.layout='own', one of its own), on devices of its own
  (`rollout_mesh.devices`) or in a process of its own (`rollout_mesh.process_cores`, a `RemoteGenerator`).
"""
import copy

import jax
import ml_collections

from jaxrl_batch.train.async_collector import AsyncCollector
from jaxrl_batch.train.collector import Collector
from jaxrl_batch.train.decode_layout import ResharedCollector
from jaxrl_batch.train.generator_process import RemoteGenerator
from jaxrl_batch.train.partial import PartialCollector
from jaxrl_batch.train.setup import Experiment


LAYOUTS = ("trainer", "own")


def generation_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` with the mesh generation runs on: `rollout_mesh`'s data/fsdp/tensor/expert (on devices of its own, or
  colocated with rollout_mesh.layout='own'), decoding in that mesh's own layout on all the devices it is given."""
  rollout_config = copy.deepcopy(config)
  rollout_config.mesh.update({k: config.rollout_mesh[k] for k in ("data", "fsdp", "tensor", "expert")})
  rollout_config.rollout_mesh.update(layout="trainer", devices=0)  # Its own devices are all it has.
  return rollout_config


def own_layout(config: ml_collections.ConfigDict) -> bool:
  """Whether colocated generation decodes in a layout of its own (rollout_mesh.layout='own'); checks the setting
  and what it combines with."""
  rollout = config.rollout_mesh
  if rollout.layout == "auto":
    raise ValueError("rollout_mesh.layout='auto' is chosen before a run or check is built: `launch.train` and "
                     "`launch.plan_batch` choose it (`predict.step_time.choose_layout`); elsewhere name 'trainer' or "
                     "'own' and rollout_mesh's sizes.")
  if rollout.layout not in LAYOUTS:
    raise ValueError(f"rollout_mesh.layout={rollout.layout!r}: choose 'trainer' (decode with the trainer's mesh and "
                     "layout), 'own' (decode on rollout_mesh's data/fsdp/tensor/expert over the learner's devices) or "
                     "'auto' (the fastest, chosen by launch.train).")
  if rollout.layout == "trainer":
    return False
  if rollout.devices or rollout.process_cores:
    raise ValueError("rollout_mesh.layout='own' decodes the colocated rollout in a layout of its own; generation "
                     "elsewhere (rollout_mesh.devices, rollout_mesh.process_cores) has a mesh of its own already. Set "
                     "rollout_mesh.layout='trainer'.")
  return True


def split_devices(config: ml_collections.ConfigDict, devices: list) -> tuple[list, list | None]:
  """(the learner's devices, the devices generation decodes on in a mesh of its own, or None when it decodes on the
  learner's mesh). `config.rollout_mesh.devices` = n > 0 gives the last n devices to generation, with the mesh shape
  of `rollout_mesh`'s data/fsdp/tensor/expert; rollout_mesh.layout='own' that mesh shape over all of them, shared
  with the learner."""
  rollout = config.rollout_mesh
  n = rollout.devices
  if own_layout(config):
    return devices, devices
  if rollout.process_cores:
    if n or config.rl.max_staleness < 1 or jax.process_count() > 1:
      raise ValueError(f"rollout_mesh.process_cores={rollout.process_cores!r} generates in a process of its own, "
                       "ahead of the learner: it needs rl.max_staleness >= 1, rollout_mesh.devices=0 and a "
                       "single-process run.")
    return devices, None
  if not n:
    return devices, None
  if config.rl.max_staleness < 1:
    raise ValueError(f"rollout_mesh.devices={n} generates on devices of its own, so generation must run ahead of "
                     "the learner: set rl.max_staleness >= 1, or rollout_mesh.devices=0 (colocated).")
  if not 0 < n < len(devices):
    raise ValueError(f"rollout_mesh.devices={n} of {len(devices)} devices: leave at least one to the learner.")
  return devices[:-n], devices[-n:]


def _split_devices(config: ml_collections.ConfigDict, devices: list) -> tuple[list, Experiment | None]:
  """(the learner's devices, the rollout's `Experiment` on its devices or None: `split_devices`)."""
  learner, generation = split_devices(config, devices)
  return learner, None if generation is None else Experiment.create(generation_config(config), devices=generation)


def build(config: ml_collections.ConfigDict, devices=None) -> tuple[Experiment, object]:
  """(the learner's `Experiment`, the run's collector): each has `collect(graphdef, params, step)` ->
  (`Rollouts`, `RolloutStats`); those that carry rollouts across steps also have `state_dict`/`load_state_dict`."""
  learner_devices, rollout_exp = _split_devices(config, list(devices or jax.devices()))
  exp = Experiment.create(config, devices=learner_devices)
  partial = config.rollout.partial
  staleness = exp.member.algo.max_staleness
  if partial and staleness:
    raise ValueError("rollout.partial with rl.max_staleness > 0: partial rollouts already let generation run "
                     "ahead (rollout.max_lookahead); use one of the two.")
  if not staleness:  # In a layout of its own, from the policy resharded each step.
    collector = (PartialCollector if partial else Collector)(rollout_exp or exp)
    return exp, ResharedCollector(collector, exp.mesh) if rollout_exp else collector
  cores = config.rollout_mesh.process_cores
  generator = RemoteGenerator(config, exp, cores) if cores else Collector(rollout_exp or exp)
  return exp, AsyncCollector(generator, staleness, exp.mesh)
