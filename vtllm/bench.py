"""``vtllm bench latency``, ``throughput`` and ``prefill``: the real engine core and workers,
driven over the protocol client with random token ids (no HTTP, no tokenizer).

Models: ``--model DIR`` or ``--model-shape NAME|CONFIG.json`` (a known model's shape or any config,
served with random weights: ``--load-format dummy`` is implied).

Every figure is also stated against the memory-bandwidth roofline: the bytes a decode step
must read over the device copy bandwidth measured in the same run (``vtllm.roofline``).
Latency (batch 1): the weights a step reads — for mixtures of experts only the top-k experts
of each layer (``step_weight_fraction`` of all weights) — plus the sequence's KV.
Throughput: every weight once per engine step (with hundreds of sequences a step, top-8 of
128 routing touches every expert: 1 - (1 - 8/128)^256 ≈ 1) plus each decode's KV.
FP8: ``--quantization fp8`` (or an FP8 checkpoint) counts the linears and experts at one
byte; ``--kv-cache-dtype fp8`` the KV at one.

Prefill (one ``--input-len`` prompt, one output token): its FLOPs (``vtllm.roofline.prefill_flops``)
over the time to the first token, against a dense matmul of the model's widest linear at that
many rows measured in the same run.

Throughput prompts: ``--num-prompts`` of random token ids, input and output lengths drawn
uniformly from ``--input-len-range`` / ``--output-len-range`` (inclusive), seed 0, so every
run and ``benchmarks/hf_baseline.py`` see the same requests. Before them, untimed,
``--num-warmup-prompts`` from the same ranges (seed 1). Until session 40 a fresh engine
over a cold Triton cache compiled the attention kernel again in its first mixed steps (its
block-table stride and sequence count were specialised per value class), 14-23 % off the
first run's rate even after this warm-up; now a cold run matches a warm one (H200: 9,801.5
against 9,779.7 output tok/s, session 40). The warm-up stays: it keeps any other
first-step cost out of the timed run, at 5.4 s on the Llama-3-8B shape.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from vtllm import envs
from vtllm.config import VtllmConfig, async_scheduling_enabled
from vtllm.protocol import messages as m
from vtllm.roofline import ModelBytes, model_bytes, prefill_flops

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    },
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": 128009,
    },
    # Qwen/Qwen3-30B-A3B's config.json (transformers' Qwen3MoeConfig fields): every one of
    # the 48 layers routes to the top 8 of 128 experts 768 wide; 30.5 B weights, 3.0 B of
    # them read by a batch-1 decode step
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # google/gemma-4-26B-A4B-it's text_config (the release is a Gemma4ForConditionalGeneration;
    # its text decoder alone here): 30 layers, every 6th full attention with head_dim 512 and
    # 2 KV heads shared by k and v, a 2112-wide dense MLP beside 128 experts (top 8, 704 wide)
    "gemma4-26b-moe": {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": 2816,
        "intermediate_size": 2112,
        "num_hidden_layers": 30,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_global_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "enable_moe_block": True,
        "num_experts": 128,
        "top_k_experts": 8,
        "moe_intermediate_size": 704,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "layer_types": [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(30)
        ],
        "sliding_window": 1024,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 262144,
        "vocab_size": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_bidirectional_attention": "vision",
        "eos_token_id": [1, 106],
    },
}


def shape_config(shape: str) -> dict[str, Any]:
    """The config of ``shape``: a ``MODEL_SHAPES`` name, or a path to a ``config.json``
    (any supported architecture, e.g. a shrunken one for a CPU run). ValueError otherwise."""
    if shape in MODEL_SHAPES:
        return MODEL_SHAPES[shape]
    if shape.endswith(".json") and Path(shape).is_file():
        return json.loads(Path(shape).read_text())
    raise ValueError(
        f"unknown model shape {shape!r}: give one of {', '.join(sorted(MODEL_SHAPES))} "
        "or the path of a config.json"
    )


def write_shape_dir(shape: str) -> Path:
    """A model directory holding only the config.json of ``shape`` (``shape_config``)."""
    directory = Path(tempfile.mkdtemp(prefix=f"vtllm-{Path(shape).stem}-"))
    (directory / "config.json").write_text(json.dumps(shape_config(shape), indent=1))
    return directory


def _shape_argument(value: str) -> str:
    try:
        shape_config(value)
    except (ValueError, OSError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


def bench_model_bytes(hf: dict[str, Any], config: VtllmConfig, dtype_bytes: int) -> ModelBytes:
    """The roofline's byte accounting for this run: FP8 linears under ``--quantization fp8``
    or an FP8 checkpoint, an FP8 KV cache under ``--kv-cache-dtype fp8*``."""
    quantization = getattr(config.model, "quantization", None)  # absent before FP8 weights
    checkpoint_quant = (hf.get("quantization_config") or {}).get("quant_method")
    linear_bytes = 1 if "fp8" in (quantization, checkpoint_quant) else None
    kv_dtype = getattr(config.cache, "kv_cache_dtype", "auto")
    kv_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}.get(kv_dtype)
    if kv_dtype.startswith("fp8"):
        kv_bytes = 1
    return model_bytes(hf, dtype_bytes, linear_bytes, kv_bytes)


def measure_copy_bandwidth(num_bytes: int = 2 * 1024**3, repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s, from a large device-to-device copy (each copy
    reads and writes ``num_bytes``: both count, as both move through HBM)."""
    import torch

    from vtllm.worker.platform import detect_platform

    platform = detect_platform(0)
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=platform.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    platform.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    platform.synchronize()
    elapsed = time.perf_counter() - started
    del src, dst
    platform.empty_cache()
    # A copy reads and writes num_bytes each: the memory system moved 2 × num_bytes.
    return 2 * num_bytes * repeats / elapsed


def _engine(config: VtllmConfig, model_dir: str):
    from vtllm.launch import start_engine_core
    from vtllm.protocol import transport
    from vtllm.protocol.client import EngineCoreClient, HandshakeError

    runtime_dir = transport.make_runtime_dir()
    process, address = start_engine_core(config, model_dir, runtime_dir)
    try:
        client = EngineCoreClient(
            address, "vtllm-bench", timeout_s=1800, engine_alive=process.is_alive
        )
    except HandshakeError as e:
        process.join(5)
        transport.remove_runtime_dir(runtime_dir)
        raise SystemExit(f"vtllm bench: {e}; exit code {process.exitcode}") from None
    return process, client, runtime_dir


def _significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant figures: a CPU's 0.02 TFLOP/s stays non-zero
    where a fixed number of decimals would print 0.0."""
    return float(f"{value:.{digits}g}")


def _random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(length)]


def bench_latency(client, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(0)
    params = m.SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    runs = []
    for i in range(args.num_iters + 1):  # the first is warm-up
        request_id = f"lat-{i}-{uuid.uuid4().hex[:6]}"
        started = time.perf_counter()
        client.add_request(request_id, _random_prompt(rng, args.input_len, vocab), params)
        stamps = []
        for output in client.stream(request_id):
            stamps.extend([time.perf_counter()] * len(output.new_token_ids))
        if i:
            runs.append((stamps[0] - started, (len(stamps) - 1) / (stamps[-1] - stamps[0])))
    ttft = sorted(r[0] for r in runs)[len(runs) // 2]
    tok_s = sorted(r[1] for r in runs)[len(runs) // 2]
    return {"ttft_s": round(ttft, 4), "decode_tok_s": round(tok_s, 1)}


def bench_prefill(client, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """One ``--input-len`` prompt and one output token, ``--num-iters`` times after a
    warm-up, each a fresh random prompt (the prefix cache never hits): the median time to
    the first token, which is the prefill plus one step's overhead."""
    rng = random.Random(1)
    params = m.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(args.num_iters + 1):  # the first is warm-up
        request_id = f"prefill-{i}-{uuid.uuid4().hex[:6]}"
        prompt = _random_prompt(rng, args.input_len, vocab)
        started = time.perf_counter()
        client.add_request(request_id, prompt, params)
        for _ in client.stream(request_id):
            pass
        if i:
            times.append(time.perf_counter() - started)
    prefill_s = sorted(times)[len(times) // 2]
    return {
        "input_len": args.input_len,
        "prefill_s": round(prefill_s, 4),
        "prefill_tok_s": round(args.input_len / prefill_s, 1),
    }


def measure_matmul_tflops(m_rows: int, k: int, n: int, dtype_name: str, repeats: int = 20) -> float:
    """The device's dense matmul rate (FLOP/s) on ``[m_rows, k] @ [k, n]`` in ``dtype_name``
    (the model's widest linear at the prompt's length): the ceiling a prefill is read
    against."""
    import torch

    from vtllm.worker.platform import detect_platform

    platform = detect_platform(0)
    dtype = getattr(torch, dtype_name)
    a = torch.randn(m_rows, k, dtype=dtype, device=platform.device)
    b = torch.randn(k, n, dtype=dtype, device=platform.device)
    for _ in range(3):
        a @ b
    platform.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    platform.synchronize()
    elapsed = time.perf_counter() - started
    del a, b
    platform.empty_cache()
    return 2 * m_rows * k * n * repeats / elapsed


def throughput_requests(
    args: argparse.Namespace, vocab: int, count: int, seed: int, prefix: str
) -> list[tuple[str, list[int], int]]:
    """``count`` requests ``(id, prompt, output length)``, lengths uniform in the argument
    ranges (inclusive), drawn from ``seed`` (0: the timed workload, which
    ``benchmarks/hf_baseline.py`` replays)."""
    rng = random.Random(seed)
    lo_in, hi_in = args.input_len_range
    lo_out, hi_out = args.output_len_range
    requests = []
    for i in range(count):
        prompt = _random_prompt(rng, rng.randint(lo_in, hi_in), vocab)
        requests.append((f"{prefix}-{i}", prompt, rng.randint(lo_out, hi_out)))
    return requests


def _run_to_completion(client, requests: list[tuple[str, list[int], int]]) -> tuple[int, int]:
    """Submit every request at once (greedy, ``ignore_eos``) and wait for all to end at
    their length: (output tokens, the engine step id seen first, 0 if none)."""
    for request_id, prompt, out_len in requests:
        params = m.SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        client.add_request(request_id, prompt, params)
    unfinished = {r[0] for r in requests}
    num_out = 0
    first_step = None
    while unfinished:
        for output in client.get_outputs(1.0):
            num_out += len(output.new_token_ids)
            if output.finish_reason is not None:
                unfinished.discard(output.request_id)
                if output.finish_reason != m.FinishReason.LENGTH:
                    raise RuntimeError(
                        f"{output.request_id} ended with {output.finish_reason}: {output.error}"
                    )
        if first_step is None and client.latest_stats is not None:
            first_step = client.latest_stats.step_id
    return num_out, first_step or 0


def bench_throughput(client, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The timed workload (seed 0), after an untimed warm-up of ``--num-warmup-prompts``
    drawn from the same ranges with seed 1 (other token ids: no prefix-cache hits), so that
    first-use costs are not timed. ``warmup_s`` reports what that pass took;
    ``--num-warmup-prompts 0`` times a cold engine. ``step_split`` says
    how the timed run's engine time divides between decode-only and prompt steps."""
    num_warmup = args.num_warmup_prompts
    if num_warmup is None:
        num_warmup = min(32, args.num_prompts)
    warmup_s = 0.0
    if num_warmup > 0:
        started = time.perf_counter()
        _run_to_completion(client, throughput_requests(args, vocab, num_warmup, 1, "warm"))
        warmup_s = time.perf_counter() - started
    requests = throughput_requests(args, vocab, args.num_prompts, 0, "tp")
    stats_before = client.utility("get_stats")
    started = time.perf_counter()
    num_out, first_step = _run_to_completion(client, requests)
    wall = time.perf_counter() - started
    step_times = step_split(stats_before, client.utility("get_stats"))
    num_in = sum(len(r[1]) for r in requests)
    steps = client.latest_stats.step_id - first_step if client.latest_stats else 0
    return {
        "num_prompts": len(requests),
        "wall_s": round(wall, 2),
        "output_tok_s": round(num_out / wall, 1),
        "total_tok_s": round((num_in + num_out) / wall, 1),
        "input_tokens": num_in,
        "output_tokens": num_out,
        "engine_steps": steps,
        "warmup_prompts": num_warmup,
        "warmup_s": round(warmup_s, 2),
        "step_split": step_times,
        "_lengths": [(len(p), o) for _, p, o in requests],  # for the roofline's KV reads
    }


def step_split(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float] | None:
    """The timed run's steps by kind, from the engine's ``get_stats`` before and after it
    (``StepTimes``): decode-only steps against steps with prompt tokens (prefill or
    mixed), how many, milliseconds each on average, tokens each, and the share of the
    engine's busy time. None from an engine that does not count them."""
    keys = ("steps", "seconds", "tokens")
    try:
        delta = {
            (kind, key): after[f"{kind}_{key}_total"] - before[f"{kind}_{key}_total"]
            for kind in ("decode", "prefill")
            for key in keys
        }
    except (KeyError, TypeError):
        return None
    busy = delta["decode", "seconds"] + delta["prefill", "seconds"]
    split: dict[str, float] = {"busy_s": round(busy, 3)}
    for kind in ("decode", "prefill"):
        steps = delta[kind, "steps"]
        split[f"{kind}_steps"] = steps
        split[f"{kind}_ms_per_step"] = (
            round(1e3 * delta[kind, "seconds"] / steps, 3) if steps else 0.0
        )
        split[f"{kind}_tokens_per_step"] = round(delta[kind, "tokens"] / steps, 1) if steps else 0.0
        split[f"{kind}_share"] = round(delta[kind, "seconds"] / busy, 3) if busy else 0.0
    return split


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-shape",
        type=_shape_argument,
        metavar="NAME|CONFIG.json",
        help="random weights of a known shape (" + ", ".join(sorted(MODEL_SHAPES)) + ") or "
        "of a config.json file's",
    )
    parser.add_argument(
        "--input-len", type=int, default=32, help="latency and prefill: prompt tokens"
    )
    parser.add_argument("--output-len", type=int, default=128, help="latency: output tokens")
    parser.add_argument("--num-iters", type=int, default=3, help="latency: timed runs")
    parser.add_argument("--num-prompts", type=int, default=256, help="throughput: prompts")
    parser.add_argument(
        "--num-warmup-prompts",
        type=int,
        default=None,
        metavar="N",
        help="throughput: untimed prompts run first from the same ranges (default: "
        "min(32, --num-prompts); 0 times a cold engine, Triton compiles included)",
    )
    parser.add_argument(
        "--input-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX")
    )
    parser.add_argument("--no-roofline", action="store_true", help="skip the bandwidth measurement")


def decode_graphs_used(enforce_eager: bool, supports_graphs: bool, attention_backend: str) -> bool:
    """Whether the workers capture decode graphs (worker.py ``_use_graphs``): not with
    --enforce-eager, only on a GPU, and only over the Triton attention (``auto`` is
    Triton on a GPU). On CPU: never."""
    return not enforce_eager and supports_graphs and attention_backend in ("auto", "triton")


def run_bench(kind: str, args: argparse.Namespace, config: VtllmConfig) -> int:
    from vtllm.log import configure_logging

    configure_logging("vtllm-bench")
    if args.model_shape:
        model_dir = str(write_shape_dir(args.model_shape))
        config.model.load_format = "dummy"
        config.model.served_model_name = config.model.served_model_name or args.model_shape
    else:  # a directory, a .gguf, a Hugging Face name, or the embedded model
        from vtllm.launch import resolve_model

        model_dir = resolve_model(config)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    # a prefill is read against the matmul rate, not the bandwidth
    bandwidth = None if args.no_roofline or kind == "prefill" else measure_copy_bandwidth()
    matmul_flops = None
    if kind == "prefill" and not args.no_roofline:
        from vtllm.worker.platform import detect_platform

        name = str(detect_platform(0).resolve_dtype(config.model.dtype)).removeprefix("torch.")
        widest = 2 * (hf.get("moe_intermediate_size") or hf["intermediate_size"])  # gate + up
        matmul_flops = measure_matmul_tflops(args.input_len, hf["hidden_size"], widest, name)
    process, client, runtime_dir = _engine(config, model_dir)
    try:
        from vtllm.worker.platform import detect_platform

        platform = detect_platform(0)
        torch_dtype = platform.resolve_dtype(config.model.dtype)
        graphs = decode_graphs_used(
            config.model.enforce_eager, platform.supports_graphs, envs.VT_ATTENTION_BACKEND
        )
        dtype = str(torch_dtype).removeprefix("torch.")
        sizes = bench_model_bytes(hf, config, torch_dtype.itemsize)
        vocab = client.ready.vocab_size
        for one_kind in ("latency", "throughput") if kind == "all" else (kind,):
            if one_kind == "latency":
                result = bench_latency(client, args, vocab)
                context = args.input_len + args.output_len // 2
                step_bytes = sizes.step_weight_bytes + sizes.kv_bytes(context)
                result["step_gib"] = round(step_bytes / 1024**3, 3)
                if bandwidth:
                    result["roofline_tok_s"] = round(bandwidth / step_bytes, 1)
                    result["roofline_fraction"] = round(
                        result["decode_tok_s"] / result["roofline_tok_s"], 3
                    )
            elif one_kind == "prefill":
                result = bench_prefill(client, args, vocab)
                flops = prefill_flops(hf, args.input_len)
                result["model_tflop"] = round(flops / 1e12, 2)
                result["tflop_s"] = _significant(flops / result["prefill_s"] / 1e12)
                if matmul_flops:
                    result["matmul_tflop_s"] = _significant(matmul_flops / 1e12)
                    result["matmul_fraction"] = _significant(
                        flops / result["prefill_s"] / matmul_flops
                    )
            else:
                result = bench_throughput(client, args, vocab)
                kv_read = sum(
                    sizes.kv_bytes_while_decoding(p, o) for p, o in result.pop("_lengths")
                )
                if bandwidth and result["engine_steps"]:
                    weights_read = result["engine_steps"] * sizes.total_weight_bytes
                    needed_s = (weights_read + kv_read) / bandwidth
                    result["roofline_fraction"] = round(needed_s / result["wall_s"], 3)
            result.update(
                kind=one_kind,
                model=args.model_shape or model_dir,
                dtype=dtype,
                quantization=getattr(config.model, "quantization", None),
                kv_cache_dtype=getattr(config.cache, "kv_cache_dtype", "auto"),
                decode_graphs=graphs,
                async_scheduling=async_scheduling_enabled(
                    config.scheduler.async_scheduling, platform.is_gpu
                ),
                weight_gib=round(sizes.total_weight_bytes / 1024**3, 3),
                step_weight_fraction=round(sizes.step_weight_fraction, 4),
                copy_bandwidth_gb_s=round(bandwidth / 1e9, 1) if bandwidth else None,
            )
            print(json.dumps(result), flush=True)
        return 0
    finally:
        client.close()
        from vtllm.launch import stop_process
        from vtllm.protocol import transport

        stop_process(process)
        transport.remove_runtime_dir(runtime_dir)
