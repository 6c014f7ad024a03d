"""Rollout throughput vs concurrency: prefill and decode speed of `generate` on random weights, against the roofline.

Prompts of `prompt_len` random tokens; exactly `new_tokens` tokens per row (the EOS id is one the model cannot
produce). With `max_len` above prompt_len + new_tokens the token budget is max_len - prompt_len and the model is
forced to emit EOS as its new_tokens-th token (`EosAt`), so the same tokens are generated under a larger budget: the
decode cost should follow the tokens generated, not the budget.

Per concurrency B (rows decoded together): the prefill time is that of a run with one new token, the decode time
the rest of a full run; each is the best of `repeats` timed runs after a compiling one, the runs compared (ours and,
with `compare_hf`, Hugging Face's) taking turns (`roofline.best_seconds`). The device's rates are measured before
the sweep and after each concurrency, and a record's roofline (`roofline.step_roofline`, at the mean live length
prompt_len + new_tokens / 2) uses the better of the two around its runs: other processes on the machine swing both
by tens of percent. `roofline_fraction` = roofline ms / measured ms per decode step (1.0 = at the roofline).
"""
import dataclasses
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_batch.model import ModelConfig, Transformer
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling.generate import generate
from jaxrl_batch.sampling.roofline import best_seconds, measure_machine, step_roofline
from jaxrl_batch.sampling.strategies import SamplingParams


@dataclasses.dataclass(frozen=True)
class Settings:
  """One benchmark run (the flags of `launch.bench_rollout`)."""

  concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # rows decoded together, one measurement each
  d_model: int = 768
  num_layers: int = 8
  num_heads: int = 12
  num_kv_heads: int = 4
  head_dim: int = 64
  d_ff: int = 2048
  vocab_size: int = 32000
  tie_embeddings: bool = False
  dtype: str = "float32"  # parameters and activations
  prompt_len: int = 32  # tokens per prompt
  new_tokens: int = 64  # tokens generated per row
  max_len: int = 0  # cache slots: prompt_len + token budget (0 = prompt_len + new_tokens)
  group_size: int = 1  # rows per distinct prompt, prefilled once (generate's group_size)
  temperature: float = 0.0  # 0 = greedy
  backend: str = "auto"  # SamplingParams.attention_backend
  compare_hf: bool = False  # also time transformers' generate (torch) on the same weights
  repeats: int = 3  # timed runs per measurement, the best kept
  bandwidth_mb: int = 512  # MiB, array of the bandwidth measurement
  matmul_size: int = 2048  # side of the square matmul of the FLOP rate measurement
  seed: int = 0  # of the weights and prompts

  def model_config(self) -> ModelConfig:
    return ModelConfig(vocab_size=self.vocab_size, d_model=self.d_model, num_layers=self.num_layers,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                       d_ff=self.d_ff, tie_embeddings=self.tie_embeddings, dtype=self.dtype,
                       param_dtype=self.dtype)

  @property
  def budget(self) -> int:
    """max_new_tokens passed to generate."""
    return max(self.max_len - self.prompt_len, self.new_tokens)


class EosAt(nnx.Module):
  """`model` that chooses `eos_id` exactly at RoPE position `position` and at no earlier position: its logits there
  put all mass on EOS and elsewhere none."""

  def __init__(self, model: Transformer, eos_id: int, position: int):
    self.model, self.cfg, self.eos_id, self.position = model, model.cfg, eos_id, position

  def _force(self, logits_BxTxV, at_BxT):
    is_eos_V = jnp.arange(logits_BxTxV.shape[-1]) == self.eos_id
    only_eos_V = jnp.where(is_eos_V, 0.0, -1e30)
    return jnp.where(at_BxT[..., None], only_eos_V, jnp.where(is_eos_V, -1e30, logits_BxTxV))

  def hidden(self, *args, **kwargs):
    return self.model.hidden(*args, **kwargs)

  def logits(self, hidden_BxTxD):  # the prefill's last position, < `position`
    return self._force(self.model.logits(hidden_BxTxD), jnp.zeros(hidden_BxTxD.shape[:2], bool))

  def __call__(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=None, decode_backend=None):
    logits_BxTxV, cache = self.model(tokens_BxT, positions_BxT, mask_BxTxS, cache, cache_index, decode_backend)
    return self._force(logits_BxTxV, positions_BxT >= self.position), cache


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


def _ours(s: Settings, graphdef, params, eos_id: int, prompt_BxP: np.ndarray):
  """`run(max_new_tokens)` -> Rollout of `generate` on the unpadded prompts."""
  prompt_BxP = jnp.asarray(prompt_BxP, jnp.int32)
  valid_BxP = jnp.ones_like(prompt_BxP, bool)
  sampling = SamplingParams(temperature=s.temperature, attention_backend=s.backend)

  def run(max_new_tokens):
    return generate(graphdef, params, prompt_BxP, valid_BxP, jax.random.key(s.seed), max_new_tokens=max_new_tokens,
                    eos_id=eos_id, pad_id=0, sampling=sampling, group_size=s.group_size)

  return run


def _speeds(s: Settings, batch: int, prefill_s: float, decode_s: float) -> dict[str, float]:
  """Tokens per second of the prefill, the decode and the whole rollout, and ms per decode step."""
  steps = s.new_tokens - 1
  return dict(prefill_tok_s=batch * s.prompt_len / prefill_s, decode_tok_s=batch * steps / decode_s,
              decode_step_ms=1e3 * decode_s / steps, tok_s=batch * s.new_tokens / (prefill_s + decode_s))


def sweep(s: Settings) -> Iterator[dict]:
  """Measures each of `s.concurrency` in turn; yields the report after each, one record longer each time.

  The report: settings, the decode attention backend, device, `os.getloadavg()` at the start (load_avg) and after the
  last record (load_avg_end), num_params, the rates measured before the sweep (machine, `roofline.measure_machine`)
  and `results`, one record per concurrency: times in seconds (prefill_s, decode_s), speeds (`_speeds`), the rates
  used, the step roofline (`roofline.step_roofline`) and roofline_fraction; with compare_hf the same speeds of
  transformers prefixed hf_, decode_speedup_vs_hf, tok_s_speedup_vs_hf and, when greedy, hf_same_tokens (the
  fraction of the first new_tokens - 1 tokens that agree).
  """
  if s.new_tokens < 2:
    raise ValueError(f"new_tokens={s.new_tokens}: at least 2 (one decode step) are needed.")
  if s.max_len and s.max_len < s.prompt_len + s.new_tokens:
    raise ValueError(f"max_len={s.max_len} is below prompt_len + new_tokens = {s.prompt_len + s.new_tokens}.")
  if any(b % s.group_size for b in s.concurrency):
    raise ValueError(f"every concurrency must be a multiple of group_size={s.group_size}.")
  cfg = s.model_config()
  graphdef, params = random_params(cfg, s.seed)
  if s.budget > s.new_tokens:  # EOS as the new_tokens-th token: chosen from position prompt_len + new_tokens - 2
    eos_id = s.vocab_size - 1
    model = EosAt(nnx.merge(graphdef, params), eos_id, s.prompt_len + s.new_tokens - 2)
  else:  # no EOS: an id the model cannot produce
    eos_id, model = s.vocab_size, nnx.merge(graphdef, params)
  bench_graphdef, bench_params = nnx.split(model)
  machine = measure_machine(s.dtype, s.bandwidth_mb, s.matmul_size)
  hf = None
  if s.compare_hf:
    from jaxrl_batch.hf import side_by_side  # pylint: disable=import-outside-toplevel  (the hf extra: safetensors)
    hf = side_by_side.hf_model(cfg, params)
  report = dict(settings=dataclasses.asdict(s), backend=SamplingParams(attention_backend=s.backend).backend,
                device=str(jax.devices()[0]), load_avg=os.getloadavg(), num_params=cfg.num_params(),
                machine=machine, results=[])
  live_len = s.prompt_len + s.new_tokens / 2  # mean over the decode steps of the slots attended
  for batch in s.concurrency:
    prompt_BxP = _prompts(s, batch)
    run_ours = _ours(s, bench_graphdef, bench_params, eos_id, prompt_BxP)
    fns = [lambda: run_ours(1), lambda: run_ours(s.budget)]
    if hf is not None:
      run_hf = side_by_side.hf_generate(hf, prompt_BxP, s.temperature)
      fns += [lambda: run_hf(1), lambda: run_hf(s.new_tokens)]
    times = best_seconds(fns, s.repeats)
    rollout = run_ours(s.budget)
    lengths_B = np.asarray(rollout.lengths_B)
    if not (lengths_B == s.new_tokens).all():
      raise RuntimeError(f"rows generated {sorted(set(lengths_B.tolist()))} tokens, not {s.new_tokens}")
    prefill_s, decode_s = times[0], times[1] - times[0]
    record = dict(concurrency=batch, prefill_s=prefill_s, decode_s=decode_s, **_speeds(s, batch, prefill_s, decode_s))
    if hf is not None:
      hf_prefill_s, hf_decode_s = times[2], times[3] - times[2]
      record.update({f"hf_{k}": v for k, v in _speeds(s, batch, hf_prefill_s, hf_decode_s).items()})
      record["decode_speedup_vs_hf"] = record["decode_tok_s"] / record["hf_decode_tok_s"]
      record["tok_s_speedup_vs_hf"] = record["tok_s"] / record["hf_tok_s"]
      if not s.temperature:  # (the forced EOS, if any, aside)
        same = run_hf(s.new_tokens)[:, s.prompt_len:].numpy() == np.asarray(rollout.tokens_BxN)[:, :s.new_tokens]
        record["hf_same_tokens"] = float(same[:, :s.new_tokens - 1].mean())
    after = measure_machine(s.dtype, s.bandwidth_mb, s.matmul_size)
    rates = {k: max(v, machine[k]) for k, v in after.items()}  # the better of the measurements around the runs
    record.update(bandwidth_bytes_per_s=rates["bandwidth_bytes_per_s"], matmul_flops_per_s=rates["matmul_flops_per_s"],
                  **step_roofline(cfg, batch, live_len, rates))
    record["roofline_fraction"] = record["roofline_ms"] / record["decode_step_ms"]
    report["results"].append(record)
    report["load_avg_end"], machine = os.getloadavg(), after
    yield report
