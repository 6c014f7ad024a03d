"""A step's rollouts: sample group_size responses per prompt, score them, and apply dynamic sampling and overlong
handling. The rollouts stay on the device; only the prompts go up, the response tokens come down (for decoding and
scoring) and the rewards go up (`runtime.transfer`).

Rewards stream (`task.stream_rewards`): with the continuous engine (one process), the responses that end in a chunk
come down while the next chunk decodes, and the experiment's `RewardScorer` decodes and scores them on host threads,
so scoring overlaps generation and `reward_s` is only the wait for the last rewards after it. The static engine's
rows end together: they are scored after it.

Round r of step s draws its prompts from the stream `streams.rl_prompt_seed(seed, r)` and its sampling key from
(seed, s, r): round 0 is exactly the run without dynamic sampling, and a resumed run replays every round.
"""
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_batch.model import KVCache, PagedKVCache, compute_copy
from jaxrl_batch.rl.advantages import zero_std_groups
from jaxrl_batch.rl.rollouts import Rollouts
from jaxrl_batch.runtime import memory, sharding, streams, transfer
from jaxrl_batch.sampling import Strategy, generate, rollout, static_stats
from jaxrl_batch.tasks.rewards import ScoringBatch
from jaxrl_batch.train import samples_log
from jaxrl_batch.train.setup import Experiment
from jaxrl_batch.train.step_row import RolloutStats, group_zero_std_frac, trained_rewards


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id", "pad_id", "sampling",
                                             "group_size", "attention_backend"))
def sample_round(graphdef, params, prompt_BxP, prompt_valid_BxP, key_data_3, *, max_new_tokens: int, eos_id: int,
                 pad_id: int, sampling: Strategy, group_size: int, attention_backend: str):
  """One round's rollout, its sampling key built on the device from `streams.sampling_key_data`."""
  return generate(graphdef, params, prompt_BxP, prompt_valid_BxP, streams.sampling_key(key_data_3),
                  max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, sampling=sampling,
                  group_size=group_size,  # One prefill per prompt, its KV shared by the group.
                  attention_backend=attention_backend)


sampling_key = jax.jit(streams.sampling_key)


@jax.jit
def _rows(tokens_RxN, lengths_R, rows_S):
  """Rows `rows_S` of the engine's outputs: (tokens_SxN, lengths_S)."""
  return jnp.take(tokens_RxN, rows_S, axis=0), jnp.take(lengths_R, rows_S)


def stream_to(exp: Experiment, scoring: ScoringBatch, slots: int):
  """`decode`'s `on_ended` callback that hands the ended requests to `scoring`: their rows are gathered into `slots`
  rows (a fixed shape: one program) and copied down asynchronously; the scorer's decoder thread waits for them."""
  def on_ended(outputs, ended):
    rows_S = np.resize(ended, slots).astype(np.int32)  # padded with repeats: fixed shape
    rows_S = transfer.to_device("ended", rows_S, sharding.replicated(exp.mesh))
    with jax.set_mesh(exp.mesh):
      tokens_SxN, lengths_S = _rows(outputs.tokens_RxN, outputs.lengths_R, rows_S)
    for x in (tokens_SxN, lengths_S):
      x.copy_to_host_async()

    def completions():
      tokens, lengths = transfer.to_host("responses", (tokens_SxN, lengths_S))
      k = len(ended)
      return exp.decode_responses(tokens[:k], np.arange(tokens.shape[1])[None, :] < lengths[:k, None])

    scoring.submit(ended, completions)
  return on_ended


@jax.jit
def _select(rounds, rows_B):
  """Rows `rows_B` of the rounds' arrays concatenated along the batch (round r's row i is r * B + i)."""
  return jax.tree.map(lambda *xs: jnp.take(jnp.concatenate(xs), rows_B, axis=0), *rounds)


def check_rollout_memory(exp: Experiment, slots: int) -> int:
  """Logs the KV cache the rollout needs per device, and refuses a configuration whose cache cannot fit the first
  device's free memory. Slot cache: `slots` sequences (all devices) at the longest allowed length (prompt_len +
  response_len - 1 slots) plus the prefill of the step's prompts. Paged cache (sampling.page_size = C > 0, one
  device): the prompts' shared pages (prompt_len rounded up to C), sampling.pages growable pages (0 = every slot
  at the longest length) and the trash page. Returns the bytes per device."""
  data = sharding.data_parallel_size(exp.mesh)
  cfg, length, c = exp.model_cfg, exp.prompt_len + exp.response_len - 1, exp.engine.page_size
  if c:
    if data > 1:
      raise ValueError(f"sampling.page_size={c} (a paged KV cache) runs the rollout on one device, but the mesh "
                       f"shards the batch over {data}: set sampling.page_size=0 (the slot cache shards), or run on "
                       "one device.")
    prompt_pages = exp.member.num_prompts * -(-exp.prompt_len // c)
    own = exp.engine.pages or slots * -(-(exp.response_len - 1) // c)
    needed = PagedKVCache.bytes_for(cfg, prompt_pages + own + 1, c)
    shape = f"{prompt_pages} prompt pages + {own} pages for {slots} slots, of {c} positions"
    logging.info("Rollout KV cache (paged): %s x %d layers = %.1f MiB.", shape, cfg.num_layers, needed / 2**20)
  else:
    cache = KVCache.bytes_for(cfg, -(-slots // data), length)
    prefill = KVCache.bytes_for(cfg, -(-exp.member.num_prompts // data), exp.prompt_len)
    needed = cache + prefill
    shape = f"{-(-slots // data)} sequences x {length} positions, plus the prompts' prefill"
    logging.info("Rollout KV cache per device: %d slots x %d positions x %d layers = %.1f MiB (+ %.1f MiB prefill).",
                 -(-slots // data), length, cfg.num_layers, cache / 2**20, prefill / 2**20)
  free = memory.free_bytes(jax.local_devices()[0])
  if free is not None and needed > free:
    fix = ("Lower sampling.pages or sampling.slots" if c else
           "Lower sampling.slots (the continuous engine keeps that many sequences per device in flight)")
    raise ValueError(
        f"The rollout's KV cache needs {needed / 2**30:.2f} GiB per device ({shape}, x {cfg.num_layers} layers x "
        f"{cfg.num_kv_heads} kv heads x {cfg.head_dim} x 2), but the device has {free / 2**30:.2f} GiB free. "
        f"{fix}, or shorten the response budget.")
  return needed


class Collector:
  """Produces each step's `Rollouts` for the member's P prompts x G samples."""
  carries_rollouts = False  # Rollouts in flight between steps are run state (`state_dict`) where True.

  def __init__(self, exp: Experiment):
    self.exp, self.member = exp, exp.member
    self.log_samples_count = exp.config.log_samples_count  # The first rollouts, as text for samples.jsonl.
    # Slots per device times the devices the batch is sharded over; 0 = every request at once.
    self.slots = exp.engine.slots * sharding.data_parallel_size(exp.mesh)
    self._row_sharding = functools.partial(sharding.batch_sharding, exp.mesh)
    check_rollout_memory(exp, self.slots or self.member.batch_size)

  def _round(self, graphdef, params, step: int, r: int) -> dict:
    """One round of sampling and scoring: device arrays, host tokens/rewards and timings."""
    exp, m = self.exp, self.member
    g = m.group_size
    problems = exp.task.train_problems(streams.rl_prompt_seed(m.seed, r), step, m.num_prompts)
    prompt_BxP, prompt_valid_BxP = (np.repeat(x, g, axis=0) for x in exp.encode_prompts(problems))
    batch = lambda ndim: sharding.batch_sharding(exp.mesh, ndim)
    prompt_BxP, prompt_valid_BxP, key_data = transfer.to_device(
        "prompts", (prompt_BxP, prompt_valid_BxP, streams.sampling_key_data(m.seed, step, r)),
        (batch(2), batch(2), sharding.replicated(exp.mesh)))
    problems_B = [p for p in problems for _ in range(g)]
    scoring = exp.scorer.batch(problems_B)
    engine = exp.engine
    streamed = exp.scorer.stream and engine.engine == "continuous" and jax.process_count() == 1
    t0 = time.time()
    kwargs = dict(max_new_tokens=exp.response_len, eos_id=exp.stop_id, pad_id=exp.tokenizer.pad_id,
                  sampling=exp.strategy, group_size=g)
    with jax.set_mesh(exp.mesh):
      if engine.engine == "static" and self.slots in (0, m.batch_size):  # one block, one program
        out, engine_stats = sample_round(graphdef, params, prompt_BxP, prompt_valid_BxP, key_data,
                                         attention_backend=engine.attention_backend, **kwargs), None
      else:
        out, engine_stats = rollout(graphdef, params, prompt_BxP, prompt_valid_BxP, sampling_key(key_data),
                                    engine=engine, slots=self.slots, row_sharding=self._row_sharding,
                                    on_ended=stream_to(exp, scoring, self.slots or m.batch_size) if streamed else None,
                                    **kwargs)
    out = jax.block_until_ready(out)
    t1 = time.time()
    if streamed:
      lengths_B, truncated_B = transfer.to_host("lengths", (out.lengths_B, out.truncated_B))
    else:
      tokens_BxN, mask_BxN, lengths_B, truncated_B = transfer.to_host(
          "tokens", (out.tokens_BxN, out.mask_BxN, out.lengths_B, out.truncated_B))
      scoring.submit(range(len(problems_B)), lambda: exp.decode_responses(tokens_BxN, mask_BxN))
    engine_stats = engine_stats or static_stats(lengths_B, self.slots or m.batch_size)
    scores = scoring.result()
    failures = scores.failures()
    if failures:
      # Named as its metrics row (`step`: steps done, so step index s trains as row s + 1).
      logging.warning("Step %d: the reward function %s", step + 1, failures)
    device = Rollouts(prompt_BxP, prompt_valid_BxP, out.tokens_BxN, out.logprobs_BxN, out.mask_BxN, rewards_B=None,
                      trained_B=None, experts_BxTxLxK=out.experts_BxTxLxK)  # Scored below, once the rows are kept.
    return dict(device=device, task_rewards_B=scores.rewards_B, lengths_B=lengths_B, truncated_B=truncated_B,
                problems_B=problems_B, completions_B=scores.completions_B, errors=scores.errors,
                timeouts=scores.timeouts, rollout_s=t1 - t0, reward_s=time.time() - t1, engine=engine_stats)

  def collect(self, graphdef, params, step: int) -> tuple[Rollouts, RolloutStats]:
    """The step's rollouts (on the device, with their rewards) and their host statistics; the engine decodes with
    `params` cast once to the compute dtype (`model.compute_copy`)."""
    algo, m = self.member.algo, self.member
    params = compute_copy(params, self.exp.model_cfg.compute_dtype)
    g, p = m.group_size, m.num_prompts
    rounds, kept, dropped = [], [], []
    for r in range(algo.max_sampling_rounds if algo.dynamic_sampling else 1):
      out = self._round(graphdef, params, step, r)
      rounds.append(out)
      informative_G = ~zero_std_groups(out["task_rewards_B"], g) if algo.dynamic_sampling else np.ones(p, bool)
      kept += [(r, i) for i in np.flatnonzero(informative_G)]
      dropped += [(r, i) for i in np.flatnonzero(~informative_G)]
      if len(kept) >= p:
        break
    # Short of informative groups after the last round: fill the batch with dropped ones (their group advantages
    # are 0), so that a step always trains on a full batch and the run reaches its budget.
    groups = kept[:p] + dropped[:max(p - len(kept), 0)]
    b = m.batch_size
    rows_B = np.concatenate([r * b + np.arange(i * g, (i + 1) * g) for r, i in groups]).astype(np.int32)
    every = {k: np.concatenate([out[k] for out in rounds]) for k in ("task_rewards_B", "lengths_B", "truncated_B")}
    truncated_B, lengths_B, rewards_B = (every[k][rows_B] for k in ("truncated_B", "lengths_B", "task_rewards_B"))
    shown = [(rounds[i // b], i % b) for i in rows_B[:self.log_samples_count]]
    examples = samples_log.examples([out["problems_B"][i] for out, i in shown],
                                    [out["completions_B"][i] for out, i in shown], rewards_B, lengths_B, truncated_B)
    rewards_B, trained_B = trained_rewards(algo, rewards_B, lengths_B, truncated_B, self.exp.response_len)
    rollouts = self._upload(rounds, rows_B, rewards_B, trained_B)
    stats = RolloutStats.of(
        rewards_E=every["task_rewards_B"], lengths_E=every["lengths_B"], truncated_E=every["truncated_B"],
        engine=[out["engine"] for out in rounds], zero_std_frac=group_zero_std_frac(every["task_rewards_B"], g),
        rollout_s=sum(out["rollout_s"] for out in rounds), reward_s=sum(out["reward_s"] for out in rounds),
        samples_generated=len(every["task_rewards_B"]), sampling_rounds=len(rounds),
        response_lens=every["lengths_B"].tolist(),
        reward_errors=int(sum(out["errors"] for out in rounds)),
        reward_timeouts=int(sum(out["timeouts"] for out in rounds)), trained_samples=int(trained_B.sum()),
        examples=examples)
    return rollouts, stats

  def _upload(self, rounds: list[dict], rows_B: np.ndarray, rewards_B: np.ndarray, trained_B: np.ndarray
              ) -> Rollouts:
    """The rollouts of rows `rows_B` of the rounds (round r's row i is r * B + i) with their rewards uploaded."""
    mesh, b = self.exp.mesh, self.member.batch_size
    replicated, batch_1d = sharding.replicated(mesh), sharding.batch_sharding(mesh, 1)
    # One round kept whole (always so without dynamic sampling): its arrays are the step's, no gather needed.
    whole = len(rounds) == 1 and np.array_equal(rows_B, np.arange(b))
    device_rewards_B, device_trained_B, device_rows_B = transfer.to_device(
        "rewards", (rewards_B.astype(np.float32), trained_B, () if whole else rows_B),
        (batch_1d, batch_1d, () if whole else replicated))
    if whole:
      selected = rounds[0]["device"]
    else:
      with jax.set_mesh(mesh):
        selected = _select([out["device"] for out in rounds], device_rows_B)
    return selected._replace(rewards_B=device_rewards_B, trained_B=device_trained_B)
