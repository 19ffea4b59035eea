"""``vtllm bench all`` and ``prefill`` end to end on CPU over a shrunken Qwen3-30B-A3B (the H200 benchmark's
shape with 2 layers, 16 experts, top-4): engine core and worker as real processes, random
weights from a ``--model-shape`` config.json, the random-length throughput workload."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vtllm.bench import MODEL_SHAPES
from vtllm.roofline import model_bytes, prefill_flops

_SHRUNKEN = dict(
    MODEL_SHAPES["qwen3-30b-a3b"],
    hidden_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    vocab_size=1024,
    max_position_embeddings=512,
)


def test_bench_all_runs_a_moe_shape_with_random_length_prompts(tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(_SHRUNKEN))
    command = [sys.executable, "-m", "vtllm.cli", "bench", "all", "--model-shape", str(config_path)]
    command += ["--input-len", "8", "--output-len", "6", "--num-iters", "1", "--no-roofline"]
    command += ["--num-prompts", "5", "--input-len-range", "3", "40"]
    command += ["--output-len-range", "2", "9", "--kv-cache-memory", "64MiB"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert child.returncode == 0, child.stderr[-4000:]
    latency, throughput = (json.loads(line) for line in child.stdout.strip().splitlines()[-2:])
    expected_fraction = round(model_bytes(_SHRUNKEN, 4).step_weight_fraction, 4)
    assert latency["kind"] == "latency" and latency["decode_tok_s"] > 0
    assert latency["step_weight_fraction"] == expected_fraction < 0.5  # top-4 of 16 experts
    # the workload: lengths uniform in the ranges, drawn from seed 0 in this order
    rng = random.Random(0)
    inputs = outputs = 0
    for _ in range(5):
        prompt_len = rng.randint(3, 40)
        inputs += prompt_len
        for _ in range(prompt_len):
            rng.randrange(10, 1024 - 10)
        outputs += rng.randint(2, 9)
    assert throughput["kind"] == "throughput" and throughput["num_prompts"] == 5
    assert (throughput["input_tokens"], throughput["output_tokens"]) == (inputs, outputs)
    # an untimed warm-up of min(32, 5) prompts ran first and is not in the counts above
    assert throughput["warmup_prompts"] == 5 and throughput["warmup_s"] > 0
    assert "weights: " in child.stderr and "host RSS peak" in child.stderr  # start-up log


def test_bench_prefill_reads_the_prompt_against_a_matmul_of_the_widest_linear(tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(_SHRUNKEN))
    command = [sys.executable, "-m", "vtllm.cli", "bench", "prefill", "--model-shape"]
    command += [str(config_path), "--input-len", "200", "--num-iters", "2"]
    command += ["--kv-cache-memory", "64MiB"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["kind"] == "prefill" and result["input_len"] == 200
    assert result["prefill_tok_s"] == pytest.approx(200 / result["prefill_s"], rel=0.01)
    assert result["model_tflop"] == round(prefill_flops(_SHRUNKEN, 200) / 1e12, 2)
    assert result["matmul_tflop_s"] > 0 and result["matmul_fraction"] > 0


def test_bench_exits_at_once_when_the_engine_core_refuses_to_start(tmp_path):
    """An engine core that cannot start (here: a KV cache too small for one sequence)
    exits; the benchmark notices its process is gone and says so, instead of waiting for
    a handshake that never comes."""
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(_SHRUNKEN))
    command = [sys.executable, "-m", "vtllm.cli", "bench", "latency", "--model-shape"]
    command += [str(config_path), "--no-roofline", "--kv-cache-memory", "4KiB"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert child.returncode == 1, child.stderr[-2000:]
    assert "refusing to start" in child.stderr
    assert "exited before it answered the handshake" in child.stderr.splitlines()[-1]
