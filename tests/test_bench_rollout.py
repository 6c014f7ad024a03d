"""launch.bench_rollout at a tiny shape: the report's fields over two concurrencies in the token-budget mode (forced
EOS, sampled), and, where torch and transformers are installed, the side-by-side with Hugging Face generate; the
static and continuous engines on long-tailed lengths (same tokens, the continuous one's slots busier) and on fixed
ones (no idle slot in one block); a mixture-of-experts model's distinct experts per step, measured against
expected; the length distributions and the settings refused; the step roofline against a hand count, dense and
MoE."""
import dataclasses
import json
import math

import numpy as np
import pytest

from jaxrl_batch.model import ModelConfig
from jaxrl_batch.sampling.benchmark import Settings, draw_lengths, sweep
from jaxrl_batch.sampling.roofline import expected_distinct_experts, step_roofline
from launch import bench_rollout

# One layer: the engines, the report and the roofline treat every layer alike (the MoE sweep's distinct experts, a
# mean over layers, keeps two).
TINY = Settings(concurrency=(1, 2), d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64,
                vocab_size=128, prompt_len=4, new_tokens=8, repeats=2, bandwidth_mb=4, matmul_size=64)
# Differences of two timings (decode = full run - prefill) can come out negative for a tiny model on a busy machine.
TIMED = ("decode_tok_s", "decode_step_ms", "roofline_fraction")
POSITIVE = ("prefill_tok_s", "tok_s", "weight_bytes", "kv_bytes", "flops", "memory_roofline_ms", "compute_roofline_ms",
            "roofline_ms")


ENGINES = {"engine": ("static", "continuous"), "chunk": 4, "repeats": 1}


def _check(report, out, concurrency):
  assert json.loads(out.read_text()) == json.loads(json.dumps(report))
  assert report["backend"] == "xla" and len(report["load_avg"]) == 3
  assert all(report["machine"][k] > 0 for k in ("bandwidth_bytes_per_s", "matmul_flops_per_s"))
  assert [r["concurrency"] for r in report["results"]] == list(concurrency)
  for record in report["results"]:
    assert all(record[k] > 0 for k in POSITIVE) and all(math.isfinite(record[k]) for k in TIMED), record


@pytest.mark.slow
def test_sweep_in_the_token_budget_mode(tmp_path):
  # max_len 32: a 28-token budget, EOS forced as the 8th token (run() checks every row's length); sampled.
  out = tmp_path / "bench.json"
  report = bench_rollout.run(Settings(**dict(vars(TINY), max_len=32, temperature=1.0)), str(out))
  _check(report, out, TINY.concurrency)
  one, two = report["results"]
  assert two["kv_bytes"] == 2 * one["kv_bytes"] and two["weight_bytes"] == one["weight_bytes"]


@pytest.mark.parity
def test_side_by_side_with_hugging_face(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  out = tmp_path / "bench.json"
  report = bench_rollout.run(Settings(**dict(vars(TINY), concurrency=(2,), compare_hf=True)), str(out))
  _check(report, out, (2,))
  record = report["results"][0]
  assert record["hf_prefill_tok_s"] > 0 and math.isfinite(record["decode_speedup_vs_hf"])
  assert record["hf_same_tokens"] == 1.0  # same weights, greedy: the same tokens


@pytest.mark.slow
def test_engines_on_long_tailed_lengths(tmp_path):
  # 16 requests on 4 slots: the static engine runs 4 blocks to their longest, the continuous one refills slots.
  out = tmp_path / "bench.json"
  s = dataclasses.replace(TINY, **ENGINES, length_dist="lognormal:6:24", rollouts=16, slots=(4,))
  report = bench_rollout.run(s, str(out))
  _check(report, out, (4, 4))
  static, continuous = report["results"]
  lengths = draw_lengths("lognormal:6:24", 16, TINY.seed)
  assert lengths.max() > 2 * lengths.min()  # long-tailed: blocks idle
  for record, engine in ((static, "static"), (continuous, "continuous")):
    assert record["engine"] == engine and record["length_dist"] == "lognormal:6:24"
    assert (record["slots"], record["rollouts"]) == (4, 16)
    assert (record["length_mean"], record["length_max"]) == (lengths.mean(), lengths.max())
    assert record["decoded"] == lengths.sum() - 16  # every token but each request's first
  assert static["chunks"] == 0 and continuous["chunks"] > 0
  assert continuous["same_tokens_vs_static"] == 1.0  # greedy, exact lengths: the same rollout
  assert static["slot_steps"] == sum(4 * (lengths[i:i + 4].max() - 1) for i in range(0, 16, 4))  # 4 blocks
  assert continuous["useful_token_frac"] > static["useful_token_frac"]
  assert continuous["slot_steps"] < static["slot_steps"] and continuous["slot_steps"] % 4 == 0
  assert math.isfinite(continuous["decode_speedup_vs_static"]) and "decode_speedup_vs_static" not in static


@pytest.mark.slow
def test_a_paged_cache_at_more_slots_in_less_memory(tmp_path):
  # 16 long-tailed requests: a pool of 8 pages of 4 slots holds 8 slots' sequences in less memory than the slot
  # cache of 4 (4 x 27 slots + the 16 prompts' prefix); at 8 slots it runs short and preempts, the same tokens.
  # kv_cache_bytes: (k, v) x 1 layer x slots x 2 kv heads x 8 x 4 bytes.
  out = tmp_path / "bench.json"
  s = dataclasses.replace(TINY, **dict(ENGINES, engine=("static", "continuous", "paged")),
                          length_dist="lognormal:6:24", rollouts=16, slots=(4, 8), page_size=4, pages=8)
  report = bench_rollout.run(s, str(out))
  _check(report, out, (4, 4, 4, 8, 8, 8))
  records = {(r["engine"], r["slots"]): r for r in report["results"]}
  paged = records["paged", 8]
  assert (paged["page_size"], paged["pages"]) == (4, 8) and paged["pages_peak"] <= 8 and paged["preempted"] > 0
  assert paged["same_tokens_vs_static"] == 1.0 and paged["reprefill_s"] > 0
  assert paged["kv_cache_bytes"] < records["continuous", 4]["kv_cache_bytes"] == 2 * 1 * (4 * 27 + 16 * 4) * 2 * 8 * 4
  assert records["continuous", 8]["kv_cache_bytes"] > records["continuous", 4]["kv_cache_bytes"]
  assert records["paged", 4]["kv_cache_bytes"] == paged["kv_cache_bytes"]


@pytest.mark.slow
def test_partial_rollouts_in_steady_state(tmp_path):
  # 48 long-tailed requests on 4 slots, steps of 6 decode steps: sequences are carried over and re-prefilled (or,
  # with carry_kv, kept in their slots), and the steady-state steps keep more of the slot-steps busy than the
  # static engine's blocks.
  out = tmp_path / "bench.json"
  s = dataclasses.replace(TINY, **ENGINES, length_dist="lognormal:6:24", rollouts=48, slots=(4,), partial_budget=6,
                          carry_kv=True)
  report = bench_rollout.run(s, str(out))
  static, _, partial, kept = report["results"]
  assert partial["engine"] == "partial" and partial["steady_steps"] > 0 and partial["carried_mean"] > 0
  assert kept["engine"] == "partial_carry_kv" and (partial["carry_kv"], kept["carry_kv"]) == (False, True)
  assert partial["reprefilled"] > 0 and partial["reprefill_s"] > 0
  assert kept["reprefilled"] == 0 and kept["reprefill_s"] == 0 and kept["carried_mean"] > 0
  for record in (partial, kept):
    assert record["useful_token_frac"] > static["useful_token_frac"]
    assert record["slot_steps"] % 4 == 0 and record["decoded"] <= record["slot_steps"]
    assert math.isfinite(record["decode_speedup_vs_static"]) and record["decode_tok_s"] > 0
    assert record["decode_tok_s_vs_continuous"] > 0


@pytest.mark.slow
def test_a_point_without_a_steady_state_step_is_refused(tmp_path):
  # 16 requests on 8 slots, steps of 6 decode steps: only the first step ends with requests still queued, and it
  # starts from empty slots with nothing carried in (not a steady state), so there is nothing to report. The partial
  # record alone refuses it: the continuous engine is the only other one measured.
  s = dataclasses.replace(TINY, **dict(ENGINES, engine=("continuous",)), length_dist="lognormal:6:24", rollouts=16,
                          slots=(8,), partial_budget=6)
  with pytest.raises(RuntimeError, match="no step of 16 requests on 8 slots after the first"):
    bench_rollout.run(s, str(tmp_path / "bench.json"))


@pytest.mark.slow
def test_fixed_lengths_leave_no_slot_idle(tmp_path):
  out = tmp_path / "bench.json"
  report = bench_rollout.run(dataclasses.replace(TINY, **ENGINES, concurrency=(3,), length_dist="fixed:6"), str(out))
  _check(report, out, (3, 3))
  for record in report["results"]:  # one block of 3 rows, 5 decode steps
    assert (record["rollouts"], record["length_mean"], record["decoded"]) == (3, 6, 15), record
    assert record["useful_token_frac"] == 1.0 and record["live_len"] == TINY.prompt_len + 3


@pytest.mark.slow
def test_moe_sweep_measures_the_experts_a_step_reads(tmp_path):
  # 16 experts, 2 a token: random routers route nearly uniformly, so the distinct experts the decode steps' rows
  # chose match E (1 - (1 - k / E)^c): 2 at c = 1 (exactly), 3.75 at 2, 10.5 at 8.
  out = tmp_path / "bench.json"
  s = dataclasses.replace(TINY, num_layers=2, concurrency=(1, 2, 8), num_experts=16, num_experts_per_tok=2,
                          moe_d_ff=16)
  report = bench_rollout.run(s, str(out))
  _check(report, out, (1, 2, 8))
  assert report["num_active_params"] < report["num_params"]
  one, two, eight = report["results"]
  assert one["measured_distinct_experts"] == one["expected_distinct_experts"] == 2
  for record in (two, eight):
    assert record["measured_distinct_experts"] == pytest.approx(record["expected_distinct_experts"], rel=0.15)
  assert one["weight_bytes"] < two["weight_bytes"] < eight["weight_bytes"]  # more rows, more experts read
  dense = bench_rollout.run(dataclasses.replace(TINY, concurrency=(1,)), str(out))
  assert "measured_distinct_experts" not in dense["results"][0] and dense["num_active_params"] == dense["num_params"]


def test_expected_distinct_experts():
  assert expected_distinct_experts(8, 2, 1) == pytest.approx(2)  # one token: its k
  assert expected_distinct_experts(8, 2, 2) == pytest.approx(8 * (1 - (6 / 8) ** 2)) == pytest.approx(3.5)
  assert expected_distinct_experts(8, 2, 3) == pytest.approx(8 * 37 / 64)  # 8 (1 - 27/64) = 4.625
  assert expected_distinct_experts(8, 2, 200) == pytest.approx(8)  # many tokens: every expert
  assert expected_distinct_experts(4, 4, 1) == 4  # k = E: all of them


def test_length_distributions():
  fixed = draw_lengths("fixed:7", 5, 0)
  assert fixed.tolist() == [7] * 5
  lognormal = draw_lengths("lognormal:50:100000", 20000, 0)
  np.testing.assert_array_equal(lognormal, draw_lengths("lognormal:50:100000", 20000, 0))  # seeded
  assert lognormal.mean() == pytest.approx(50, rel=0.05) and lognormal.min() >= 1  # the mean before clipping
  clipped = draw_lengths("lognormal:50:60", 20000, 0)
  assert clipped.max() == 60 and clipped.mean() < lognormal.mean()


@pytest.mark.parametrize("change", [{"rollouts": 8}, {"slots": (2,)}, {"engine": ("slots",)},
                                    {"engine": ("static", "static")}, {"length_dist": "lognormal:5"},
                                    {"length_dist": "fixed:1"}, {"rollouts": 6, "slots": (4,)},
                                    {"length_dist": "fixed:4", "compare_hf": True}, {"partial_budget": 4},
                                    {"engine": ("paged",), "page_size": 0}, {"carry_kv": True}])
def test_settings_refused(change):
  with pytest.raises(ValueError):
    next(sweep(dataclasses.replace(TINY, **change)))


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
  assert "expected_distinct_experts" not in roofline


def test_step_roofline_reads_the_experts_routed_to():
  # Layer 0 MoE (4 experts of 3*8*6 = 144 params, 2 a token, router 8*4 = 32), layer 1 dense (MLP 3*8*16 = 384);
  # attention and norms as above, tied head 800. Dense weights: 2*(192 + 16) + 32 + 384 + 8 + 800 = 1640.
  cfg = ModelConfig(vocab_size=100, d_model=8, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2, d_ff=16,
                    num_experts=4, num_experts_per_tok=2, moe_d_ff=6, mlp_only_layers=(1,))
  machine = dict(bandwidth_bytes_per_s=1e6, matmul_flops_per_s=1e7)
  two = step_roofline(cfg, batch=2, live_len=10.0, machine=machine)
  assert two["expected_distinct_experts"] == pytest.approx(3)  # 4 (1 - (1/2)^2)
  assert two["weight_bytes"] == pytest.approx(4 * (1640 + 3 * 144))
  assert two["flops"] == 2 * (1640 + 2 * 144) * 2 + 4 * 2 * 2 * 4 * 2 * 10  # active: 2 experts a token
  assert two["kv_bytes"] == 4 * 2 * 2 * 2 * 10 * 2 * 2
  assert two["memory_roofline_ms"] == pytest.approx(1e3 * (two["weight_bytes"] + two["kv_bytes"]) / 1e6)
  one = step_roofline(cfg, batch=1, live_len=10.0, machine=machine)  # one token reads its active parameters
  assert one["weight_bytes"] == pytest.approx(4 * cfg.num_params(active=True)) == pytest.approx(4 * 1928)
  many = step_roofline(cfg, batch=1000, live_len=10.0, machine=machine)  # and many rows read every expert
  assert many["weight_bytes"] == pytest.approx(4 * cfg.num_params())
