#!/usr/bin/env bash
# The GPU session in few calls (device time is scarce). Results land in $OUT.
#   scripts/fetch_device_wheels.sh        # here, once: the packages the GPU machine lacks
#   device run: bash benchmarks/h200_run.sh PHASE...   (carry .whl)
# Phases, run in the order given:
#   graph-tests   the decode-graph GPU tests (fast)
#   gpu-tests     every `pytest -m gpu` test
#   bench-SHAPE   `vtllm bench all` (decode graphs) and `vtllm bench latency --enforce-eager`
#                 for SHAPE qwen3-0.6b or llama3-8b
#   hf-SHAPE      the transformers `generate` baseline on the same shape and prompts
#   profile       benchmarks/profile_decode.py: one worker's decode step, batch 1 and 64
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VT_CACHE_DIR=/tmp/vtcache
if [ ! -s "$OUT/device.txt" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' >> "$OUT/device.txt"
fi
BENCH="--input-len 32 --output-len 128 --num-iters 3 --num-prompts 256 --max-num-seqs 256 --max-num-batched-tokens 8192"
for phase in "$@"; do
  echo "== $phase $(date +%T)"
  case $phase in
    graph-tests)
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -k graphs \
        tests/worker/test_gpu_worker.py >> "$OUT/gpu_tests.txt" 2>&1 ;;
    gpu-tests)
      timeout 420 python3 -m pytest -m gpu -q -rP -p no:cacheprovider --durations=15 tests/worker tests/test_boundaries.py \
        >> "$OUT/gpu_tests.txt" 2>&1 ;;
    bench-*)
      shape=${phase#bench-}
      timeout 150 python3 -m vtllm.cli bench all --model-shape "$shape" $BENCH \
        >> "$OUT/bench.jsonl" 2>> "$OUT/bench_$shape.log"
      timeout 60 python3 -m vtllm.cli bench latency --model-shape "$shape" $BENCH \
        --enforce-eager --no-roofline >> "$OUT/bench.jsonl" 2>> "$OUT/bench_${shape}_eager.log" ;;
    hf-*)
      shape=${phase#hf-}
      timeout 240 python3 benchmarks/hf_baseline.py --model-shape "$shape" all --num-prompts 256 \
        >> "$OUT/bench.jsonl" 2>> "$OUT/hf_$shape.log" ;;
    profile)
      for args in "--batch 1" "--batch 1 --eager" "--batch 64"; do
        timeout 60 python3 benchmarks/profile_decode.py $args >> "$OUT/profile.txt" 2>&1
      done ;;
    *) echo "unknown phase $phase" ;;
  esac
  tail -3 "$OUT/gpu_tests.txt" 2>/dev/null
done
cat "$OUT/bench.jsonl" 2>/dev/null
