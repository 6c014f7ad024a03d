r"""GRPO on synthetic integer arithmetic: a batch family that runs end to end on a laptop CPU.

A member of the family is chosen by its batch size B (rollouts per update = prompts x group size) and the rule
that retunes the learning rate from the base member (B0 = `optim.base_batch`, lr0 = `optim.base_lr`):
  none: lr = lr0,  linear: lr = lr0 * B / B0,  sqrt: lr = lr0 * sqrt(B / B0).
The rule is applied when the trainer builds the optimizer, so `--config.batch_size=...` stays consistent;
an explicit `--config.optim.lr=...` wins and is logged as an override.

Commands (from the repository root):
  python -m launch.train --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith
  python -m launch.train --config=configs/grpo_arith.py:batch=256,lr_rule=sqrt --workdir=/tmp/arith_b256
  python -m launch.train --config=configs/grpo_arith.py:debug --workdir=/tmp/arith_debug   # < 1 minute
  python -m launch.train --config=configs/grpo_arith.py:moe --workdir=/tmp/arith_moe       # mixture of experts
  python -m launch.sft --config=configs/grpo_arith.py --workdir=/tmp/arith_base             # warm start only
"""
import ml_collections

from configs import base
from jaxrl_batch.tasks import arithmetic

BASE_BATCH = 128  # B0: the family's reference member (16 prompts x 8 samples).
BASE_LR = 5e-5  # lr0 at B0 (Adam).
# lr0 at B0 of a LoRA member (`lora=<rank>`; rank 8, 4096 samples): 5e-5 does not move held-out accuracy within 2048
# samples, 5e-4 takes it from 0.48 to 0.906, 2e-3 to 0.848 (0.84 by 1024 samples, then flat).
LORA_BASE_LR = 5e-4
GROUP_SIZE = 8  # Samples per prompt when the family scales prompts per step.


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: base.ARGS ('batch=...,lr_rule=...,seed=...,family_axis=...,lora=...,debug,moe').

  Without `batch`, the member is the family's base (B0 = 128; under `debug`, B = 32 with lr0 = 2e-3). `lora=<rank>`
  trains adapters at LoRA's lr0 (`LORA_BASE_LR`; 2e-2 under `debug`). `moe` swaps
  each block's SwiGLU for a mixture of experts (`base.moe_config`) with as many active parameters as the dense model
  has in all; the rest of the recipe is unchanged.
  """
  arg = base.parse(arg)
  # debug: B = 32 rollouts of 4 samples per prompt by default, lr = 1e-3 there (2e-3 at B0, sqrt rule).
  batch, group_size, base_lr = (32, 4, 2e-3) if arg.debug else (BASE_BATCH, GROUP_SIZE, BASE_LR)
  if arg.lora:
    # debug, rank 8, 192 samples (16 held-out problems, greedy accuracy at 0/64/128/192): lr0 5e-3 0/0/0/0.375,
    # 2e-2 0/0.125/0.25/0.375, 5e-2 0/0.375/0.31/0.06 (unstable).
    base_lr = 2e-2 if arg.debug else LORA_BASE_LR
  c = base.get_config(arg, batch=batch, group_size=group_size, base_lr=base_lr, base_batch=BASE_BATCH)
  c.task.update(arithmetic.default_config())
  c.task.name = "arithmetic"  # Registered task name (jaxrl_batch.tasks.TASKS).
  c.task.max_digits = 2  # Operands 0..99: learnable by a 1M-parameter model in ~2 minutes of CPU SFT.
  # The warm-start corpus writes most differences as decimals ("-7.0", "-7."), which the strict reward rejects,
  # and most sums plainly: the base policy is right on sums only, and RL must carry the strict format over.
  c.task.sft_strict_frac_add = 0.9
  c.task.sft_strict_frac_sub = 0.2

  if arg.debug:
    # Learns in seconds, so that tests of training and resume see every piece of run state matter: one-digit
    # operands, mostly loose sums in the warm start (greedy, the base policy solves none of the 16 held-out problems;
    # sampled, ~0.4 of its rollouts earn reward), and RL that makes them strict (~0.3 held-out within 192 samples),
    # with rewards and gradients from the first step.
    c.task.update(max_digits=1, num_eval=16, sft_strict_frac_add=0.3)
    c.micro_batch_size = 8
    c.optim.warmup_samples = 32
    c.sample_budget = 192
    c.eval_every_samples = 64
    c.checkpoint_every_samples = 64
    c.sft.update(steps=1000, lr=3e-3)
  return c


def sweep() -> list[dict]:
  """The study's members (config args): the sqrt family over 64..512 rollouts per update, and `none` as the control."""
  return [dict(batch=b, lr_rule=rule) for rule in ("sqrt", "none") for b in (64, 128, 256, 512)]
