"""Partial rollouts in steady state, emulated for the rollout benchmark (`launch.bench_rollout --partial_budget`).

The R requests form a stream. Each emulated RL step decodes `partial_budget` decode steps on the slots with the
continuous engine; sequences that ended are "trained on", the ones still in flight are carried over, re-prefilled
at the next step (as the trainer does under new weights, here the same ones) or, with `carry_kv`, kept in their
slots with their KV cache (`continuous.KeptSlots`), and continued; free slots take the next requests of the stream.
A step is in steady state when it is not the first (which starts from empty slots, with nothing carried in) and
the stream still has requests at its end: its slots never drain. The figures are summed over those steps (the last
steps, once the stream runs dry, drain like the static engine's tail).
"""
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_batch.sampling import continuous
from jaxrl_batch.sampling.engine_settings import EngineSettings
from jaxrl_batch.sampling.strategies import Strategy


@dataclasses.dataclass(frozen=True)
class SteadyState:
  """Figures of the steady-state steps: their count, seconds (decode and re-prefill, no scoring) and the part of
  them spent re-prefilling the carried sequences, tokens decoded, slot-steps, sequences ended, the mean number
  carried into a step, and the sequences re-prefilled (0 with carry_kv)."""
  steps: int
  seconds: float
  reprefill_s: float
  decoded: int
  slot_steps: int
  ended: int
  carried_mean: float
  reprefilled: int = 0

  @property
  def useful_token_frac(self) -> float:
    return self.decoded / max(self.slot_steps, 1)

  @property
  def decode_tok_s(self) -> float:
    return self.decoded / max(self.seconds, 1e-9)


def run(graphdef, params, prompt_RxP, valid_RxP, budget_R: np.ndarray, rng, *, sampling: Strategy,
        engine: EngineSettings, slots: int, partial_budget: int, eos_id: int, pad_id: int, carry_kv: bool = False
        ) -> SteadyState:
  """Emulates partial rollouts over the R requests (one sample per prompt; host budgets `budget_R`, the token
  budget of each). Each step's request table holds the carried sequences and the next 2 x slots x
  ceil(partial_budget / mean budget) + slots requests of the stream (fixed shapes: one compile). With `carry_kv`
  the carried sequences keep their slots and caches instead of being re-prefilled."""
  r, n = len(budget_R), int(budget_R.max())
  if partial_budget < 1:
    raise ValueError(f"partial_budget={partial_budget}: the decode steps of an emulated step must be >= 1.")
  fresh = slots * 2 * -(-partial_budget // max(int(budget_R.mean()), 1)) + slots
  table = slots + fresh
  next_request, carried, kept = 0, [], None  # carried: (request, tokens_N, logps_N, held, slot)
  steps = decoded = slot_steps = ended = carried_total = calls = reprefilled = 0
  seconds = reprefill_s = 0.0
  while next_request < r or carried:
    new = list(range(next_request, min(next_request + fresh, r)))
    rows = [c[0] for c in carried] + new
    tokens_TxN, logps_TxN = np.full((table, n), pad_id, np.int32), np.zeros((table, n), np.float32)
    held_T, index_T = np.zeros(table, np.int32), np.zeros(table, np.int32)
    budget_T = np.ones(table, np.int32)
    index_T[:len(rows)], budget_T[:len(rows)] = rows, budget_R[rows]
    slot_T = np.full(table, -1, np.int64)
    for i, (_, tokens_N, logps_N, held, slot) in enumerate(carried):
      tokens_TxN[i], logps_TxN[i], held_T[i], slot_T[i] = tokens_N, logps_N, held, slot
    requests = continuous.Requests(*map(jnp.asarray, (np.arange(table, dtype=np.int32), index_T, budget_T,
                                                      tokens_TxN, logps_TxN, held_T)))
    prompt_TxP, valid_TxP = jnp.asarray(prompt_RxP[index_T]), jnp.asarray(valid_RxP[index_T])
    jax.block_until_ready((requests, prompt_TxP))
    t0 = time.perf_counter()
    out = continuous.decode(graphdef, params, prompt_TxP, valid_TxP, requests, held_T, range(len(rows)), rng,
                            eos_id=eos_id, sampling=sampling, engine=engine, slots=slots,
                            stop=lambda ended_T, decode_steps: decode_steps >= partial_budget,
                            kept=None if kept is None else kept._replace(slot_R=slot_T))
    tokens_TxN, logps_TxN = (np.asarray(x) for x in jax.block_until_ready(out.outputs[:2]))
    elapsed = time.perf_counter() - t0
    started = [i for i in range(len(rows)) if out.ended_R[i] or out.held_R[i] > 0]
    carried_in = len(carried)
    kept = out.kept if carry_kv else None
    carried = [(rows[i], tokens_TxN[i], logps_TxN[i], int(out.held_R[i]), -1 if kept is None else kept.slot_R[i])
               for i in started if not out.ended_R[i]]
    next_request = max([next_request] + [rows[i] + 1 for i in started if i >= carried_in])
    calls += 1
    if calls > 1 and next_request < r:  # slots filled before it and the stream did not run dry: a steady state
      steps, seconds, reprefill_s = steps + 1, seconds + elapsed, reprefill_s + out.stats.reprefill_s
      decoded, slot_steps = decoded + out.stats.decoded, slot_steps + out.stats.slot_steps
      ended, carried_total = ended + int(out.ended_R.sum()), carried_total + carried_in
      reprefilled += out.stats.reprefilled
  return SteadyState(steps=steps, seconds=seconds, reprefill_s=reprefill_s, decoded=decoded, slot_steps=slot_steps,
                     ended=ended, carried_mean=carried_total / max(steps, 1), reprefilled=reprefilled)
