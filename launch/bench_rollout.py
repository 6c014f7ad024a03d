r"""Rollout throughput of the static and continuous engines (`sampling.rollout`): prefill and decode speed vs
concurrency and response-length distribution, against the roofline.

  python -m launch.bench_rollout                          # reference CPU shape, concurrency 1..64, static engine
  python -m launch.bench_rollout --concurrency=1,8,64 --compare_hf
  python -m launch.bench_rollout --concurrency=8 --max_len=4096 --out=/tmp/bench_4096.json
  python -m launch.bench_rollout --engine=static,continuous --length_dist=lognormal:128:1024 --rollouts=512 \
    --slots=64 --prompt_len=16 --out=/tmp/bench_engines.json   # 512 long-tailed requests on 64 slots
  python -m launch.bench_rollout --engine=static,continuous --length_dist=lognormal:128:1024 --rollouts=512 \
    --slots=64 --prompt_len=16 --partial_budget=128   # + partial rollouts in steady state, 128 decode steps a step
  python -m launch.bench_rollout --engine=continuous --length_dist=lognormal:128:1024 --rollouts=512 --slots=64 \
    --prompt_len=16 --partial_budget=128 --carry_kv   # partial rollouts re-prefilled vs keeping their KV cache
  python -m launch.bench_rollout --num_experts=64 --num_experts_per_tok=8 --moe_d_ff=256 --concurrency=1,8,64 \
    --out=/tmp/bench_moe.json   # MoE, k x moe_d_ff = d_ff: experts read vs rows
  python -m launch.bench_rollout --engine=continuous,paged --length_dist=lognormal:128:1024 --rollouts=512 \
    --slots=64,256 --prompt_len=16 --page_size=16 --pages=4155   # 256 slots paged in the memory of 64 slots

Random weights (N(0, 0.02), unit norm scales); prompts of --prompt_len random tokens; exactly --new_tokens tokens per
row. With --max_len above prompt_len + new_tokens the token budget is max_len - prompt_len and the model is forced to
emit EOS as its --new_tokens-th token, so the decode cost should stay that of --new_tokens tokens. With
--length_dist each request stops exactly at its own length drawn from it (`benchmark.draw_lengths`: lognormal of
sigma 1 whose mean before clipping to [1, MAX] is MEAN; the record gives the drawn lengths' mean and max).

Each point decodes R requests on S slots, once per --engine (one record each): R = S = each --concurrency, or R =
--rollouts on each of --slots; the static engine in blocks of S rows run to their longest response, the continuous
one keeping S sequences in flight (--chunk decode steps per host sync), the paged one doing so over a pool of
--pages pages of --page_size slots (its records' kv_cache_bytes against the others' give the memory). What is timed
and how the roofline is computed: docs/results/2026-12-06-engine-notes.md and `jaxrl_batch.sampling.roofline`.
--compare_hf runs transformers' `generate` (torch, imported only then) on the same weights
(`jaxrl_batch.hf.side_by_side`).

Writes --out (JSON, rewritten after each point, so a sweep cut short still reports): the settings, the machine's load
(`os.getloadavg()` at the start and end), the rates measured before the sweep (`machine`), and per point one record
per engine (`benchmark.sweep`), the continuous engine's with decode_speedup_vs_static; with --partial_budget one
"partial" record more (`sampling.steady_state`), and with --carry_kv a "partial_carry_kv" one (carried sequences keep
their KV cache; both with decode_tok_s_vs_continuous when the continuous engine ran). With --num_experts (a
mixture-of-experts model) the records also give the distinct experts a decode step reads per MoE layer, expected
under uniform routing and measured.
"""
import dataclasses
import json

from absl import app, flags, logging

from jaxrl_batch.sampling.benchmark import MODES, Settings, sweep
from launch import list_flags, logs

flags.DEFINE_list("concurrency", ["1", "2", "4", "8", "16", "32", "64"],
                  "Rows decoded together, one point each (without --rollouts).")
flags.DEFINE_list("engine", ["static"], f"Engines measured at each point, one record each: of {MODES}.")
list_flags.integers("concurrency", 1, "rows decoded together", "1,8,64")
list_flags.choices("engine", MODES)
flags.DEFINE_integer("chunk", 16, "Decode steps per host sync of the continuous engine.")
flags.DEFINE_string("length_dist", "", "Response lengths: 'fixed:N' or 'lognormal:MEAN:MAX' ('' = --new_tokens).")
flags.DEFINE_integer("rollouts", 0, "Requests per point, decoded on each of --slots (0 = --concurrency).")
flags.DEFINE_list("slots", [], "Slots of each point with --rollouts (replacing --concurrency).")
list_flags.integers("slots", 1, "slots of a point", "8,32")
flags.DEFINE_integer("partial_budget", 0, "> 0: also emulate partial rollouts in steady state, this many decode "
                     "steps per RL step (needs --length_dist and --rollouts).")
flags.DEFINE_bool("carry_kv", False, "With --partial_budget: also partial rollouts whose carried sequences keep "
                  "their slots' KV cache (record partial_carry_kv), taking turns with the re-prefilling ones.")
flags.DEFINE_integer("page_size", 16, "The paged engine's slots per page.")
flags.DEFINE_integer("pages", 0, "The paged engine's growable pages (0 = every slot at the longest response).")
flags.DEFINE_integer("d_model", 768, "Model width D.")
flags.DEFINE_integer("num_layers", 8, "Decoder blocks L.")
flags.DEFINE_integer("num_heads", 12, "Query heads N.")
flags.DEFINE_integer("num_kv_heads", 4, "Key/value heads K.")
flags.DEFINE_integer("head_dim", 64, "Head width H.")
flags.DEFINE_integer("d_ff", 2048, "SwiGLU hidden width F.")
flags.DEFINE_integer("num_experts", 0, "Experts E of every layer's mixture-of-experts MLP (0 = dense).")
flags.DEFINE_integer("num_experts_per_tok", 0, "Experts k each token is routed to (with --num_experts).")
flags.DEFINE_integer("moe_d_ff", 0, "Hidden width of one expert (with --num_experts).")
flags.DEFINE_integer("vocab_size", 32000, "Vocabulary V.")
flags.DEFINE_bool("tie_embeddings", False, "Reuse the embedding table as the output head.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and activation dtype.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per row (without --length_dist).")
flags.DEFINE_integer("max_len", 0, "Cache length: prompt_len + token budget (0 = prompt_len + longest response).")
flags.DEFINE_integer("group_size", 1, "Rows per distinct prompt, prefilled once (generate's group_size).")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
flags.DEFINE_enum("backend", "auto", ["auto", "xla", "pallas"], "Decode attention backend.")
flags.DEFINE_bool("compare_hf", False, "Also time Hugging Face transformers' generate (torch) on the same weights.")
flags.DEFINE_integer("repeats", 3, "Timed runs per measurement (the best is kept).")
flags.DEFINE_integer("bandwidth_mb", 512, "Array size of the memory bandwidth measurement.")
flags.DEFINE_integer("matmul_size", 2048, "Side of the square matmul of the FLOP rate measurement.")
flags.DEFINE_integer("seed", 0, "Seed of the weights, prompts and lengths.")
flags.DEFINE_string("out", "bench_rollout.json", "Output JSON path.")


def settings_from_flags() -> Settings:
  values = {f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(Settings)}
  return Settings(**dict(values, concurrency=tuple(int(b) for b in values["concurrency"]),
                         engine=tuple(values["engine"]), slots=tuple(int(s) for s in values["slots"])))


def run(s: Settings, out: str) -> dict:
  """Sweeps `s.points()`, writing the report to `out` after every point; returns it."""
  report, logged = {}, 0
  for report in sweep(s):
    for record in report["results"][logged:]:
      logging.info("%s S=%d R=%d %s", record["engine"], record["slots"], record["rollouts"],
                   " ".join(f"{k}={v:.4g}" for k, v in record.items() if isinstance(v, float)))
    logged = len(report["results"])
    with open(out, "w") as f:
      json.dump(report, f, indent=2)
  return report


def main(argv):
  del argv
  logs.setup()
  report = run(settings_from_flags(), flags.FLAGS.out)
  logging.info("Wrote %s (%d records, load %s).", flags.FLAGS.out, len(report["results"]), report["load_avg"])


if __name__ == "__main__":
  app.run(main)
