"""Every ``VT_*`` environment variable vtllm reads, typed, in one place.

Read them through ``envs.<NAME>`` (evaluated at access time, so tests can set them).
Each one is documented in ``docs/ENVIRONMENT.md``; a test checks that.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _optional_float(name: str) -> float | None:
    """A duration in seconds; units accepted (``500ms``, ``10s``, ``2m``)."""
    from vtllm.config import parse_duration

    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return parse_duration(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _float(name: str, default: float) -> float:
    value = _optional_float(name)
    return default if value is None else value


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: write a whole number") from None
    if number < 1:
        raise ValueError(f"{name}={value!r}: must be at least 1")
    return number


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


def _cache_dir() -> Path:
    value = os.environ.get("VT_CACHE_DIR", "").strip()
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vtllm"


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Where converted models (e.g. the embedded GGUF as safetensors) are cached.
    "VT_CACHE_DIR": _cache_dir,
    # Seconds between engine-core heartbeat log lines; unset or 0 = off.
    "VT_ENGINE_STEP_LOG": lambda: _optional_float("VT_ENGINE_STEP_LOG"),
    # Seconds of silence after which a stream sends an SSE keepalive comment (0 = off).
    "VT_SSE_KEEPALIVE_S": lambda: _float("VT_SSE_KEEPALIVE_S", 10.0),
    # Bearer token required on /v1/* (same as --api-key).
    "VT_API_KEY": lambda: os.environ.get("VT_API_KEY") or None,
    # Seconds of silence after which a ZMQ peer (engine core or client) counts as gone.
    "VT_HEARTBEAT_TIMEOUT_S": lambda: _float("VT_HEARTBEAT_TIMEOUT_S", 5.0),
    # Seconds between heartbeats on the client/engine socket (sent by each side's I/O thread).
    "VT_HEARTBEAT_INTERVAL_S": lambda: _float("VT_HEARTBEAT_INTERVAL_S", 1.0),
    # Seconds each worker start-up phase (loading, profiling, KV allocation, graph capture) may take.
    "VT_WORKER_START_TIMEOUT_S": lambda: _float("VT_WORKER_START_TIMEOUT_S", 600.0),
    # Seconds one step may take on the workers before the engine treats them as hung.
    "VT_STEP_TIMEOUT_S": lambda: _float("VT_STEP_TIMEOUT_S", 300.0),
    # Seconds of silence from a worker's heartbeat thread before it counts as frozen or dead.
    "VT_WORKER_HEARTBEAT_TIMEOUT_S": lambda: _float("VT_WORKER_HEARTBEAT_TIMEOUT_S", 20.0),
    # Log line format of every vtllm process: text (default) or json (set by --log-format).
    "VT_LOG_FORMAT": lambda: _choice("VT_LOG_FORMAT", ("text", "json"), "text"),
    # Log level of every vtllm process (DEBUG, INFO, WARNING, ERROR).
    "VT_LOG_LEVEL": lambda: os.environ.get("VT_LOG_LEVEL", "INFO").upper(),
    # Attention implementation in the workers: auto (Triton on GPU, torch on CPU), torch, triton.
    "VT_ATTENTION_BACKEND": lambda: _choice(
        "VT_ATTENTION_BACKEND", ("auto", "torch", "triton"), "auto"
    ),
    # CPU workers' decode step through torch.compile: auto (quantised models), on, off.
    "VT_CPU_COMPILE": lambda: _choice("VT_CPU_COMPILE", ("auto", "on", "off"), "auto"),
    # CPU workers: decode steps of int4 Llama-family models as one native call (auto | off).
    "VT_CPU_NATIVE_DECODE": lambda: _choice("VT_CPU_NATIVE_DECODE", ("auto", "off"), "auto"),
    # CPU workers of float32 models: prompt steps multiply in bf16 (float32 accumulation)
    # and attend prefill chunks in bf16: auto (CPUs with native bf16), on, off.
    "VT_CPU_BF16_PREFILL": lambda: _choice("VT_CPU_BF16_PREFILL", ("auto", "on", "off"), "auto"),
    # CPU workers: torch threads of each worker; unset = the cores divided among the ranks.
    "VT_CPU_THREADS": lambda: (
        _int("VT_CPU_THREADS", 0) if os.environ.get("VT_CPU_THREADS", "").strip() else None
    ),
    # GPU workers with decode graphs: time the GEMV kernel against the library GEMM per
    # weight shape at start-up and use it at 1-4 rows where it wins (auto), or never (off).
    "VT_SMALL_BATCH_GEMV": lambda: _choice("VT_SMALL_BATCH_GEMV", ("auto", "off"), "auto"),
    # CUDA sm90+: the fused decode chain's GEMVs with programmatic dependent launch where
    # start-up timing says it pays (auto, opt-in), or never (off, the default).
    "VT_DECODE_PDL": lambda: _choice("VT_DECODE_PDL", ("auto", "off"), "off"),
    # Decode-only GPU steps: q/k norm, rotary and the k/v cache write inside the attention
    # kernel (auto), or in their own kernel first (off).
    "VT_DECODE_FUSED_PREP": lambda: _choice("VT_DECODE_FUSED_PREP", ("auto", "off"), "auto"),
    # Qwen3-MoE / Mixtral decode steps: the input RMSNorm folded into the experts' last
    # kernel and the q/k prep (auto), or a norm kernel a layer (off).
    "VT_MOE_DECODE_CHAIN": lambda: _choice("VT_MOE_DECODE_CHAIN", ("auto", "off"), "auto"),
    # FP8 experts' grouped GEMMs (prefill, large batches): quantise their inputs per token
    # and dot e4m3 by e4m3 where the GPU can (auto), or dot in bf16 (off).
    "VT_MOE_FP8_ACTIVATIONS": lambda: _choice("VT_MOE_FP8_ACTIVATIONS", ("auto", "off"), "auto"),
    # Most stop strings in one request (HTTP schema).
    "VT_MAX_STOP_STRINGS": lambda: _int("VT_MAX_STOP_STRINGS", 64),
    # Most characters of one stop string (HTTP schema).
    "VT_MAX_STOP_STRING_CHARS": lambda: _int("VT_MAX_STOP_STRING_CHARS", 1024),
    # Most stop_token_ids in one request (HTTP schema and engine core).
    "VT_MAX_STOP_TOKEN_IDS": lambda: _int("VT_MAX_STOP_TOKEN_IDS", 1024),
    # Most logit_bias entries in one request (HTTP schema and engine core).
    "VT_MAX_LOGIT_BIAS_ENTRIES": lambda: _int("VT_MAX_LOGIT_BIAS_ENTRIES", 1024),
    # Set (1/true/yes/on): allow --max-model-len above the model's max_position_embeddings.
    "VT_ALLOW_LONG_MAX_MODEL_LEN": lambda: (
        os.environ.get("VT_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower()
        in ("1", "true", "yes", "on")
    ),
    # Test hook: a worker sleeps this many seconds in every model execution.
    "VT_TEST_WORKER_STEP_DELAY_S": lambda: _float("VT_TEST_WORKER_STEP_DELAY_S", 0.0),
    # Longest a request waits for its structured-output grammar to compile (engine core).
    "VT_GRAMMAR_COMPILE_TIMEOUT_S": lambda: _float("VT_GRAMMAR_COMPILE_TIMEOUT_S", 30.0),
    # Test hook: the driver worker sleeps this many seconds before each grammar compile.
    "VT_TEST_GRAMMAR_COMPILE_DELAY_S": lambda: _float("VT_TEST_GRAMMAR_COMPILE_DELAY_S", 0.0),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module 'vtllm.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_VARIABLES)


def export(name: str, value: str) -> None:
    """Set a variable for this process and the processes it starts (e.g. a CLI flag that
    every child must honour)."""
    if name not in _VARIABLES:
        raise KeyError(f"{name} is not a vtllm variable")
    os.environ[name] = value


def names() -> list[str]:
    return sorted(_VARIABLES)
