r"""PPO on synthetic integer arithmetic: the GRPO family's task, model, budget and batch mechanism, with a critic.

The actor and the critic each have a base lr and a batch-family rule (`optim.*` and `critic.optim.*`): the
reference study found that PPO's family stays batch-invariant only when both are retuned.

Commands (from the repository root):
  python -m launch.train --config=configs/ppo_arith.py --workdir=/tmp/ppo_arith
  python -m launch.train --config=configs/ppo_arith.py:batch=256,lr_rule=sqrt --workdir=/tmp/ppo_b256
  python -m launch.train --config=configs/ppo_arith.py:debug --workdir=/tmp/ppo_debug   # < 1 minute
"""
import ml_collections

from configs import base, grpo_arith


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: base.ARGS, as configs/grpo_arith.py; `lr_rule` sets the actor's and the critic's rule."""
  c = grpo_arith.get_config(arg)
  c.algo = "ppo"
  c.rl.update(
      estimator="gae",  # Per-token advantages from the critic, undiscounted (the reward is the outcome at the end).
      lam=0.95,  # GAE lambda.
      whiten_advantages=True,  # Batch-whitened advantages (standard PPO).
      epochs=2,  # Passes over each rollout batch.
      mini_batches=2,  # Updates per pass.
  )
  # A separate critic with the policy's shape, initialised from the base policy (base.critic_config), trained alone
  # for a few steps before the actor moves.
  c.critic.warmup_steps = 4
  c.critic.optim.update(base_lr=3e-4, lr_rule=c.optim.lr_rule)
  c.micro_batch_size = c.batch_size // c.rl.mini_batches // 2
  if base.parse(arg).debug:
    c.critic.warmup_steps = 1
  return c


def sweep() -> list[dict]:
  """The same members as the GRPO family."""
  return grpo_arith.sweep()
