"""Colocated generation in a layout of its own (`rollout_mesh.layout='own'`).

Decode reads every weight a chip holds at every step, so the layout that trains a model well (fsdp: each chip a
slice of every weight, gathered at each use) decodes it badly: each decode step gathers the weights again. Here the
rollout runs on a mesh of `rollout_mesh`'s shape over the learner's own devices (e.g. the fsdp axis turned into
tensor parallelism, or into data parallelism with the weights whole on each chip), and the engines read a copy of
the policy in that mesh's layout (the parameters' sharding rules applied to it) and in the compute dtype, made once
per step by one program (`reshard`). The KV cache follows the engines' mesh. The rollouts come back to the
learner's mesh, batch-sharded, as those of generation on devices of its own do; the reshard's seconds are the row's
`reshard_s`.
"""
import dataclasses
import time

import jax

from jaxrl_batch.model import compute_copy
from jaxrl_batch.rl.rollouts import Rollouts
from jaxrl_batch.runtime import sharding
from jaxrl_batch.train.collector import Collector
from jaxrl_batch.train.partial import PartialCollector
from jaxrl_batch.train.setup import Experiment
from jaxrl_batch.train.step_row import RolloutStats


def reshard(params, dtype):
  """The engines' policy: the learner's `params` cast to the compute `dtype` (`model.compute_copy`), in the layout
  its program's outputs have (`resharder`)."""
  return compute_copy(params, dtype)


def resharder(rollout_exp: Experiment):
  """The one program that makes the engines' policy from the learner's: `reshard`, its outputs laid out as
  `rollout_exp`'s mesh lays out its parameters. Call it as `program(params, dtype=model_cfg.compute_dtype)`."""
  return jax.jit(reshard, static_argnames="dtype", out_shardings=rollout_exp.policy_shardings())


class ResharedCollector:
  """`Collector.collect` (or `PartialCollector.collect`, with its run state) on the collector's own mesh (same devices
  as the learner's, another shape), from the policy resharded into that mesh's layout."""

  def __init__(self, collector: Collector | PartialCollector, learner_mesh: jax.sharding.Mesh):
    self.collector, self.exp, self.learner_mesh = collector, collector.exp, learner_mesh
    self.reshard = resharder(self.exp)

  def collect(self, graphdef, params, step: int) -> tuple[Rollouts, RolloutStats]:
    """The step's rollouts (on the learner's mesh) and statistics, `reshard_s` the seconds of the reshard."""
    start = time.time()
    policy = jax.block_until_ready(self.reshard(params, dtype=self.exp.model_cfg.compute_dtype))
    reshard_s = time.time() - start
    rollouts, stats = self.collector.collect(graphdef, policy, step)
    layouts = jax.tree.map(lambda x: sharding.batch_sharding(self.learner_mesh, x.ndim), rollouts)
    return jax.device_put(rollouts, layouts), dataclasses.replace(stats, reshard_s=reshard_s)

  @property
  def carries_rollouts(self) -> bool:
    return self.collector.carries_rollouts

  def state_dict(self) -> dict:
    return self.collector.state_dict()

  def load_state_dict(self, state: dict) -> None:
    self.collector.load_state_dict(state)

  def close(self) -> None:
    """Lets the rollout experiment's reward threads end (the learner's close with the trainer)."""
    self.exp.scorer.close()
