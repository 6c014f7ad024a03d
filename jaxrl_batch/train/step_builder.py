"""The one builder of a run's state and of what its step's programs are called with, from its `Experiment`.

`build(exp, graphdef, policy)` gives the step's state (the policy, its critic, the optimizer states of what trains)
and a `StepParts`: the optimizers, the model definitions and the learner (mini- and micro-batch plan) that run the
update, and the policies the engines and the KL term read. `Trainer` builds from arrays on the run's devices; the
compile-only analysis (`jaxrl_batch.aot`) builds from sharded `jax.ShapeDtypeStruct`s on compile-only devices,
through the same code, so that what it compiles is what a run executes (tests/test_aot_matches_run.py compares the
lowered programs).
"""
import dataclasses

import jax
import optax

from jaxrl_batch.config.optim import Optimizer, make_optimizer
from jaxrl_batch.model import compute_copy
from jaxrl_batch.model import lora as lora_lib
from jaxrl_batch.rl import critic as critic_lib
from jaxrl_batch.rl.forward import ModelDefs
from jaxrl_batch.rl.learner import Learner
from jaxrl_batch.runtime import sharding
from jaxrl_batch.train.setup import Experiment


def is_abstract(tree) -> bool:
  """Whether `tree`'s leaves are shapes (`jax.ShapeDtypeStruct`) rather than arrays."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def optimizers(exp: Experiment) -> tuple[Optimizer, Optimizer | None]:
  """(the actor's optimizer, the critic's or None): the member's learning rates and Adam settings, their schedules in
  samples over the sample budget."""
  m, config = exp.member, exp.config
  actor = make_optimizer(config.optim, m.batch_size, m.sample_budget, m.updates_per_step, (m.actor_lr, m.actor_adam))
  if not m.algo.critic:
    return actor, None
  return actor, make_optimizer(config.critic.optim, m.batch_size, m.sample_budget, m.updates_per_step,
                               (m.critic_lr, m.critic_adam))


def optimizer_state(tx: optax.GradientTransformation, params, mesh):
  """`tx.init(params)` under the mesh, or for abstract `params` its structs: moments sharded like their parameters,
  counters replicated (the layout `tx.init` gives them)."""
  with jax.set_mesh(mesh):
    if not is_abstract(params):
      return tx.init(params)
    shapes = jax.eval_shape(tx.init, params)
  struct = lambda s, layout: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout)
  return optax.tree_utils.tree_map_params(tx, lambda s, p: struct(s, p.sharding), shapes, params,
                                          transform_non_params=lambda s: struct(s, sharding.replicated(mesh)))


@dataclasses.dataclass
class StepParts:
  """What a step runs besides its state: the optimizers, the static model definitions and the `Learner`."""
  exp: Experiment
  optimizer: Optimizer
  critic_optimizer: Optimizer | None
  models: ModelDefs
  learner: Learner

  def reference_policy(self, base_params):
    """The frozen reference policy of the KL term that the run holds, in the compute dtype (`model.compute_copy`:
    its forward reads it cast anyway), a copy that outlives the update's donation; None without a KL term, or with
    adapters (the reference is then the policy without them, `lora.base_policy`: the same base arrays)."""
    if not self.exp.member.algo.use_kl or self.exp.lora is not None:
      return None
    return compute_copy(base_params, self.exp.model_cfg.compute_dtype, copy=True)

  def sampler_policy(self, params):
    """The policy as the engines read it: `params` cast once to the compute dtype (`model.compute_copy`)."""
    return compute_copy(params, self.exp.model_cfg.compute_dtype)


def build(exp: Experiment, graphdef, policy, optimizers_=None) -> tuple[StepParts, dict]:
  """(`StepParts`, the state at step 0) for the policy RL trains (`Experiment.policy`: with adapters, the base and
  its adapters): the policy, its critic (`rl.critic.init_critic`), and optimizer states for what trains (with
  adapters, the adapters only: `lora.trainable`). Arrays give arrays; structs give the structs of the same layout.
  `optimizers_`: the run's (`optimizers(exp)`) when already made."""
  m, algo = exp.member, exp.member.algo
  actor, critic_opt = optimizers_ or optimizers(exp)
  state, critic_graphdef = dict(params=policy), None
  if algo.critic:
    make = critic_lib.abstract_critic if is_abstract(policy) else critic_lib.init_critic
    critic_graphdef, state["critic"] = make(exp.model_cfg, lora_lib.split(policy)[1], algo.share_backbone,
                                            algo.critic_layers, exp.mesh, exp.config.sharding_rules)
  state["opt_state"] = optimizer_state(actor.tx, lora_lib.trainable(policy), exp.mesh)
  if algo.critic:
    state["critic_opt_state"] = optimizer_state(critic_opt.tx, state["critic"], exp.mesh)
  models = ModelDefs(graphdef, actor.tx, critic_graphdef, critic_opt.tx if critic_opt else None)
  learner = Learner(algo, models, group_size=m.group_size, mini_batch_size=m.mini_batch_size, num_micro=m.num_micro,
                    seed=m.seed, mesh=exp.mesh, packing=exp.packing, score_num_micro=m.score_num_micro)
  return StepParts(exp, actor, critic_opt, models, learner), state
