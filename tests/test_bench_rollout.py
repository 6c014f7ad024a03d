"""launch.bench_rollout at a tiny shape: the report's fields over two concurrencies in the token-budget mode (forced
EOS, sampled), and, where torch and transformers are installed, the side-by-side with Hugging Face generate."""
import json
import math

import pytest

from launch import bench_rollout

TINY = bench_rollout.Settings(concurrency=(1, 2), d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                              d_ff=64, vocab_size=128, prompt_len=4, new_tokens=8, repeats=2, bandwidth_mb=4,
                              matmul_size=64)
# Differences of two timings (decode = full run - prefill) can come out negative for a tiny model on a busy machine.
TIMED = ("decode_tok_s", "decode_step_ms", "roofline_fraction")
POSITIVE = ("prefill_tok_s", "tok_s", "weight_bytes", "kv_bytes", "flops", "memory_roofline_ms", "compute_roofline_ms",
            "roofline_ms")


def _check(report, out, concurrency):
  assert json.loads(out.read_text()) == json.loads(json.dumps(report))
  assert report["backend"] == "xla" and len(report["load_avg"]) == 3
  assert all(report["machine"][k] > 0 for k in ("bandwidth_bytes_per_s", "matmul_flops_per_s"))
  assert [r["concurrency"] for r in report["results"]] == list(concurrency)
  for record in report["results"]:
    assert all(record[k] > 0 for k in POSITIVE) and all(math.isfinite(record[k]) for k in TIMED), record


def test_sweep_in_the_token_budget_mode(tmp_path):
  # max_len 32: a 28-token budget, EOS forced as the 8th token (run() checks every row's length); sampled.
  out = tmp_path / "bench.json"
  report = bench_rollout.run(bench_rollout.Settings(**dict(vars(TINY), max_len=32, temperature=1.0)), str(out))
  _check(report, out, TINY.concurrency)
  one, two = report["results"]
  assert two["kv_bytes"] == 2 * one["kv_bytes"] and two["weight_bytes"] == one["weight_bytes"]


def test_side_by_side_with_hugging_face(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  out = tmp_path / "bench.json"
  report = bench_rollout.run(bench_rollout.Settings(**dict(vars(TINY), concurrency=(2,), compare_hf=True)), str(out))
  _check(report, out, (2,))
  record = report["results"][0]
  assert record["hf_prefill_tok_s"] > 0 and math.isfinite(record["decode_speedup_vs_hf"])
  assert record["hf_same_tokens"] == 1.0  # same weights, greedy: the same tokens
