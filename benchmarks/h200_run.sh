#!/usr/bin/env bash
# The GPU session in one call (device time is scarce): install the carried wheels, run the
# GPU worker tests, then `vtllm bench all` and the transformers baseline for the
# Qwen3-0.6B and Llama-3-8B shapes (random bf16 weights). Results land in $OUT.
#   scripts/fetch_device_wheels.sh   # here, once: the packages the GPU machine lacks
#   device run: bash benchmarks/h200_run.sh   (carry .whl)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VT_CACHE_DIR=/tmp/vtcache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' >> "$OUT/device.txt"
timeout 45 python3 -m pytest -m gpu -q -p no:cacheprovider tests/worker/test_gpu_worker.py \
  > "$OUT/gpu_tests.txt" 2>&1
BENCH="--input-len 32 --output-len 128 --num-iters 3 --num-prompts 256 --max-num-seqs 256 --max-num-batched-tokens 8192"
for shape in qwen3-0.6b llama3-8b; do
  timeout 110 python3 -m vtllm.cli bench all --model-shape $shape $BENCH \
    >> "$OUT/bench.jsonl" 2>> "$OUT/bench_$shape.log"
  timeout 50 python3 benchmarks/hf_baseline.py --model-shape $shape all --num-prompts 32 \
    >> "$OUT/bench.jsonl" 2>> "$OUT/hf_$shape.log"
done
cat "$OUT/bench.jsonl"
