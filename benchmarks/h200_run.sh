#!/usr/bin/env bash
# The GPU session in few calls (device time is scarce). Results land in $OUT.
#   scripts/fetch_device_wheels.sh        # here, once: the packages the GPU machine lacks
#   device run: bash benchmarks/h200_run.sh PHASE...   (carry .whl)
# Phases, run in the order given:
#   graph-tests   the decode-graph GPU tests (fast)
#   gpu-tests     every `pytest -m gpu` test (the memory-measuring modules alone, then the
#                 rest over $GPU_TEST_WORKERS xdist processes, default 6, 4 under 100 GiB; ~4-6 min)
#   gpu-subset    the GPU tests named in $GPU_TESTS (pytest arguments; $GPU_SUBSET_TIMEOUT s)
#   load-tests    weights to the GPU with the host RSS peak: a 1.6 GiB safetensors checkpoint
#                 and a 16 GiB random model (tests/worker/test_weight_streaming.py)
#   bench-SHAPE   `vtllm bench all` (decode graphs) and `vtllm bench latency --enforce-eager`
#                 for SHAPE qwen3-0.6b or llama3-8b
#   hf-SHAPE      the transformers `generate` baseline on the same shape and prompts (MoE
#                 shapes: the first 32 of the 256 throughput prompts; HF's experts are slow)
#   tprofile-SHAPE  profile_decode.py --kernels on SHAPE at batch 256, 768-token prompts
#                 (a decode step of the throughput rows, ~800 keys a request), plus
#                 $TPROFILE_FLAGS (e.g. "--kv-cache-dtype fp8")
#   profile       benchmarks/profile_decode.py: one worker's decode step, batch 1 and 64
# Mixtures of experts (random weights; two engine start-ups a shape, each run at most 140 s):
#   bench-qwen3-30b-a3b, bench-gemma4-26b-moe   `vtllm bench all` (batch-1 latency, roofline
#                 over the experts a step touches; 256 prompts, in/out lengths uniform in
#                 [100, 1024]) in bf16, then again with `--quantization fp8` (skipped with a
#                 message where this tree has no such flag; a shape missing from MODEL_SHAPES
#                 is skipped too)
#   async-SHAPE   `vtllm bench latency` (batch 1, decode graphs) without, then with
#                 --async-scheduling (skipped where this tree has no such flag)
#   prefill-SHAPE `vtllm bench prefill`: one 8,000-token prompt, seconds and TFLOP/s against a
#                 matmul of the model's widest linear at 8,000 rows in the same run; in one
#                 step (--long-prefill-token-threshold 0), then in the default's 512-token chunks
#   attn          benchmarks/attention_kernel.py, the default tiles only (both shapes)
#   attn-splits   benchmarks/attention_kernel.py --splits: batch-1/8 decodes at 160 to 8192
#                 keys over KV split counts 1-32 (device graphs), beside the launcher's pick
#   ab-attn       the decode attention alone, this tree against $BASE_TREE (this tree's
#                 attention_kernel.py copied there): --splits --split-counts 1 8 on the
#                 Qwen3-0.6B, -30B-A3B and Llama-3-8B shapes at 1x160, 1x1024, 256x1024,
#                 plus $AB_ATTN_FLAGS (e.g. "--decode-prefetch on --cold-l2": as served)
#   attn-prefetch the decode attention with and without its shorter chain of loads
#                 (paged_attention.DECODE_PREFETCH, on by default): --splits --split-counts 1 8
#                 --decode-prefetch both on three shapes at 1x160, 1x1024, 256x1024, 64x4096
#   attn-fp8kv    the decode attention over a bf16 and an e4m3 KV cache (--splits
#                 --split-counts 1 8 --kv-cache-dtypes bf16 fp8; GB/s of K/V moved) on the
#                 Llama-3-8B and Qwen3-0.6B shapes at 256x1024, 64x4096, 1x1024
#   attn-mixed    the decode attention over batches of mixed lengths like the throughput row's
#                 decode steps (256 x 200-1124 keys early on, 24 x 1050-1974 near the end),
#                 Llama-3-8B shape, bf16 and e4m3 caches, 1/2/4 splits, sequences in drawn
#                 order and longest first (--splits --decode-prefetch on --longest-first both)
#   attn-cold     the decode attention with L2 evicted before each call (--cold-l2), as in a
#                 model: the served default (--splits --split-counts 1 --decode-prefetch
#                 on), then the tile sweep (--sweep --no-prefill), bf16 and e4m3 caches,
#                 Llama-3-8B shape at 256 x 768 and 96 x 800-1724 keys
#   attn-sweep-fp8  the decode tiles over an e4m3 KV cache (--sweep --no-prefill
#                 --kv-cache-dtypes fp8 --fp8-fp16-operands both; the bf16 default beside)
#                 on the Llama-3-8B shape at 256x1024 and 64x4096, Qwen3-0.6B's at 256x1024
#   attn-sweep    benchmarks/attention_kernel.py: the paged-attention kernel's launch
#                 configurations on the Llama-3-8B shape (8k prefill vs torch SDPA, decodes)
#   cold-tput-SHAPE  tput-SHAPE over an empty Triton cache (a fresh TRITON_CACHE_DIR): the
#                 worker's compile lines ("Triton at start-up", "a step waited") beside the
#                 first step-log lines of the warm-up and of the timed requests (tp-*);
#                 then again warm over the cache the cold run filled; with $BASE_TREE,
#                 that tree's cold run first (over an empty cache of its own)
#   tput-SHAPE    `vtllm bench throughput` alone (256 prompts [100, 1024]), default flags plus
#                 $TPUT_FLAGS (e.g. "--kv-cache-dtype fp8")
#   ab-latency-SHAPE, ab-throughput-SHAPE  `vtllm bench latency|throughput` from this tree
#                 and from $BASE_TREE (an unpacked older tree), alternating, $AB_ROUNDS
#                 (default 2) runs each, with $AB_FLAGS added (e.g. "--quantization fp8")
#   w8a8-throughput-SHAPE  `vtllm bench throughput --quantization fp8` (MoE shapes, 256 prompts
#                 [100, 1024]) with VT_MOE_FP8_ACTIVATIONS=off (w8a16), then auto (w8a8)
#   async-throughput-SHAPE  the same for `vtllm bench throughput` (256 prompts)
#   moe-kernel    benchmarks/fused_moe_kernel.py: the fused-MoE kernel vs its torch reference
#   moe-sweep     its --sweep: decode-path launch configurations at 1, 4, 16 tokens, and the
#                 routed layer with the routing kernel vs torch routing ($MOE_SWEEP_TOKENS)
#   moe-sweep-fp8 the same over e4m3 experts with row scales (--quantization fp8)
#   router-sweep  its --sweep-router: the fused router-and-routing kernel's launch
#                 configurations at 1 and 8 tokens vs the router GEMM + routing kernel
#   moe-gemm-sweep  its --sweep-gemm: grouped-GEMM launch configurations at 256, 64, 1024
#                 and 8192 tokens
#   moe-gemm-sweep-w8a8  its --sweep-gemm --fp8 (w8a8) with row, then 128x128 block scales,
#                 at $MOE_GEMM_TOKENS (default "256 8192")
#   moe-w8a8      its --w8a8: the grouped GEMMs over bf16, w8a16 and w8a8 (e4m3 activations)
#                 experts, per-row and 128x128 block scales, at 256, 1024 and 8192 tokens
#   gemv-sweep    benchmarks/gemv_kernel.py --sweep: the small-batch GEMV's launch
#                 configurations against cuBLAS at one row, per dense shape of
#                 $GEMV_SWEEP_SHAPES (default Qwen3-0.6B, Llama-3-8B and Qwen3-30B-A3B)
#   gemv-pdl      benchmarks/gemv_kernel.py --pdl: the fused chain's GEMVs a layer, plain
#                 vs programmatic dependent launch (Hopper)
#   gemv-fp8      benchmarks/gemv_kernel.py --fp8: the GEMV on e4m3 weights with row scales
#                 against the FP8 Triton kernel, 1 and 4 rows (Qwen3-30B-A3B, Llama-3-8B)
#   fp8-sweep     benchmarks/fp8_decode.py --sweep 1: dense FP8 launch configurations at one token
#   kernels-b1    benchmarks/fp8_decode.py --kernels-only: qkv / o / MoE layer at one token,
#                 bf16 vs FP8
#   kprofile-SHAPE  profile_decode.py --kernels on SHAPE at batch 1 with graphs: the device
#                 kernels of a step, largest first
#   moe-gpu-tests the GPU tests of the MoE and FP8 kernels and layers
# HTTP vs offline on one shape (random weights, a synthetic tokenizer over the whole
# vocabulary: benchmarks/http_model_dir.py), issue 13's workloads:
#   http-smollm2-135m  1,024 requests, 110 in / 256 out (~3 min: 4 engine start-ups)
#   http-llama3-8b     512 requests, 210 in / 512 out (~5 min: run it in a call of its own)
#                 `vtllm bench throughput` (offline), then `vtllm bench serve` at 256 streams
#                 against `vtllm serve --api-server-count N` for N in $HTTP_API_SERVERS
#                 (default "1 2 4"); with .devtools/py-spy (carried), the N=1 frontend is
#                 sampled for 15 s (raw stacks in $OUT/http_prof_SHAPE.txt)
# One device call of at most 8 minutes (timeouts 2 x 140 + 130 + 50 s, plus the install):
#   bench-qwen3-30b-a3b hf-qwen3-30b-a3b moe-kernel   (then the same for gemma4-26b-moe)
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
MOE_BENCH="$BENCH --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096"
MOE_SHAPES=" qwen3-30b-a3b gemma4-26b-moe "
GPU_MEMORY_TESTS="tests/worker/test_gpu_worker.py tests/worker/test_gpu_fp8_kv_cache.py tests/worker/test_weight_streaming.py"
has_shape() { python3 -c "import sys; from vtllm.bench import MODEL_SHAPES; sys.exit('$1' not in MODEL_SHAPES)"; }
for phase in "$@"; do
  echo "== $phase $(date +%T)"
  case $phase in
    graph-tests)
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -k graphs \
        tests/worker/test_gpu_worker.py >> "$OUT/gpu_tests.txt" 2>&1 ;;
    gpu-subset)
      timeout ${GPU_SUBSET_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider --durations=10 \
        $GPU_TESTS >> "$OUT/gpu_tests.txt" 2>&1 ;;
    load-tests)
      timeout 150 python3 -m pytest -m gpu -q -rP -p no:cacheprovider \
        tests/worker/test_weight_streaming.py >> "$OUT/gpu_tests.txt" 2>&1 ;;
    gpu-tests)
      # The modules that measure device memory (worker start-up budgets, FP8 KV capacity,
      # weight streaming) run alone first; every other GPU test then runs spread over
      # $GPU_TEST_WORKERS pytest-xdist processes on the one GPU (Triton compiles on the CPU
      # cores, which is where a serial run spends most of its time).
      suite_start=$(date +%s)
      timeout 240 python3 -m pytest -m gpu -q -rP -p no:cacheprovider --durations=10 \
        $GPU_MEMORY_TESTS >> "$OUT/gpu_tests.txt" 2>&1
      echo "serial part: rc=$? $(( $(date +%s) - suite_start )) s" | tee -a "$OUT/gpu_tests.txt"
      # 6 workers fit an H200; on 80 GB the realistic MoE layers of two workers at once
      # ran out of memory (session 27), so 4 there
      gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      workers=${GPU_TEST_WORKERS:-$([ "${gpu_mib:-0}" -ge 100000 ] && echo 6 || echo 4)}
      timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 \
        -n "$workers" --dist load tests/worker tests/test_boundaries.py \
        $(printf -- ' --ignore=%s' $GPU_MEMORY_TESTS) >> "$OUT/gpu_tests.txt" 2>&1
      echo "GPU suite: rc=$? $(( $(date +%s) - suite_start )) s in all" | tee -a "$OUT/gpu_tests.txt" ;;
    bench-qwen3-30b-a3b|bench-gemma4-26b-moe)
      shape=${phase#bench-}
      if ! has_shape "$shape"; then echo "skip $phase: no $shape in MODEL_SHAPES"; continue; fi
      timeout 140 python3 -m vtllm.cli bench all --model-shape "$shape" $MOE_BENCH \
        >> "$OUT/bench.jsonl" 2>> "$OUT/bench_$shape.log"
      grep -E "loaded |weights: |memory: |captured" "$OUT/bench_$shape.log" | tail -5
      if python3 -m vtllm.cli bench all --help 2>/dev/null | grep -q -- "--quantization"; then
        timeout 140 python3 -m vtllm.cli bench all --model-shape "$shape" $MOE_BENCH \
          --quantization fp8 >> "$OUT/bench.jsonl" 2>> "$OUT/bench_${shape}_fp8.log"
        grep -E "loaded |weights: |memory: " "$OUT/bench_${shape}_fp8.log" | tail -4
      else
        echo "skip $shape fp8: this tree's vtllm has no --quantization flag"
      fi ;;
    bench-*)
      shape=${phase#bench-}
      timeout 150 python3 -m vtllm.cli bench all --model-shape "$shape" $BENCH \
        >> "$OUT/bench.jsonl" 2>> "$OUT/bench_$shape.log"
      timeout 60 python3 -m vtllm.cli bench latency --model-shape "$shape" $BENCH \
        --enforce-eager --no-roofline >> "$OUT/bench.jsonl" 2>> "$OUT/bench_${shape}_eager.log" ;;
    hf-*)
      shape=${phase#hf-}
      prompts=256; limit=240
      case $MOE_SHAPES in *" $shape "*) prompts=32; limit=130 ;; esac
      if ! has_shape "$shape"; then echo "skip $phase: no $shape in MODEL_SHAPES"; continue; fi
      timeout $limit python3 benchmarks/hf_baseline.py --model-shape "$shape" all \
        --num-prompts $prompts >> "$OUT/bench.jsonl" 2>> "$OUT/hf_$shape.log" ;;
    attn)
      timeout 90 python3 benchmarks/attention_kernel.py >> "$OUT/attention.jsonl" 2>> "$OUT/attention.log"
      grep -E '"default": true|sdpa' "$OUT/attention.jsonl" ;;
    attn-splits)
      timeout 240 python3 benchmarks/attention_kernel.py --splits --shapes qwen3-0.6b qwen3-30b-a3b \
        --decode 1x160 1x1024 1x8192 8x1024 >> "$OUT/attn_splits.jsonl" 2>> "$OUT/attn_splits.log"
      cut -c1-200 "$OUT/attn_splits.jsonl"; tail -3 "$OUT/attn_splits.log" ;;
    attn-fp8kv)
      timeout 240 python3 benchmarks/attention_kernel.py --splits --split-counts 1 8 \
        --shapes llama3-8b qwen3-0.6b --decode 256x1024 64x4096 1x1024 \
        --kv-cache-dtypes bf16 fp8 >> "$OUT/attn_fp8kv.jsonl" 2>> "$OUT/attn_fp8kv.log"
      cut -c1-230 "$OUT/attn_fp8kv.jsonl"; tail -3 "$OUT/attn_fp8kv.log" ;;
    ab-attn)
      if [ ! -d "${BASE_TREE:-}" ]; then echo "skip $phase: no \$BASE_TREE"; continue; fi
      cp benchmarks/attention_kernel.py "$BASE_TREE/benchmarks/"
      for tree in new base; do
        dir=$PWD; [ $tree = base ] && dir=$(cd "$BASE_TREE" && pwd)
        PYTHONPATH=/tmp/site:$dir timeout 100 python3 "$dir/benchmarks/attention_kernel.py" \
          --splits --split-counts 1 8 --shapes qwen3-0.6b qwen3-30b-a3b llama3-8b \
          --decode 1x160 1x1024 256x1024 ${AB_ATTN_FLAGS:-} 2>> "$OUT/ab_attn.log" | sed "s/^/$tree /" \
          | tee -a "$OUT/ab_attn.txt" | cut -c1-170
      done ;;
    attn-prefetch)
      timeout 200 python3 benchmarks/attention_kernel.py --splits --split-counts 1 8 \
        --decode-prefetch both --shapes qwen3-0.6b qwen3-30b-a3b llama3-8b \
        --decode 1x160 1x1024 256x1024 64x4096 >> "$OUT/attn_prefetch.jsonl" 2>> "$OUT/attn_prefetch.log"
      cut -c1-190 "$OUT/attn_prefetch.jsonl"; tail -3 "$OUT/attn_prefetch.log" ;;
    attn-mixed)
      timeout 200 python3 benchmarks/attention_kernel.py --splits --split-counts 1 2 4 \
        --decode-prefetch on --longest-first both --kv-cache-dtypes bf16 fp8 --shapes llama3-8b \
        --decode 256x200-1124 168x500-1424 96x800-1724 24x1050-1974 256x768 \
        >> "$OUT/attn_mixed.jsonl" 2>> "$OUT/attn_mixed.log"
      cut -c1-260 "$OUT/attn_mixed.jsonl"; tail -3 "$OUT/attn_mixed.log" ;;
    attn-cold)
      for mode in "--splits --split-counts 1 --decode-prefetch on" "--sweep --no-prefill"; do
        timeout 200 python3 benchmarks/attention_kernel.py $mode --cold-l2 --shapes llama3-8b \
          --kv-cache-dtypes bf16 fp8 --decode 256x768 96x800-1724 \
          >> "$OUT/attn_cold.jsonl" 2>> "$OUT/attn_cold.log"
      done
      cut -c1-230 "$OUT/attn_cold.jsonl"; tail -3 "$OUT/attn_cold.log" ;;
    attn-sweep-fp8)
      for shape in llama3-8b qwen3-0.6b; do
        decodes="256x1024 64x4096"; [ $shape = qwen3-0.6b ] && decodes="256x1024"
        timeout 200 python3 benchmarks/attention_kernel.py --no-prefill --shapes $shape \
          --decode $decodes >> "$OUT/attn_sweep_fp8.jsonl" 2>> "$OUT/attn_sweep_fp8.log"
        timeout 300 python3 benchmarks/attention_kernel.py --sweep --no-prefill --shapes $shape \
          --decode $decodes --kv-cache-dtypes fp8 --fp8-fp16-operands both \
          >> "$OUT/attn_sweep_fp8.jsonl" 2>> "$OUT/attn_sweep_fp8.log"
      done
      grep -v searched "$OUT/attn_sweep_fp8.jsonl" | cut -c1-200; tail -3 "$OUT/attn_sweep_fp8.log" ;;
    attn-sweep)
      timeout 240 python3 benchmarks/attention_kernel.py --sweep --shapes llama3-8b \
        >> "$OUT/attention.jsonl" 2>> "$OUT/attention.log"
      timeout 60 python3 benchmarks/attention_kernel.py --shapes qwen3-0.6b \
        >> "$OUT/attention.jsonl" 2>> "$OUT/attention.log"
      grep -E '"default": true|sdpa' "$OUT/attention.jsonl" ;;
    cold-tput-*)
      # with $BASE_TREE: that tree first, then this one, each over its own empty cache
      shape=${phase#cold-tput-}
      trees=new; [ -d "${BASE_TREE:-}" ] && trees="base new"
      for tree in $trees; do
        dir=$PWD; [ $tree = base ] && dir=$(cd "$BASE_TREE" && pwd)
        cache=$(mktemp -d)
        runs=cold; [ $tree = new ] && runs="cold warm"  # warm: again over the cache cold filled
        for run in $runs; do
          log="$OUT/${run}_tput_${shape}_$tree.log"
          (cd "$dir" && PYTHONPATH=/tmp/site:$dir TRITON_CACHE_DIR=$cache timeout 200 \
            python3 -m vtllm.cli bench throughput --model-shape "$shape" $BENCH ${TPUT_FLAGS:-} \
            2>> "$log" | tail -1 | sed "s/^/$run $tree /") | tee -a "$OUT/cold.jsonl"
          { grep -m1 'request=warm-' "$log"; grep -m1 'request=tp-' "$log"
            grep -E "Triton at start-up|a step waited" "$log"; } | sort | cut -c1-400 | head -40
        done
      done ;;
    tput-*)
      shape=${phase#tput-}
      timeout 150 python3 -m vtllm.cli bench throughput --model-shape "$shape" $BENCH \
        ${TPUT_FLAGS:-} >> "$OUT/bench.jsonl" 2>> "$OUT/tput_$shape.log"
      tail -1 "$OUT/bench.jsonl" ;;
    prefill-*)
      shape=${phase#prefill-}
      for threshold in 0 512; do  # the prompt in one step, then in the serve default's chunks
        timeout 120 python3 -m vtllm.cli bench prefill --model-shape "$shape" --input-len 8000 \
          --num-iters 5 --max-num-batched-tokens 8192 --long-prefill-token-threshold $threshold \
          >> "$OUT/bench.jsonl" 2>> "$OUT/prefill_$shape.log"
        tail -1 "$OUT/bench.jsonl"
      done ;;
    ab-latency-*|ab-throughput-*)
      # this tree against $BASE_TREE (e.g. `mkdir oldtree && git archive main | tar -x -C
      # oldtree` here; it travels with the working tree), alternating on one warm GPU
      kind=${phase#ab-}; shape=${kind#*-}; kind=${kind%%-*}
      if [ ! -d "${BASE_TREE:-}" ]; then echo "skip $phase: no \$BASE_TREE"; continue; fi
      for tree in $(for _ in $(seq ${AB_ROUNDS:-2}); do echo new base; done); do
        dir=$PWD; [ $tree = base ] && dir=$(cd "$BASE_TREE" && pwd)
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 150 python3 -m vtllm.cli bench $kind \
          --model-shape "$shape" $BENCH ${AB_FLAGS:-} 2>> "$OUT/ab_${kind}_${shape}_$tree.log" | tail -1 \
          | sed "s/^/$tree /") | tee -a "$OUT/ab.jsonl"
      done ;;
    w8a8-throughput-*)
      # FP8 experts offline (256 prompts [100, 1024]): w8a16 grouped GEMMs, then w8a8
      shape=${phase#w8a8-throughput-}
      for mode in off auto; do
        VT_MOE_FP8_ACTIVATIONS=$mode timeout 170 python3 -m vtllm.cli bench throughput \
          --model-shape "$shape" $MOE_BENCH --quantization fp8 \
          2>> "$OUT/w8a8_throughput_${shape}_$mode.log" | tail -1 | sed "s/^/$mode /" | tee -a "$OUT/w8a8.jsonl"
      done ;;
    async-throughput-*)
      shape=${phase#async-throughput-}
      for flag in --no-async-scheduling --async-scheduling; do  # same call: sync first, then async
        timeout 120 python3 -m vtllm.cli bench throughput --model-shape "$shape" $BENCH $flag \
          >> "$OUT/bench.jsonl" 2>> "$OUT/async_throughput_$shape.log"
        tail -1 "$OUT/bench.jsonl"
      done ;;
    async-*)
      shape=${phase#async-}
      if ! has_shape "$shape"; then echo "skip $phase: no $shape in MODEL_SHAPES"; continue; fi
      if ! python3 -m vtllm.cli bench latency --help 2>/dev/null | grep -q -- "--async-scheduling"; then
        echo "skip $phase: this tree has no --async-scheduling"; continue
      fi
      for flag in --no-async-scheduling --async-scheduling; do  # same call: sync first, then async
        timeout 120 python3 -m vtllm.cli bench latency --model-shape "$shape" $BENCH $flag \
          >> "$OUT/bench.jsonl" 2>> "$OUT/async_$shape.log"
        tail -1 "$OUT/bench.jsonl"
      done ;;
    moe-kernel)
      timeout 50 python3 benchmarks/fused_moe_kernel.py >> "$OUT/moe_kernel.jsonl" 2>&1
      tail -8 "$OUT/moe_kernel.jsonl" ;;
    moe-sweep|moe-sweep-fp8)
      fp8=; [ $phase = moe-sweep-fp8 ] && fp8=--fp8
      timeout 240 python3 benchmarks/fused_moe_kernel.py --sweep $fp8 --tokens ${MOE_SWEEP_TOKENS:-1 4 16} \
        >> "$OUT/$phase.jsonl" 2>> "$OUT/$phase.log"
      grep -E '"default": true|layer_with' "$OUT/$phase.jsonl"
      python3 -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]
rows = sorted((r for r in rows if isinstance(r.get('us'), float)), key=lambda r: r['us'])
print('fastest:', *rows[:5], sep='\n')" "$OUT/$phase.jsonl" ;;
    router-sweep)
      timeout 200 python3 benchmarks/fused_moe_kernel.py --sweep-router --tokens 1 8 \
        >> "$OUT/router_sweep.jsonl" 2>> "$OUT/router_sweep.log"
      grep -E '"default": true|route"|fused"' "$OUT/router_sweep.jsonl"; tail -3 "$OUT/router_sweep.log"
      python3 -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]
for t in sorted({r['tokens'] for r in rows}):
    ok = sorted((r for r in rows if r['tokens'] == t and isinstance(r.get('us'), float)), key=lambda r: r['us'])
    print('fastest at', t, 'tokens:', *ok[:4], sep='\n')" "$OUT/router_sweep.jsonl" ;;
    moe-gemm-sweep)
      timeout 300 python3 benchmarks/fused_moe_kernel.py --sweep-gemm --tokens 256 64 1024 8192 \
        >> "$OUT/moe_gemm_sweep.jsonl" 2>> "$OUT/moe_gemm_sweep.log"
      grep -E '"default": true' "$OUT/moe_gemm_sweep.jsonl" ;;
    moe-gemm-sweep-w8a8)
      for scales in "" --block-scales; do
        timeout 280 python3 benchmarks/fused_moe_kernel.py --sweep-gemm --fp8 $scales \
          --tokens ${MOE_GEMM_TOKENS:-256 8192} >> "$OUT/moe_gemm_sweep_w8a8.jsonl" 2>> "$OUT/moe_gemm_sweep_w8a8.log"
      done
      grep -E '"default": true' "$OUT/moe_gemm_sweep_w8a8.jsonl" ;;
    moe-w8a8)
      timeout 240 python3 benchmarks/fused_moe_kernel.py --w8a8 --tokens 256 1024 8192 \
        >> "$OUT/moe_w8a8.jsonl" 2>> "$OUT/moe_w8a8.log"
      cat "$OUT/moe_w8a8.jsonl"; tail -3 "$OUT/moe_w8a8.log" ;;
    gemv-sweep)
      timeout 300 python3 benchmarks/gemv_kernel.py --sweep \
        --shapes ${GEMV_SWEEP_SHAPES:-qwen3-0.6b llama3-8b qwen3-30b-a3b} >> "$OUT/gemv_sweep.jsonl" 2>> "$OUT/gemv_sweep.log"
      cut -c1-400 "$OUT/gemv_sweep.jsonl"; tail -3 "$OUT/gemv_sweep.log" ;;
    gemv-pdl)
      timeout 120 python3 benchmarks/gemv_kernel.py --pdl --shapes qwen3-0.6b llama3-8b \
        2>> "$OUT/gemv_pdl.log" | tee -a "$OUT/gemv_pdl.jsonl" ;;
    gemv-fp8)
      timeout 200 python3 benchmarks/gemv_kernel.py --fp8 --rows 1 4 \
        --shapes qwen3-30b-a3b llama3-8b >> "$OUT/gemv_fp8.jsonl" 2>> "$OUT/gemv_fp8.log"
      cut -c1-300 "$OUT/gemv_fp8.jsonl"; tail -3 "$OUT/gemv_fp8.log" ;;
    fp8-sweep)
      timeout 150 python3 benchmarks/fp8_decode.py --model-shape qwen3-30b-a3b --sweep 1 \
        >> "$OUT/fp8_sweep.jsonl" 2>> "$OUT/fp8_sweep.log" ;;
    kernels-b1)
      timeout 120 python3 benchmarks/fp8_decode.py --model-shape qwen3-30b-a3b --kernels-only \
        >> "$OUT/kernels_b1.jsonl" 2>> "$OUT/kernels_b1.log"
      tail -1 "$OUT/kernels_b1.jsonl" ;;
    tprofile-*)
      shape=${phase#tprofile-}
      timeout 200 python3 benchmarks/profile_decode.py --model-shape "$shape" --batch 256 \
        --prompt-len 768 --steps 20 --kernels ${TPROFILE_FLAGS:-} >> "$OUT/tprofile_$shape.txt" 2>&1
      grep -E '"execute_ms"' "$OUT/tprofile_$shape.txt"
      grep -E -A30 "device_us_per_step" "$OUT/tprofile_$shape.txt" | cut -c1-150 ;;
    kprofile-*)
      shape=${phase#kprofile-}
      timeout 150 python3 benchmarks/profile_decode.py --model-shape "$shape" --batch 1 \
        --steps 50 --kernels >> "$OUT/kprofile_$shape.txt" 2>&1
      grep -E -A42 "device_us_per_step" "$OUT/kprofile_$shape.txt" | cut -c1-150 ;;
    moe-gpu-tests)
      timeout 240 python3 -m pytest -m gpu -q -rP -p no:cacheprovider --durations=10 \
        tests/worker/kernels/test_fused_moe.py tests/worker/kernels/test_moe_routing.py \
        tests/worker/kernels/test_fp8_matmul.py tests/worker/test_gpu_moe.py tests/worker/test_gpu_gemma4.py \
        >> "$OUT/gpu_tests.txt" 2>&1 ;;
    profile)
      for args in "--batch 1" "--batch 1 --eager" "--batch 64"; do
        timeout 60 python3 benchmarks/profile_decode.py $args >> "$OUT/profile.txt" 2>&1
      done ;;
    http-*)
      shape=${phase#http-}
      if ! has_shape "$shape"; then echo "skip $phase: no $shape in MODEL_SHAPES"; continue; fi
      bash benchmarks/http_vs_offline.sh "$shape" ;;
    *) echo "unknown phase $phase" ;;
  esac
  tail -3 "$OUT/gpu_tests.txt" 2>/dev/null
done
cat "$OUT/bench.jsonl" 2>/dev/null
