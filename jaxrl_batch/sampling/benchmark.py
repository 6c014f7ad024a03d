"""Rollout throughput of the engines (`sampling.rollout`) on random weights, against the roofline.

Why: to see where decode time goes, vs concurrency and, with long-tailed response lengths, static vs continuous vs
paged batching. Every engine of a point generates exactly the same tokens (lengths are forced through token
budgets or a forced EOS), so their times compare; each time is the best of a few interleaved runs, and the roofline
uses the device rates measured around them. `launch.bench_rollout` runs `sweep`; the modes, timings and record
fields are explained in docs/results/2026-12-06-engine-notes.md.
"""
import dataclasses
import os
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_batch.model import KVCache, ModelConfig, PagedKVCache, Transformer, causal_mask
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling import steady_state
from jaxrl_batch.sampling.continuous import EngineStats
from jaxrl_batch.sampling.engine import rollout, static_stats
from jaxrl_batch.sampling.generate import Rollout
from jaxrl_batch.sampling.roofline import best_seconds, measure_machine, step_roofline
from jaxrl_batch.sampling.engine_settings import EngineSettings, resolved_backend
from jaxrl_batch.sampling.strategies import Strategy

LOGNORMAL_SIGMA = 1.0  # of log-length: mean 128 puts ~0.5% of draws above 1024, the longest of 64 near 860
MODES = ("static", "continuous", "paged")  # the engines, one record kind each (`_engine`)


@dataclasses.dataclass(frozen=True)
class Settings:
  """One benchmark run (the flags of `launch.bench_rollout`)."""

  concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # rows decoded together, one point each (without rollouts)
  engine: tuple[str, ...] = ("static",)  # engines measured at each point, one record each (MODES)
  chunk: int = 16  # decode steps per host sync of the continuous engine
  length_dist: str = ""  # response lengths, "fixed:N" or "lognormal:MEAN:MAX" ("" = new_tokens each)
  rollouts: int = 0  # requests per point, decoded on each of `slots` (0 = concurrency requests on as many slots)
  slots: tuple[int, ...] = ()  # slots of each point with rollouts (replacing concurrency)
  partial_budget: int = 0  # > 0: also emulate partial rollouts in steady state, this many decode steps per step
  carry_kv: bool = False  # with partial_budget: also partial rollouts that keep their slots' KV cache, interleaved
  page_size: int = 16  # the paged engine's slots per page
  pages: int = 0  # the paged engine's growable pages (0 = every slot at the longest response: no preemption)
  d_model: int = 768
  num_layers: int = 8
  num_heads: int = 12
  num_kv_heads: int = 4
  head_dim: int = 64
  d_ff: int = 2048
  num_experts: int = 0  # experts E of every layer's MoE MLP (0 = a dense model)
  num_experts_per_tok: int = 0  # experts k per token (MoE)
  moe_d_ff: int = 0  # hidden width of one expert (MoE)
  vocab_size: int = 32000
  tie_embeddings: bool = False
  dtype: str = "float32"  # parameters and activations
  prompt_len: int = 32  # tokens per prompt
  new_tokens: int = 64  # tokens generated per row (without length_dist)
  max_len: int = 0  # cache slots: prompt_len + token budget (0 = prompt_len + the longest response)
  group_size: int = 1  # rows per distinct prompt, prefilled once (generate's group_size)
  temperature: float = 0.0  # 0 = greedy
  backend: str = "auto"  # EngineSettings.attention_backend
  compare_hf: bool = False  # also time transformers' generate (torch) on the same weights (new_tokens mode only)
  repeats: int = 3  # timed runs per measurement, the best kept
  bandwidth_mb: int = 512  # MiB, array of the bandwidth measurement
  matmul_size: int = 2048  # side of the square matmul of the FLOP rate measurement
  seed: int = 0  # of the weights, prompts and lengths

  def model_config(self) -> ModelConfig:
    return ModelConfig(vocab_size=self.vocab_size, d_model=self.d_model, num_layers=self.num_layers,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                       d_ff=self.d_ff, tie_embeddings=self.tie_embeddings, dtype=self.dtype,
                       param_dtype=self.dtype, num_experts=self.num_experts,
                       num_experts_per_tok=self.num_experts_per_tok, moe_d_ff=self.moe_d_ff)

  @property
  def longest(self) -> int:
    """The longest response: new_tokens, or length_dist's N or MAX."""
    return int(self.length_dist.split(":")[-1]) if self.length_dist else self.new_tokens

  @property
  def budget(self) -> int:
    """max_new_tokens passed to the engines."""
    return max(self.max_len - self.prompt_len, self.longest)

  def points(self) -> list[tuple[int, int]]:
    """(requests R, slots S) of each point."""
    return [(self.rollouts, s) for s in self.slots] if self.rollouts else [(b, b) for b in self.concurrency]


def draw_lengths(spec: str, count: int, seed: int) -> np.ndarray:
  """int64 (count,) response lengths in tokens: "fixed:N", N each; "lognormal:MEAN:MAX", round(exp(X)) with X ~
  N(log MEAN - sigma^2 / 2, sigma^2), sigma = LOGNORMAL_SIGMA, clipped to [1, MAX]. MEAN is the mean before
  rounding and clipping (the clip at MAX lowers it, the one at 1 raises it: measure the draw)."""
  kind, *args = spec.split(":")
  if kind == "fixed" and len(args) == 1 and int(args[0]) >= 1:
    return np.full(count, int(args[0]), np.int64)
  if kind == "lognormal" and len(args) == 2 and float(args[0]) > 0 and int(args[1]) >= 1:
    mean, longest = float(args[0]), int(args[1])
    x = np.random.default_rng([seed, 1]).normal(np.log(mean) - LOGNORMAL_SIGMA**2 / 2, LOGNORMAL_SIGMA, count)
    return np.clip(np.rint(np.exp(x)), 1, longest).astype(np.int64)
  raise ValueError(f"length_dist={spec!r}: 'fixed:N' (N >= 1) or 'lognormal:MEAN:MAX' (MEAN > 0, MAX >= 1).")


class EosAt(nnx.Module):
  """`model` that chooses `eos_id` exactly at RoPE position `position` and at no earlier position: its logits there
  put all mass on EOS and elsewhere none."""

  def __init__(self, model: Transformer, eos_id: int, position: int):
    self.model, self.cfg, self.eos_id, self.position = model, model.cfg, eos_id, position

  def _force(self, logits_BxTxV, at_BxT):
    is_eos_V = jnp.arange(logits_BxTxV.shape[-1]) == self.eos_id
    only_eos_V = jnp.where(is_eos_V, 0.0, -1e30)
    return jnp.where(at_BxT[..., None], only_eos_V, jnp.where(is_eos_V, -1e30, logits_BxTxV))

  def forward(self, *args, **kwargs):
    return self.model.forward(*args, **kwargs)

  def logits(self, hidden_BxTxD):  # the prefill's last position, < `position`
    return self._force(self.model.logits(hidden_BxTxD), jnp.zeros(hidden_BxTxD.shape[:2], bool))

  def step(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=None, decode_backend=None):
    logits_BxTxV, cache, experts = self.model.step(tokens_BxT, positions_BxT, mask_BxTxS, cache, cache_index,
                                                   decode_backend)
    return self._force(logits_BxTxV, positions_BxT >= self.position), cache, experts


def random_params(cfg: ModelConfig, seed: int):
  """(graphdef, params) of a Transformer with N(0, 0.02) weights, unit norm scales and zero biases, on the first
  device. Drawn by numpy: the model's own initialiser would compile for seconds."""
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, abstract = sharding.abstract_sharded(lambda: Transformer(cfg, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  rng = np.random.default_rng(seed)

  def draw(path, spec):
    name = path[-1].key
    if name == "scale":
      x = np.ones(spec.shape, np.float32)
    elif name in ("bq", "bk", "bv"):
      x = np.zeros(spec.shape, np.float32)
    else:
      x = 0.02 * rng.standard_normal(spec.shape, np.float32)
    return jax.device_put(x.astype(spec.dtype), spec.sharding)

  return graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


def _prompts(s: Settings, batch: int) -> np.ndarray:
  """(batch, prompt_len) random token ids, each distinct prompt repeated group_size times."""
  rng = np.random.default_rng(s.seed + batch)
  return np.repeat(rng.integers(0, s.vocab_size, (batch // s.group_size, s.prompt_len)), s.group_size, axis=0)


Run = Callable[[jax.Array], tuple[Rollout, EngineStats | None]]


def _engine(s: Settings, mode: str, graphdef, params, eos_id: int, prompt_BxP: np.ndarray, slots: int) -> Run:
  """`run(budget_B)` -> (Rollout, EngineStats or None) of the requests `prompt_BxP` (unpadded) decoded by `mode` on
  `slots` slots: `sampling.rollout`'s engines. A new record kind is a new mode here and in MODES."""
  prompt_BxP = jnp.asarray(prompt_BxP, jnp.int32)
  valid_BxP = jnp.ones_like(prompt_BxP, bool)
  paged = dict(engine="continuous", page_size=s.page_size, pages=s.pages) if mode == "paged" else dict(engine=mode)
  engine = EngineSettings(attention_backend=s.backend, chunk=s.chunk, **paged)

  def run(budget_B):
    return rollout(graphdef, params, prompt_BxP, valid_BxP, jax.random.key(s.seed), max_new_tokens=s.budget,
                   eos_id=eos_id, pad_id=0, sampling=Strategy(temperature=s.temperature), engine=engine,
                   group_size=s.group_size, slots=slots, budget_B=budget_B)

  return run


def kv_cache_bytes(s: Settings, mode: str, requests: int, slots: int) -> int:
  """Bytes of the KV cache `mode` holds decoding `requests` on `slots` slots: static, a block of slots rows at
  prompt_len + budget - 1 slots; continuous, the same for the slots plus the distinct prompts' prefix; paged, the
  distinct prompts' pages (prompt_len rounded up to page_size), the growable pages and the trash page."""
  cfg, length, prompts = s.model_config(), s.prompt_len + s.budget - 1, requests // s.group_size
  if mode == "paged":
    c = s.page_size
    own = s.pages or slots * -(-(s.budget - 1) // c)
    return PagedKVCache.bytes_for(cfg, prompts * -(-s.prompt_len // c) + own + 1, c)
  prefix = KVCache.bytes_for(cfg, prompts, s.prompt_len) if mode == "continuous" else 0
  return KVCache.bytes_for(cfg, slots, length) + prefix


def _keeping(into: dict, mode: str, run: Run, budget_R) -> Callable[[], Rollout]:
  """A timed call: `run(budget_R)`'s Rollout, the output kept in into[mode] (the last run makes the record: no
  extra run)."""

  def call():
    into[mode] = run(budget_R)
    return into[mode][0]

  return call


def _speeds(prompt_tokens: int, lengths_R: np.ndarray, steps: float, prefill_s: float, decode_s: float
            ) -> dict[str, float]:
  """Tokens per second of the prefill, the decode (tokens chosen by decode steps: each response's but its first)
  and the whole rollout, and ms per decode step (`steps` run)."""
  return dict(prefill_tok_s=prompt_tokens / prefill_s, decode_tok_s=float((lengths_R - 1).sum()) / decode_s,
              decode_step_ms=1e3 * decode_s / steps, tok_s=float(lengths_R.sum()) / (prefill_s + decode_s))


def _partial_records(s: Settings, graphdef, params, eos_id: int, prompt_RxP: np.ndarray, lengths_R: np.ndarray,
                     slots: int, live_len: float, rates: dict) -> dict[str, dict]:
  """The "partial" record of a point and, with carry_kv, the "partial_carry_kv" one: `steady_state.run` over its
  requests re-prefilling the carried sequences, or keeping their slots and caches; one run each to compile, then
  `repeats` rounds taking turns, the fastest run of each kept. Each has its decode speed and useful_token_frac
  over the steady-state steps and the roofline of the point's other records."""
  engine = EngineSettings(attention_backend=s.backend, engine="continuous", chunk=s.chunk)
  kinds = {"partial": False, **({"partial_carry_kv": True} if s.carry_kv else {})}

  def run(carry_kv: bool):
    return steady_state.run(graphdef, params, prompt_RxP.astype(np.int32), np.ones_like(prompt_RxP, bool),
                            lengths_R.astype(np.int32), jax.random.key(s.seed), sampling=Strategy(s.temperature),
                            engine=engine, slots=slots, partial_budget=s.partial_budget, eos_id=eos_id, pad_id=0,
                            carry_kv=carry_kv)
  for carry_kv in kinds.values():
    run(carry_kv)
  best = {}
  for _ in range(max(s.repeats, 1)):
    for kind, carry_kv in kinds.items():
      out = run(carry_kv)
      if kind not in best or out.seconds < best[kind].seconds:
        best[kind] = out
  records = {}
  for kind, out in best.items():
    if not out.steps:
      raise RuntimeError(f"partial_budget={s.partial_budget}: no step of {len(lengths_R)} requests on {slots} slots "
                         "after the first (which starts from empty slots) ended with requests still queued; use "
                         "more rollouts or a smaller budget.")
    record = dict(engine=kind, length_dist=s.length_dist, concurrency=slots, slots=slots,
                  rollouts=len(lengths_R), partial_budget=s.partial_budget, carry_kv=kinds[kind],
                  length_mean=float(lengths_R.mean()), length_max=int(lengths_R.max()), steady_steps=out.steps,
                  decode_s=out.seconds, decode_tok_s=out.decode_tok_s,
                  decode_step_ms=1e3 * out.seconds * slots / max(out.slot_steps, 1),
                  reprefill_s=out.reprefill_s, reprefilled=out.reprefilled,
                  decode_tok_s_without_reprefill=out.decoded / max(out.seconds - out.reprefill_s, 1e-9),
                  slot_steps=out.slot_steps, decoded=out.decoded, useful_token_frac=out.useful_token_frac,
                  carried_mean=out.carried_mean, bandwidth_bytes_per_s=rates["bandwidth_bytes_per_s"],
                  matmul_flops_per_s=rates["matmul_flops_per_s"], live_len=live_len,
                  **step_roofline(s.model_config(), slots, live_len, rates))
    record["roofline_fraction"] = record["roofline_ms"] / record["decode_step_ms"]
    records[kind] = record
  return records


def measured_distinct_experts(model: Transformer, prompt_RxP: np.ndarray, tokens_RxN: np.ndarray,
                              lengths_R: np.ndarray, slots: int) -> float:
  """Mean, over MoE layers and decode steps, of the distinct experts a step's `slots` rows are routed to, with
  the R requests decoded as the static engine does: blocks of `slots` rows, a block's step t = 1..(its longest - 1)
  feeding each row's response token t - 1 (`tokens_RxN`, padded after its end, as the engine feeds) at position
  prompt_len + t - 1. The routing is that of one causal forward per block over its prompts and responses (teacher
  forcing: the decode steps' routing up to rounding)."""
  p, n = prompt_RxP.shape[1], tokens_RxN.shape[1]
  fed_RxT = np.concatenate([prompt_RxP, tokens_RxN[:, :n - 1]], axis=1).astype(np.int32)
  graphdef, params = nnx.split(model)

  @jax.jit
  def experts(params, tokens_SxT):
    valid_SxT = jnp.ones_like(tokens_SxT, bool)
    positions_SxT = jnp.broadcast_to(jnp.arange(tokens_SxT.shape[1]), tokens_SxT.shape)
    _, _, routings = nnx.merge(graphdef, params).forward(tokens_SxT, positions_SxT, causal_mask(valid_SxT))
    return jnp.stack([r.experts_NxK.reshape(*tokens_SxT.shape, -1)[:, p:] for r in routings])  # (L, S, N - 1, K)

  counts = []
  for start in range(0, len(fed_RxT), slots):
    steps = int(lengths_R[start:start + slots].max()) - 1
    experts_LxSxNxK = np.asarray(experts(params, jnp.asarray(fed_RxT[start:start + slots])))[:, :, :steps]
    layers = experts_LxSxNxK.shape[0]
    chosen_LxNxM = np.sort(experts_LxSxNxK.transpose(0, 2, 1, 3).reshape(layers, steps, -1), axis=-1)  # M = S k
    counts.append(1 + (np.diff(chosen_LxNxM, axis=-1) != 0).sum(-1).reshape(-1))  # distinct, per (layer, step)
  return float(np.concatenate(counts).mean())


def _check(s: Settings):
  """Raises ValueError on settings the sweep cannot measure."""
  if s.rollouts and not s.slots or s.slots and not s.rollouts:
    raise ValueError(f"rollouts={s.rollouts} and slots={s.slots} go together.")
  if not s.engine or set(s.engine) - set(MODES) or len(set(s.engine)) < len(s.engine):
    raise ValueError(f"engine={s.engine}: one or more of {MODES}, each once.")
  if "paged" in s.engine and (s.page_size < 1 or s.pages < 0):
    raise ValueError(f"page_size={s.page_size} (>= 1) and pages={s.pages} (>= 0) set the paged engine's pool.")
  if s.length_dist:
    draw_lengths(s.length_dist, 1, s.seed)
  if s.longest < 2:
    raise ValueError(f"the longest response is {s.longest} tokens: at least 2 (one decode step) are needed.")
  if s.max_len and s.max_len < s.prompt_len + s.longest:
    raise ValueError(f"max_len={s.max_len} is below prompt_len + the longest response = {s.prompt_len + s.longest}.")
  if s.carry_kv and not s.partial_budget:
    raise ValueError("carry_kv measures partial rollouts that keep their KV cache: it needs partial_budget.")
  if s.partial_budget and not (s.length_dist and s.rollouts):
    raise ValueError(f"partial_budget={s.partial_budget} emulates partial rollouts over a stream of requests: it "
                     "needs length_dist and rollouts.")
  if s.compare_hf and (s.length_dist or s.rollouts):
    raise ValueError("compare_hf times whole batches of new_tokens tokens: no length_dist, no rollouts.")
  for requests, slots in s.points():
    if requests % s.group_size or slots % s.group_size or requests % slots:
      raise ValueError(f"{requests} requests on {slots} slots: both multiples of group_size={s.group_size}, the "
                       "slots dividing the requests (the static engine's blocks).")


def _lengths(s: Settings, requests: int) -> np.ndarray:
  """int64 (requests,) response lengths of a point: drawn from length_dist, else new_tokens each (the budget's end
  or the forced EOS)."""
  if s.length_dist:
    return draw_lengths(s.length_dist, requests, s.seed)
  return np.full(requests, s.new_tokens, np.int64)


def _live_len(prompt_len: int, lengths_R: np.ndarray) -> float:
  """The mean live length over the decoded tokens: response token t (t = 1..L-1) is chosen attending prompt_len + t
  slots."""
  decoded = int((lengths_R - 1).sum())
  return prompt_len + float((lengths_R * (lengths_R - 1) / 2).sum()) / max(decoded, 1)


def _bench_model(s: Settings, graphdef, params) -> tuple[tuple, int]:
  """The (graphdef, params) the engines decode with and its EOS id: with max_len above prompt_len + new_tokens
  (no length_dist), the model forced to emit EOS as its new_tokens-th token (`EosAt`); else the model, with an EOS
  id it cannot produce."""
  if not s.length_dist and s.budget > s.new_tokens:  # EOS as the new_tokens-th token: from prompt_len + new_tokens - 2
    eos_id = s.vocab_size - 1
    model = EosAt(nnx.merge(graphdef, params), eos_id, s.prompt_len + s.new_tokens - 2)
  else:  # no EOS: an id the model cannot produce
    eos_id, model = s.vocab_size, nnx.merge(graphdef, params)
  return nnx.split(model), eos_id


def _hf_runner(s: Settings, cfg: ModelConfig, params):
  """With compare_hf, `prompt_BxP -> run(new_tokens)`: transformers' generate (torch) on the same weights; else
  None."""
  if not s.compare_hf:
    return None
  from jaxrl_batch.hf import side_by_side  # pylint: disable=import-outside-toplevel  (the hf extra: safetensors)
  hf = side_by_side.hf_model(cfg, params)
  return lambda prompt_BxP: side_by_side.hf_generate(hf, prompt_BxP, s.temperature)


def _timed_runs(s: Settings, bench, eos_id: int, prompt_BxP: np.ndarray, lengths_R: np.ndarray, slots: int,
                run_hf) -> tuple[list[float], dict]:
  """The best seconds of each engine's prefill (every budget 1: the same program, no decode step) and full run,
  in turns, then Hugging Face's (`run_hf`, if given); and each engine's last full run, (Rollout, EngineStats or
  None) by mode."""
  requests = len(lengths_R)
  budget_R = jnp.asarray(lengths_R if s.length_dist else np.full(requests, s.budget), jnp.int32)
  ones_R = jnp.ones((requests,), jnp.int32)
  prefills, runs, fns = {}, {}, []
  for mode in s.engine:
    run = _engine(s, mode, *bench, eos_id, prompt_BxP, slots)
    fns += [_keeping(prefills, mode, run, ones_R), _keeping(runs, mode, run, budget_R)]
  if run_hf is not None:
    fns += [lambda: run_hf(1), lambda: run_hf(s.new_tokens)]
  return best_seconds(fns, s.repeats), runs


def _record(s: Settings, mode: str, out: Rollout, stats: EngineStats | None, lengths_R: np.ndarray, slots: int,
            prefill_s: float, decode_s: float) -> dict:
  """`mode`'s record of a point (`sweep`) but its roofline, from its run's Rollout and figures; raises
  RuntimeError if the run generated other lengths than asked."""
  requests = len(lengths_R)
  got_R = np.asarray(out.lengths_B)
  if not np.array_equal(got_R, lengths_R):
    wrong = got_R != lengths_R
    raise RuntimeError(f"{mode}: {int(wrong.sum())} of {requests} rows generated other lengths than asked, "
                       f"e.g. {got_R[wrong][:4].tolist()} tokens for {lengths_R[wrong][:4].tolist()}")
  stats = stats or static_stats(got_R, slots)
  record = dict(engine=mode, length_dist=s.length_dist or f"fixed:{s.new_tokens}", concurrency=slots,
                slots=slots, rollouts=requests, length_mean=float(lengths_R.mean()),
                length_max=int(lengths_R.max()), prefill_s=prefill_s, decode_s=decode_s,
                **_speeds(requests * s.prompt_len, lengths_R, stats.slot_steps / slots, prefill_s, decode_s),
                chunks=stats.chunks, slot_steps=stats.slot_steps, decoded=stats.decoded,
                useful_token_frac=stats.useful_token_frac,
                kv_cache_bytes=kv_cache_bytes(s, mode, requests, slots))
  if mode == "paged":
    record.update(page_size=s.page_size, pages=s.pages, preempted=stats.preempted, pages_peak=stats.pages_peak,
                  reprefill_s=stats.reprefill_s)
  return record


def _compare_hf(s: Settings, record: dict, out: Rollout, run_hf, lengths_R: np.ndarray, *, hf_prefill_s: float,
                hf_decode_s: float):
  """Adds Hugging Face's speeds (prefixed hf_), the speedups over them and, when greedy, hf_same_tokens."""
  prompt_tokens = len(lengths_R) * s.prompt_len
  record.update({f"hf_{k}": v for k, v in _speeds(prompt_tokens, lengths_R, s.new_tokens - 1, hf_prefill_s,
                                                   hf_decode_s).items()})
  record["decode_speedup_vs_hf"] = record["decode_tok_s"] / record["hf_decode_tok_s"]
  record["tok_s_speedup_vs_hf"] = record["tok_s"] / record["hf_tok_s"]
  if not s.temperature:  # (the forced EOS, if any, aside)
    same = run_hf(s.new_tokens)[:, s.prompt_len:].numpy() == np.asarray(out.tokens_BxN)[:, :s.new_tokens]
    record["hf_same_tokens"] = float(same[:, :s.new_tokens - 1].mean())


def _add_roofline(record: dict, cfg: ModelConfig, slots: int, live_len: float, rates: dict):
  """Adds the rates used, the step roofline at `live_len` and roofline_fraction."""
  record.update(bandwidth_bytes_per_s=rates["bandwidth_bytes_per_s"],
                matmul_flops_per_s=rates["matmul_flops_per_s"], live_len=live_len,
                **step_roofline(cfg, slots, live_len, rates))
  record["roofline_fraction"] = record["roofline_ms"] / record["decode_step_ms"]


def _compare_to_static(s: Settings, records: dict, runs: dict):
  """Adds to every record but the static one's, when the static engine ran at the point, its decode speedup and,
  when greedy, the fraction of token positions equal to the static engine's; to the partial records, when the
  continuous engine ran, decode_tok_s_vs_continuous."""
  for mode, record in records.items():
    if mode.startswith("partial") and "continuous" in records:
      record["decode_tok_s_vs_continuous"] = record["decode_tok_s"] / records["continuous"]["decode_tok_s"]
    if mode != "static" and "static" in records:
      record["decode_speedup_vs_static"] = record["decode_tok_s"] / records["static"]["decode_tok_s"]
      if not s.temperature:
        if mode in runs:
          same_RxN = np.asarray(runs[mode][0].tokens_BxN) == np.asarray(runs["static"][0].tokens_BxN)
          record["same_tokens_vs_static"] = float(same_RxN.mean())


def sweep(s: Settings) -> Iterator[dict]:
  """Measures each point of `s.points()` in turn; yields the report after each, one record per engine longer.

  The report: settings, the decode attention backend, device, `os.getloadavg()` at the start (load_avg) and after the
  last point (load_avg_end), num_params, num_active_params (a token's: k experts per MoE layer; = num_params when
  dense), the rates measured before the sweep (machine, `roofline.measure_machine`) and `results`, per point one
  record per engine: engine, length_dist (its spec; "fixed:new_tokens" without one), concurrency (= slots), slots,
  rollouts (requests), length_mean and length_max (of the responses), times in seconds (prefill_s, decode_s), speeds
  (`_speeds`), the engine's figures (chunks: host syncs, 0 for the static engine's single programs; slot_steps;
  decoded; useful_token_frac = decoded / slot_steps, `continuous.EngineStats`), kv_cache_bytes (`kv_cache_bytes`),
  the paged engine's page_size, pages, preempted, pages_peak and reprefill_s, the rates used, the step roofline
  (`roofline.step_roofline`) at live_len and roofline_fraction. For a mixture-of-experts model every record of a
  point (the partial one's too) also has the roofline's expected_distinct_experts (per MoE layer and decode step,
  under uniform routing) and the point's measured_distinct_experts (`measured_distinct_experts`, over the first
  engine's tokens; random routers route nearly uniformly, so the two should agree). On every engine's record but
  the static one's, when it was measured at the point, decode_speedup_vs_static and, when greedy,
  same_tokens_vs_static (the fraction of token positions equal). With compare_hf the same speeds of transformers
  prefixed hf_, decode_speedup_vs_hf, tok_s_speedup_vs_hf and, when greedy, hf_same_tokens (the fraction of the
  first new_tokens - 1 tokens that agree).
  With partial_budget, records "partial" and with carry_kv "partial_carry_kv" (`_partial_records`, carry_kv False
  and True), decode_tok_s_vs_continuous on them when the continuous engine ran.
  """
  _check(s)
  cfg = s.model_config()
  graphdef, params = random_params(cfg, s.seed)
  bench, eos_id = _bench_model(s, graphdef, params)
  machine = measure_machine(s.dtype, s.bandwidth_mb, s.matmul_size)
  hf_runner = _hf_runner(s, cfg, params)
  report = dict(settings=dataclasses.asdict(s), backend=resolved_backend(s.backend),
                device=str(jax.devices()[0]), load_avg=os.getloadavg(), num_params=cfg.num_params(),
                num_active_params=cfg.num_params(active=True), machine=machine, results=[])
  for requests, slots in s.points():
    prompt_BxP, lengths_R = _prompts(s, requests), _lengths(s, requests)
    run_hf = None if hf_runner is None else hf_runner(prompt_BxP)
    times, runs = _timed_runs(s, bench, eos_id, prompt_BxP, lengths_R, slots, run_hf)
    after = measure_machine(s.dtype, s.bandwidth_mb, s.matmul_size)
    rates = {k: max(v, machine[k]) for k, v in after.items()}  # the better of the measurements around the runs
    live_len = _live_len(s.prompt_len, lengths_R)
    records = {}
    for i, mode in enumerate(s.engine):
      prefill_s, decode_s = times[2 * i], times[2 * i + 1] - times[2 * i]
      records[mode] = _record(s, mode, *runs[mode], lengths_R, slots, prefill_s, decode_s)
      if run_hf is not None:
        _compare_hf(s, records[mode], runs[mode][0], run_hf, lengths_R, hf_prefill_s=times[-2],
                    hf_decode_s=times[-1] - times[-2])
      _add_roofline(records[mode], cfg, slots, live_len, rates)
    if s.partial_budget:
      records.update(_partial_records(s, *bench, eos_id, prompt_BxP, lengths_R, slots, live_len, rates))
    if cfg.num_experts:
      measured = measured_distinct_experts(nnx.merge(graphdef, params), prompt_BxP,
                                           np.asarray(runs[s.engine[0]][0].tokens_BxN), lengths_R, slots)
      for record in records.values():
        record["measured_distinct_experts"] = measured
    _compare_to_static(s, records, runs)
    report["results"] += records.values()
    report["load_avg_end"], machine = os.getloadavg(), after
    yield report
