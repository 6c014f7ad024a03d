#!/usr/bin/env bash
# Device checks for a lent GPU (sized for one H200, under 8 minutes):
#   1. tests/test_decode_attention.py and tests/test_paged_attention.py on the GPU: the slot-cache and paged decode
#      attention backends against their references, the Pallas kernels compiled by Triton, not interpreted
#      (JAXRL_PALLAS_INTERPRET=0; shapes Triton cannot compile are skipped);
#   2. the rollout sweep (launch/bench_rollout.py) with --backend=pallas, then --backend=xla, at a Qwen2.5-0.5B-like
#      bf16 shape (hidden 896, 24 layers, 14 query / 2 KV heads, head_dim 64, MLP 4864, vocab 151936, tied head);
#   3. the engine sweep at that shape (pallas): 512 requests of lognormal:128:1024 lengths on 64, then 256 slots, the
#      static engine (blocks run to their longest) against the continuous one (decode_speedup_vs_static) and the
#      continuous one on a paged cache of 4219 pages of 16, the memory of the 64-slot cache (at 256 slots it preempts);
#      one timed run each (~3 min estimated; the JSON is rewritten after each slot count, so a timeout still reports
#      64).
# Environment: JAX's CUDA 12 build and the test extra, `pip install -e '.[cuda,test]'` (the device machine reaches no
# package index: install where it does, or carry the environment).
# Logs and JSON go to $OUT (default ./gpu_out). Every step runs even if an earlier one failed; the exit status is
# non-zero if any failed.
#   OUT=/tmp/gpu_out bash launch/gpu_checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export JAX_PLATFORMS=cuda  # tests/conftest.py would otherwise pick the CPU
export PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME COMMAND...: prints and runs the command, its output teed to $OUT/NAME.log
  local name=$1
  shift
  echo "+ $*"
  if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
    echo "FAILED: $name"
    failed=1
  fi
}

step device python -c "import jax; print(jax.__version__, jax.devices())"
step kernel_tests env JAXRL_PALLAS_INTERPRET=0 timeout 240 python -m pytest -q -p no:cacheprovider \
  tests/test_decode_attention.py tests/test_paged_attention.py

QWEN_0_5B=(--d_model=896 --num_layers=24 --num_heads=14 --num_kv_heads=2 --head_dim=64 --d_ff=4864
           --vocab_size=151936 --tie_embeddings --dtype=bfloat16)
SWEEP=(--concurrency=1,4,16,64,256 --prompt_len=32 --new_tokens=64 --repeats=3 --bandwidth_mb=2048
       --matmul_size=8192)
for backend in pallas xla; do
  step "bench_$backend" timeout 150 python -m launch.bench_rollout "${QWEN_0_5B[@]}" "${SWEEP[@]}" \
    --backend="$backend" --out="$OUT/bench_$backend.json"
done
ENGINES=(--engine=static,continuous,paged --page_size=16 --pages=4219 --length_dist=lognormal:128:1024 --rollouts=512
         --slots=64,256 --chunk=16 --prompt_len=32 --repeats=1 --bandwidth_mb=2048 --matmul_size=8192)
step bench_engines timeout 300 python -m launch.bench_rollout "${QWEN_0_5B[@]}" "${ENGINES[@]}" --backend=pallas \
  --out="$OUT/bench_engines.json"
exit "$failed"
