"""The rollout engines behind one call, and the figures of a rollout they report.

`sampling.engine`:
  static: `generate` over blocks of `slots` rows (all B rows at once by default); each block runs until its
    longest response ends, so with long-tailed lengths most of its slot-steps serve a few stragglers.
  continuous: `continuous.generate_continuous`, `slots` sequences in flight, a finished one's slot taking the next
    request.
Both return the same `Rollout` for the same requests: greedy tokens are equal, and sampled ones follow the same
distribution (the static engine draws one key per step for the whole block, the continuous one a key per request
and token).
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_batch.sampling.continuous import EngineStats, generate_continuous
from jaxrl_batch.sampling.generate import Rollout, generate
from jaxrl_batch.sampling.engine_settings import EngineSettings
from jaxrl_batch.sampling.strategies import Strategy


def static_stats(lengths_B: np.ndarray, block: int) -> EngineStats:
  """The static engine's figures from the host lengths of its rollout in blocks of `block` rows: a block decodes
  until its longest row ends (one program, no host sync inside)."""
  lengths_B = np.asarray(lengths_B, np.int64)
  blocks = [lengths_B[i:i + block] for i in range(0, len(lengths_B), block)]
  slot_steps = sum(len(x) * (int(x.max()) - 1) for x in blocks)
  return EngineStats(chunks=0, slot_steps=slot_steps, decoded=int((lengths_B - 1).sum()))


def rollout(graphdef, params, prompt_BxP, prompt_valid_BxP, rng, *, max_new_tokens: int, eos_id: int, pad_id: int,
            sampling: Strategy, engine: EngineSettings, group_size: int = 1, slots: int = 0, budget_B=None,
            row_sharding=None, on_ended=None) -> tuple[Rollout, EngineStats | None]:
  """The B requests' Rollout, tokens chosen by `sampling`, decoded by `engine.engine` on `slots` slots (0 = B),
  and the continuous engine's EngineStats (None for the static engine: its figures need the lengths on the host,
  `static_stats`).

  `slots` must be a multiple of group_size for the static engine (its blocks hold whole groups). budget_B and
  row_sharding as `generate_continuous`'s; `on_ended` too (the continuous engine's requests as they end; the static
  engine ignores it: its rows all end together).
  """
  kwargs = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, sampling=sampling,
                group_size=group_size)
  if engine.engine == "continuous":
    return generate_continuous(graphdef, params, prompt_BxP, prompt_valid_BxP, rng, engine=engine, slots=slots,
                               budget_B=budget_B, row_sharding=row_sharding, on_ended=on_ended, **kwargs)
  kwargs["attention_backend"] = engine.attention_backend
  b = prompt_BxP.shape[0]
  block = slots or b
  if block >= b:
    return generate(graphdef, params, prompt_BxP, prompt_valid_BxP, rng, budget_B=budget_B, **kwargs), None
  if block % group_size or b % block:
    raise ValueError(f"the static engine decodes blocks of sampling.slots={block} rows: it must divide the batch "
                     f"of {b} and be a multiple of group_size={group_size}.")
  parts = [generate(graphdef, params, prompt_BxP[i:i + block], prompt_valid_BxP[i:i + block],
                    jax.random.fold_in(rng, i // block),
                    budget_B=None if budget_B is None else budget_B[i:i + block], **kwargs)
           for i in range(0, b, block)]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts), None

