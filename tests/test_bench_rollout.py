"""launch.bench_rollout at a tiny shape: the report's fields over two concurrencies in the token-budget mode (forced
EOS, sampled), and, where torch and transformers are installed, the side-by-side with Hugging Face generate; the
step roofline against a hand count."""
import json
import math

import pytest

from jaxrl_batch.model import ModelConfig
from jaxrl_batch.sampling.benchmark import Settings
from jaxrl_batch.sampling.roofline import step_roofline
from launch import bench_rollout

TINY = Settings(concurrency=(1, 2), d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64,
                vocab_size=128, prompt_len=4, new_tokens=8, repeats=2, bandwidth_mb=4, matmul_size=64)
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
  report = bench_rollout.run(Settings(**dict(vars(TINY), max_len=32, temperature=1.0)), str(out))
  _check(report, out, TINY.concurrency)
  one, two = report["results"]
  assert two["kv_bytes"] == 2 * one["kv_bytes"] and two["weight_bytes"] == one["weight_bytes"]


def test_side_by_side_with_hugging_face(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  out = tmp_path / "bench.json"
  report = bench_rollout.run(Settings(**dict(vars(TINY), concurrency=(2,), compare_hf=True)), str(out))
  _check(report, out, (2,))
  record = report["results"][0]
  assert record["hf_prefill_tok_s"] > 0 and math.isfinite(record["decode_speedup_vs_hf"])
  assert record["hf_same_tokens"] == 1.0  # same weights, greedy: the same tokens


@pytest.mark.parametrize("tied", [False, True])
def test_step_roofline_counts_bytes_and_flops(tied):
  cfg = ModelConfig(vocab_size=100, d_model=8, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2, d_ff=16,
                    tie_embeddings=tied)
  # Per block: wq 8*4*2 + wk, wv 8*2*2 each + wo 4*2*8 = 192, MLP 3*8*16 = 384, two norms 16; a final norm 8; and
  # 800 for the head: the tied embedding, or the untied head (whose embedding rows are gathered, not read whole).
  weights = 2 * (192 + 384 + 16) + 8 + 800
  roofline = step_roofline(cfg, batch=3, live_len=10.0,
                           machine=dict(bandwidth_bytes_per_s=1e6, matmul_flops_per_s=1e7))
  assert roofline["weight_bytes"] == 4 * weights  # float32
  assert roofline["kv_bytes"] == 4 * 2 * 2 * 3 * 10 * 2 * 2  # bytes x (k, v) x layers x rows x slots x K x H
  assert roofline["flops"] == 2 * weights * 3 + 4 * 2 * 3 * 4 * 2 * 10  # matmuls + (q.k, p.v) x L x B x N x H x S
  assert roofline["memory_roofline_ms"] == pytest.approx(1e3 * (roofline["weight_bytes"] + roofline["kv_bytes"]) / 1e6)
  assert roofline["compute_roofline_ms"] == pytest.approx(1e3 * roofline["flops"] / 1e7)
  assert roofline["roofline_ms"] == max(roofline["memory_roofline_ms"], roofline["compute_roofline_ms"])
