r"""Rollout throughput vs concurrency: prefill and decode speed of `sampling.generate`, against the roofline.

  python -m launch.bench_rollout                          # reference CPU shape, concurrency 1..64
  python -m launch.bench_rollout --concurrency=1,8,64 --compare_hf
  python -m launch.bench_rollout --concurrency=8 --max_len=4096 --out=/tmp/bench_4096.json

Random weights (N(0, 0.02), unit norm scales); prompts of --prompt_len random tokens; exactly --new_tokens tokens per
row (the EOS id is one the model cannot produce). With --max_len above prompt_len + new_tokens the token budget is
max_len - prompt_len and the model is forced to emit EOS as its --new_tokens-th token, so the same tokens are
generated under a larger budget: the decode cost should follow the tokens generated, not the budget.

Per concurrency B (rows decoded together): the prefill time is that of a run with one new token, the decode time
the rest of a full run; each is the best of --repeats timed runs after a compiling one (other processes on a shared
machine only slow runs down), the runs compared (ours and Hugging Face's) taking turns. The roofline of one decode
step is the larger of
  bytes read (every weight once, the embedding table only when tied, + the live KV cache at the mean live length)
      / the measured memory bandwidth (the better of an array copy, read + write, and a read-only sum),
  FLOPs (2 x matmul weights x B + attention at the mean live length) / a measured square matmul rate;
the rates are measured before the sweep and after each concurrency, and a record uses the better of the two
around its runs (other processes on the machine swing both by tens of percent);
`roofline_fraction` = roofline ms / measured ms (1.0 = at the roofline). --compare_hf runs transformers' `generate`
(torch, imported only then) on the same weights, exported with `jaxrl_batch.hf.save_pretrained`.

Writes --out (JSON, rewritten after each concurrency): the settings, the machine's load (`os.getloadavg()` at the
start and end), the rates measured before the sweep (`machine`), and one record per concurrency.
"""
import dataclasses
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from jaxrl_batch import sharding
from jaxrl_batch.model import ModelConfig, Transformer
from jaxrl_batch.sampling import SamplingParams, generate
from launch import logs

flags.DEFINE_list("concurrency", ["1", "2", "4", "8", "16", "32", "64"], "Rows decoded together, one run each.")
flags.DEFINE_integer("d_model", 768, "Model width D.")
flags.DEFINE_integer("num_layers", 8, "Decoder blocks L.")
flags.DEFINE_integer("num_heads", 12, "Query heads N.")
flags.DEFINE_integer("num_kv_heads", 4, "Key/value heads K.")
flags.DEFINE_integer("head_dim", 64, "Head width H.")
flags.DEFINE_integer("d_ff", 2048, "SwiGLU hidden width F.")
flags.DEFINE_integer("vocab_size", 32000, "Vocabulary V.")
flags.DEFINE_bool("tie_embeddings", False, "Reuse the embedding table as the output head.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and activation dtype.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per row.")
flags.DEFINE_integer("max_len", 0, "Cache length: prompt_len + token budget (0 = prompt_len + new_tokens).")
flags.DEFINE_integer("group_size", 1, "Rows per distinct prompt, prefilled once (generate's group_size).")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
flags.DEFINE_enum("backend", "auto", ["auto", "xla", "pallas"], "Decode attention backend.")
flags.DEFINE_bool("compare_hf", False, "Also time Hugging Face transformers' generate (torch) on the same weights.")
flags.DEFINE_integer("repeats", 3, "Timed runs per measurement (the best is kept).")
flags.DEFINE_integer("bandwidth_mb", 512, "Array size of the memory bandwidth measurement.")
flags.DEFINE_integer("matmul_size", 2048, "Side of the square matmul of the FLOP rate measurement.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and prompts.")
flags.DEFINE_string("out", "bench_rollout.json", "Output JSON path.")


@dataclasses.dataclass(frozen=True)
class Settings:
  """One benchmark run; fields as the flags of the same names."""

  concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
  d_model: int = 768
  num_layers: int = 8
  num_heads: int = 12
  num_kv_heads: int = 4
  head_dim: int = 64
  d_ff: int = 2048
  vocab_size: int = 32000
  tie_embeddings: bool = False
  dtype: str = "float32"
  prompt_len: int = 32
  new_tokens: int = 64
  max_len: int = 0
  group_size: int = 1
  temperature: float = 0.0
  backend: str = "auto"
  compare_hf: bool = False
  repeats: int = 3
  bandwidth_mb: int = 512
  matmul_size: int = 2048
  seed: int = 0

  @classmethod
  def from_flags(cls) -> "Settings":
    values = {f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(cls)}
    return cls(**dict(values, concurrency=tuple(int(b) for b in values["concurrency"])))

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

  def hidden(self, *args):
    return self.model.hidden(*args)

  def logits(self, hidden_BxTxD):  # the prefill's last position, < `position`
    return self._force(self.model.logits(hidden_BxTxD), jnp.zeros(hidden_BxTxD.shape[:2], bool))

  def __call__(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=None):
    logits_BxTxV, cache = self.model(tokens_BxT, positions_BxT, mask_BxTxS, cache, cache_index)
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


def best_seconds(fns, repeats: int) -> list[float]:
  """Best wall time of each of `fns` (blocking on its result) over `repeats` rounds that call each once in turn,
  after one untimed call each: interleaved, the runs compared see the same load."""
  for fn in fns:
    jax.block_until_ready(fn())
  times = [[] for _ in fns]
  for _ in range(repeats):
    for fn, fn_times in zip(fns, times):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      fn_times.append(time.perf_counter() - start)
  return [min(t) for t in times]


def measure_machine(s: Settings) -> dict:
  """Memory bandwidth (bytes/s) and matmul rate (FLOP/s) of the default device, in the compute dtype; the best of
  many runs, so that other processes on the machine bias them little."""
  dtype = jnp.dtype(s.dtype)
  x = jnp.ones((s.bandwidth_mb << 20) // dtype.itemsize, dtype)
  copy, read = jax.jit(lambda x: x + 1), jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  copy_s, read_s = best_seconds([lambda: copy(x), lambda: read(x)], 20)
  m = jnp.ones((s.matmul_size, s.matmul_size), dtype)
  matmul = jax.jit(lambda a: a @ a)
  matmul_s, = best_seconds([lambda: matmul(m)], 10)
  return dict(copy_bytes_per_s=2 * x.nbytes / copy_s, read_bytes_per_s=x.nbytes / read_s,
              bandwidth_bytes_per_s=max(2 * x.nbytes / copy_s, x.nbytes / read_s),
              matmul_flops_per_s=2 * s.matmul_size**3 / matmul_s)


def step_roofline(cfg: ModelConfig, batch: int, live_len: float, machine: dict) -> dict:
  """Bytes, FLOPs and the roofline time of one decode step of `batch` rows at mean live cache length `live_len`."""
  weights = cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)  # gathered rows only
  weight_bytes = weights * cfg.weight_dtype.itemsize
  kv_bytes = 2 * cfg.num_layers * batch * live_len * cfg.num_kv_heads * cfg.head_dim * cfg.compute_dtype.itemsize
  flops = 2 * weights * batch + 4 * cfg.num_layers * batch * cfg.num_heads * cfg.head_dim * live_len
  memory_s = (weight_bytes + kv_bytes) / machine["bandwidth_bytes_per_s"]
  compute_s = flops / machine["matmul_flops_per_s"]
  return dict(weight_bytes=weight_bytes, kv_bytes=kv_bytes, flops=flops, memory_roofline_ms=1e3 * memory_s,
              compute_roofline_ms=1e3 * compute_s, roofline_ms=1e3 * max(memory_s, compute_s))


def _prompts(s: Settings, batch: int) -> np.ndarray:
  """(batch, prompt_len) random token ids, each distinct prompt repeated group_size times."""
  rng = np.random.default_rng(s.seed + batch)
  return np.repeat(rng.integers(0, s.vocab_size, (batch // s.group_size, s.prompt_len)), s.group_size, axis=0)


def ours(s: Settings, graphdef, params, eos_id: int, batch: int):
  """`run(max_new_tokens)` -> Rollout of `generate` on `batch` rows."""
  prompt_BxP = jnp.asarray(_prompts(s, batch), jnp.int32)
  valid_BxP = jnp.ones_like(prompt_BxP, bool)
  sampling = SamplingParams(temperature=s.temperature, attention_backend=s.backend)

  def run(max_new_tokens):
    return generate(graphdef, params, prompt_BxP, valid_BxP, jax.random.key(s.seed), max_new_tokens=max_new_tokens,
                    eos_id=eos_id, pad_id=0, sampling=sampling, group_size=s.group_size)

  return run


def hf_model(cfg: ModelConfig, params):
  """transformers' model on our weights (via a temporary Hugging Face directory), in eval mode."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from jaxrl_batch.hf import save_pretrained  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as hf_dir:
    save_pretrained(cfg, params, hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, cfg.dtype))
  model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
  return model.eval()


def theirs(s: Settings, model, batch: int):
  """`run(max_new_tokens)` -> tokens (prompt included) of transformers' `generate` on `batch` rows."""
  import torch  # pylint: disable=import-outside-toplevel
  prompt = torch.as_tensor(_prompts(s, batch))
  sample = dict(do_sample=True, temperature=s.temperature, top_k=None, top_p=None) if s.temperature else dict(
      do_sample=False)

  def run(max_new_tokens):
    with torch.inference_mode():
      return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                            pad_token_id=0, **sample)

  return run


def _speeds(s: Settings, batch: int, prefill_s: float, decode_s: float) -> dict:
  steps = s.new_tokens - 1
  return dict(prefill_tok_s=batch * s.prompt_len / prefill_s, decode_tok_s=batch * steps / decode_s,
              decode_step_ms=1e3 * decode_s / steps, tok_s=batch * s.new_tokens / (prefill_s + decode_s))


def run(s: Settings, out: str) -> dict:
  """Sweeps `s.concurrency`; writes and returns the report."""
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
  machine = measure_machine(s)
  hf = hf_model(cfg, params) if s.compare_hf else None
  report = dict(settings=dataclasses.asdict(s), backend=SamplingParams(attention_backend=s.backend).backend,
                device=str(jax.devices()[0]), load_avg=os.getloadavg(), num_params=cfg.num_params(),
                machine=machine, results=[])
  live_len = s.prompt_len + s.new_tokens / 2  # mean over the decode steps of the slots attended
  for batch in s.concurrency:
    run_ours = ours(s, bench_graphdef, bench_params, eos_id, batch)
    fns = [lambda: run_ours(1), lambda: run_ours(s.budget)]
    if hf is not None:
      run_hf = theirs(s, hf, batch)
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
    after = measure_machine(s)
    rates = {k: max(v, machine[k]) for k, v in after.items()}  # the better of the measurements around the runs
    record.update(bandwidth_bytes_per_s=rates["bandwidth_bytes_per_s"], matmul_flops_per_s=rates["matmul_flops_per_s"],
                  **step_roofline(cfg, batch, live_len, rates))
    record["roofline_fraction"] = record["roofline_ms"] / record["decode_step_ms"]
    logging.info("B=%d %s", batch, " ".join(f"{k}={v:.4g}" for k, v in record.items() if isinstance(v, float)))
    report["results"].append(record)
    report["load_avg_end"], machine = os.getloadavg(), after
    with open(out, "w") as f:  # after every concurrency: a sweep cut short still reports
      json.dump(report, f, indent=2)
  return report


def main(argv):
  del argv
  logs.setup()
  report = run(Settings.from_flags(), flags.FLAGS.out)
  logging.info("Wrote %s (%d concurrencies, load %s).", flags.FLAGS.out, len(report["results"]), report["load_avg"])


if __name__ == "__main__":
  app.run(main)
