#!/usr/bin/env bash
# HTTP vs offline on one `vtllm bench` shape, random weights (issue 13's rows):
#   bash benchmarks/http_vs_offline.sh SHAPE        (h200_run.sh phase http-SHAPE)
# `vtllm bench throughput` (offline), then `vtllm bench serve` at 256 streams against
# `vtllm serve --api-server-count N` for N in $HTTP_API_SERVERS (default "1 2 4"), same
# engine flags and requests: smollm2-135m (and any other shape) 1,024 requests of 110 in /
# 256 out; llama3-8b 512 of 210 / 512. The model directory is the shape's config.json and a
# synthetic tokenizer over its vocabulary (benchmarks/http_model_dir.py). With
# .devtools/py-spy present, the N=1 frontend is sampled for 15 s ($OUT/http_prof_SHAPE.txt,
# raw stacks). Results: $OUT/bench.jsonl (offline), $OUT/bench_serve.jsonl (HTTP).
# Smaller runs (CPU smoke): HTTP_NUM_PROMPTS, HTTP_OUTPUT_LEN, HTTP_ENGINE_FLAGS (extra flags).
set -u
shape=$1
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
PORT=${HTTP_PORT:-8100}
n=1024; in=110; out=256
[ "$shape" = llama3-8b ] && { n=512; in=210; out=512; }
n=${HTTP_NUM_PROMPTS:-$n}; out=${HTTP_OUTPUT_LEN:-$out}
concurrency=$(( n < 256 ? n : 256 ))
dir=/tmp/http-$shape
$PY benchmarks/http_model_dir.py "$shape" "$dir" > /dev/null || exit 1
vocab=$($PY -c "import json; print(json.load(open('$dir/config.json'))['vocab_size'])")
engine="--model $dir --load-format dummy --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2048 ${HTTP_ENGINE_FLAGS:-}"
timeout 150 $PY -m vtllm.cli bench throughput $engine --num-prompts $n \
  --input-len-range $in $in --output-len-range $out $out --no-roofline \
  >> "$OUT/bench.jsonl" 2>> "$OUT/http_$shape.log"
tail -1 "$OUT/bench.jsonl"
for count in ${HTTP_API_SERVERS:-1 2 4}; do
  $PY -m vtllm.cli serve $engine --port $PORT --api-server-count $count \
    --disable-log-stats --no-enable-log-requests >> "$OUT/http_${shape}_serve.log" 2>&1 &
  server=$!
  $PY -c "import time, urllib.request as u
for _ in range(600):
    try:
        u.urlopen('http://127.0.0.1:$PORT/health', timeout=1); break
    except Exception: time.sleep(0.25)"
  if [ "$count" = 1 ] && [ -x .devtools/py-spy ]; then
    (sleep 4; timeout 30 .devtools/py-spy record --pid $server --duration 15 --rate 200 \
      --nonblocking --format raw -o "$OUT/http_prof_$shape.txt" > /dev/null 2>&1) &
  fi
  echo "{\"shape\": \"$shape\", \"api_server_count\": $count}" >> "$OUT/bench_serve.jsonl"
  timeout 120 $PY -m vtllm.cli bench serve --base-url http://127.0.0.1:$PORT \
    --num-prompts $n --max-concurrency $concurrency --input-len $in --output-len $out \
    --ignore-eos --vocab-size $vocab --client-processes 4 \
    >> "$OUT/bench_serve.jsonl" 2>> "$OUT/http_$shape.log"
  tail -1 "$OUT/bench_serve.jsonl"
  kill -TERM $server; wait $server
done
