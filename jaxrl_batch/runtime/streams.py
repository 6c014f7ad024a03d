"""Every random stream of a run, named in one place.

A run's randomness is a function of (seed, stream, step, round), so the step count is its data position and RNG
state, and a resumed run replays exactly. Streams never share draws: before they were named, refill round 1 of RL
step s drew the problems of SFT step s.

Host streams are numpy generators or the integer seeds a task's `train_problems(seed, step, num)` takes; device
streams are JAX keys built inside jitted code from uploaded int32 data. Round 0 of the RL prompts (the run's seed
itself), the SFT problems (seed + SFT_OFFSET), the sampling key and the shuffles keep the values they had before
the streams were named, so cached base policies and measured figures stay valid.
"""
import jax
import numpy as np

SFT_OFFSET = 1_000_003  # The SFT problems' task seed is seed + SFT_OFFSET; their answer formats [that, step, 1].
RL_REFILL_PROMPTS = 1  # Stream id of refill rounds' problems: SeedSequence([seed, id, round]); never reuse it.


def rl_prompt_seed(seed: int, round_: int) -> int:
  """The task seed of RL sampling round `round_` (0 = the step's first round; >= 1: dynamic-sampling refills)."""
  if round_ == 0:
    return seed
  return int(np.random.SeedSequence([seed, RL_REFILL_PROMPTS, round_]).generate_state(1)[0])


def sft_prompt_seed(seed: int) -> int:
  """The task seed of the supervised warm start's problems."""
  return seed + SFT_OFFSET


def sft_format_rng(seed: int, step: int) -> np.random.Generator:
  """The answer formats of SFT step `step` (`Task.sft_example`)."""
  return np.random.default_rng([seed + SFT_OFFSET, step, 1])


def shuffle_rng(seed: int, step: int) -> np.random.Generator:
  """The mini-batch orders of RL step `step`."""
  return np.random.default_rng([seed, step, 1])


def sampling_key_data(seed: int, step: int, round_: int) -> np.ndarray:
  """(3,) int32 host data of the sampling key of (step, round): uploaded with the prompts, turned into a key on the
  device by `sampling_key`."""
  return np.array([seed, step, round_], np.int32)


PARTIAL_STEP = -1  # The step id of the partial rollouts' key: no step of a run has it.


def partial_key_data(seed: int) -> np.ndarray:
  """(3,) int32 host data of the partial rollouts' one key (`train.partial`): its draws are folded by request and
  token index, not by step, so a sequence carried across steps keeps its draws."""
  return sampling_key_data(seed, PARTIAL_STEP, 0)


def sampling_key(data_3: jax.Array) -> jax.Array:
  """The sampling key of `sampling_key_data` (traceable): fold_in(key(seed), step), then round if >= 1."""
  key = jax.random.fold_in(jax.random.key(data_3[0]), data_3[1])
  return jax.lax.cond(data_3[2] > 0, lambda k: jax.random.fold_in(k, data_3[2]), lambda k: k, key)


def init_seed(seed: int) -> int:
  """The seed of a freshly initialised policy (`nnx.Rngs`)."""
  return seed


def adapter_seed(seed: int) -> int:
  """The seed of the LoRA adapters a run adds to its base policy (`nnx.Rngs` of the model with adapters: their
  draws follow the base weights' in that stream, so they are not the base's)."""
  return seed
