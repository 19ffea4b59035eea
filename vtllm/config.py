"""One config tree for every process. The CLI is generated from it (``cli.py``).

Each field carries its help text in ``metadata["help"]``. Sizes (``--kv-cache-memory``,
``--max-request-bytes``) accept units: ``512MiB``, ``2GiB``, ``1.5G``, ``4096``.
Durations accept ``500ms``, ``10s``, ``2m``.

Runtime facts (the fitted ``max_model_len``, the KV block count) travel as messages and
are never written back here: the config is what the user asked for.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_WITH_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"512MiB"`` → 536870912. Raises ValueError naming the accepted units."""
    if isinstance(text, int):
        return text
    match = _NUMBER_WITH_UNIT.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number with an optional unit such as "
            "512MiB, 2GiB, 1.5GB or 4096 (bytes)"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str | float) -> float:
    """``"500ms"`` → 0.5 seconds. Raises ValueError naming the accepted units."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _NUMBER_WITH_UNIT.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _DURATION_UNITS:
        raise ValueError(
            f"cannot read {text!r} as a duration; write a number of seconds with an "
            "optional unit such as 500ms, 10s, 2m"
        )
    return float(match.group(1)) * _DURATION_UNITS[unit]


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ModelConfig:
    model: str | None = _opt(
        None,
        "A Hugging Face repo id (org/name: downloaded, or taken from the HF cache when "
        "offline), a Hugging Face-style model directory (config.json, *.safetensors, "
        "tokenizer.json) or a .gguf file; also the positional MODEL of serve. Unset: the "
        "embedded SmolLM2-135M-Instruct.",
    )
    revision: str | None = _opt(
        None, "Branch, tag or commit of a Hugging Face --model (default: main)."
    )
    download_dir: str | None = _opt(
        None,
        "Hugging Face cache directory to download into and look in (default: the HF "
        "cache, HF_HOME / HF_HUB_CACHE).",
    )
    tokenizer: str | None = _opt(
        None,
        "Tokenizer directory or Hugging Face repo id, when not the model's own "
        "(tokenizer.json, tokenizer_config.json).",
        http_only=True,
    )
    tokenizer_revision: str | None = _opt(
        None, "Branch, tag or commit of a Hugging Face --tokenizer.", http_only=True
    )
    trust_remote_code: bool = _opt(
        False,
        "Accepted for vLLM command lines and ignored: vtllm never runs code from a "
        "checkpoint (its architectures are built in).",
    )
    generation_config: str = _opt(
        "auto",
        "Sampling defaults for requests that leave them unset: auto (the model's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens), vllm (none: vtllm's own defaults), or a directory holding a "
        "generation_config.json.",
        http_only=True,
    )
    served_model_name: str | None = _opt(
        None, "Model name clients use in requests (default: derived from --model)."
    )
    dtype: str = _opt(
        "auto",
        "Weight and activation dtype: auto (bfloat16 on GPU, float32 on CPU), "
        "float32 (or float), float16 (or half), bfloat16.",
        choices=("auto", "float32", "float16", "bfloat16"),
        aliases={"half": "float16", "float": "float32"},
    )
    max_model_len: int | None = _opt(
        None,
        "Longest sequence (prompt + output) in tokens. Unset: the model's own limit, "
        "lowered to what the KV cache can hold.",
    )
    seed: int = _opt(0, "Seed of the shared sampling generator (requests without a seed).")
    load_format: str = _opt(
        "auto",
        "auto: load the weights from the model's files; dummy: random weights of the "
        "configured shapes (benchmarks and tests; only config.json is read).",
        choices=("auto", "dummy"),
    )
    quantization: str | None = _opt(
        None,
        "Weight quantisation. Unset: the checkpoint's own (config.json quantization_config: "
        "fp8 e4m3 with per-tensor weight_scale or 128x128 weight_scale_inv blocks, "
        "compressed-tensors fp8), else none. fp8: quantise a bf16/fp32 checkpoint (or "
        "dummy weights) to e4m3 at load, one scale per output channel; activations get "
        "per-token scales at run time. On CPUs: unset = int4 on an x86 CPU with AVX2 "
        "when the model is a 4-bit GGUF such as the embedded SmolLM2; int8 (per-channel) "
        "/ int4 (groups of 32): weight-only formats for decode steps (prefill chunks use "
        "the weights as loaded); none: the weights as loaded.",
        choices=("fp8", "none", "int8", "int4"),
    )

    enforce_eager: bool = _opt(
        False,
        "Run every step eagerly: no CUDA/HIP graphs for decode batches, and on a CPU no "
        "compiled decode step (less start-up time and memory, slower small-batch decode).",
    )

    def default_served_name(self, model_dir: str) -> str:
        """The name clients use: --served-model-name, else the model's own name (a
        converted GGUF's cache directory, ``Name.Q4_1-<hash>``, serves as ``Name``)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model and not self.model.endswith(".gguf"):
            return self.model.rstrip("/").rsplit("/", 1)[-1]
        return model_dir.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]


@dataclass
class CacheConfig:
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    kv_cache_memory: int = _opt(
        1024**3,
        "KV-cache size on CPU, bytes with an optional unit (512MiB, 2GiB).",
        kind="size",
    )
    gpu_memory_utilization: float = _opt(
        0.9,
        "Fraction of the GPU's memory in use at most, other processes on it counted "
        "(vtllm's weights, activations and KV cache fill what they leave).",
    )
    enable_prefix_caching: bool = _opt(
        True, "Reuse the KV of shared prompt prefixes across requests."
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV-cache element type: auto (the model's --dtype), bfloat16, float16, float32, "
        "or fp8 (= fp8_e4m3: one byte per value, half of bf16, so twice the tokens fit; "
        "per-layer k/v scales from the checkpoint, else 1.0; GPU only).",
        choices=("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3"),
        aliases={"bf16": "bfloat16", "fp16": "float16", "half": "float16"},
    )


def async_scheduling_enabled(setting: bool | None, on_gpu: bool) -> bool:
    """``--async-scheduling`` resolved: as given, or (unset) on exactly when the workers
    run on GPUs. The engine core and every worker resolve it the same way."""
    return on_gpu if setting is None else setting


@dataclass
class SchedulerConfig:
    max_num_seqs: int = _opt(64, "Most requests in one batch.")
    max_num_batched_tokens: int = _opt(2048, "Token budget of one step (prefill chunks + decodes).")
    scheduling_policy: str = _opt(
        "fcfs",
        "Order of waiting requests: fcfs, priority (lower value first), lpm (longest "
        "cached prefix first).",
        choices=("fcfs", "priority", "lpm"),
    )
    reserve_full_sequence: bool = _opt(
        False,
        "Admit a request only when KV for its whole prompt plus max tokens is free "
        "(no preemption churn, fewer requests at once). A request without max_tokens "
        "reserves max_model_len tokens, so few of those run at once (often one): pair "
        "it with --default-max-tokens.",
    )
    long_prefill_token_threshold: int = _opt(
        512,
        "Most prompt tokens one request prefills in one step. Long prompts then go in "
        "short steps, and a request that arrives meanwhile gets its first token after "
        "about one such step instead of after the whole long prefill (decodes keep "
        "flowing too); the rest of --max-num-batched-tokens serves the others. 0: no cap, "
        "a prefill takes the whole budget.",
    )
    async_scheduling: bool | None = _opt(
        None,
        "Schedule and send step N+1 while the workers still run step N, so the engine "
        "core's scheduling, the IPC and the worker's input preparation overlap the "
        "device instead of adding to every step. Outputs are the same as without it. "
        "Steps go back to one at a time while a request with a structured output, "
        "penalties, min_tokens, logprobs or pooling is running (they need each step's "
        "tokens on the host first). Unset: on when the workers run on GPUs, off on CPU "
        "(there the worker computes on the cores the engine core would overlap it with).",
    )
    max_waiting_requests: int = _opt(
        4096,
        "Most requests waiting in the engine core (admitted, not yet running or "
        "preempted), all clients together. Beyond it a new request is refused at once as "
        "'server busy' (HTTP 503) instead of queueing without limit.",
    )
    max_requests_per_client: int = _opt(
        2048,
        "Most unfinished requests (waiting or running) one engine-core client may have; "
        "beyond it its new requests are refused as 'server busy' (HTTP 503), so one "
        "client cannot fill the queue. A `vtllm serve` frontend is one client.",
    )
    max_request_id_bytes: int = _opt(
        256,
        "Longest request id (UTF-8 bytes) the engine core accepts from a client; it is "
        "echoed in every output of the request.",
    )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = _opt(1, "Number of worker processes (one device each).")


@dataclass
class FrontendConfig:
    host: str = _opt("127.0.0.1", "Address the HTTP server listens on.")
    port: int = _opt(8000, "Port the HTTP server listens on.")
    api_key: str | None = _opt(
        None, "If set, /v1/* requires 'Authorization: Bearer <key>' (or set VT_API_KEY)."
    )
    max_request_bytes: int = _opt(
        32 * 1024**2, "Largest accepted HTTP request body (size with unit).", kind="size"
    )
    default_max_tokens: int | None = _opt(
        None,
        "Output token limit for requests that leave max_tokens unset (absent, null, "
        "0 or negative). Unset: max_model_len - prompt tokens.",
    )
    tool_call_parser: str | None = _opt(
        None,
        "Parse tool calls in chat output into OpenAI tool_calls: hermes "
        "(<tool_call>{...}</tool_call>: Qwen, Hermes, SmolLM2), llama3_json "
        '({"name": ..., "parameters": ...}) or mistral ([TOOL_CALLS]). Unset: the format '
        "the chat template teaches, when it is one of these; otherwise chat requests with "
        "tools are refused unless tool_choice is none.",
        choices=("hermes", "llama3_json", "mistral"),
    )
    enable_auto_tool_choice: bool = _opt(
        False,
        "Accepted for vLLM command lines; vtllm parses tool calls (tool_choice auto) "
        "whenever a --tool-call-parser is set or detected.",
    )
    chat_template: str | None = _opt(
        None,
        "Chat template to use instead of the model's: a Jinja file, or the template text itself.",
    )
    reasoning_parser: str | None = _opt(
        None,
        "Split a reasoning model's <think>...</think> out of the chat answer into "
        "reasoning_content: qwen3 (thinking only when the output or the prompt's end "
        "opens it) or deepseek_r1 (the output starts thinking).",
        choices=("qwen3", "deepseek_r1"),
    )
    max_json_depth: int = _opt(
        64,
        "Deepest nesting of JSON arrays/objects accepted in a request body (anywhere: "
        "tools, response_format, unknown fields); deeper is a 400.",
    )
    max_choices_per_request: int = _opt(
        256,
        "Most engine requests one HTTP request may become: n x the number of prompts of "
        "/v1/completions, n of /v1/chat/completions; more is a 400.",
    )
    http_header_timeout: float = _opt(
        10.0,
        "Seconds a client has to send its request headers (from connecting, or from its "
        "first byte on a kept-alive connection); then 408 and the connection is closed.",
    )
    http_body_timeout: float = _opt(
        60.0,
        "Seconds a client has to send its request body after the headers; then 408 and "
        "the connection is closed.",
    )
    http_keep_alive_timeout: float = _opt(
        5.0, "Seconds an idle kept-alive HTTP connection stays open between requests."
    )
    uvicorn_log_level: str | None = _opt(
        None,
        "Log level of the HTTP server's own lines (uvicorn). Unset: VT_LOG_LEVEL.",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    enable_log_requests: bool = _opt(
        True,
        "One access-log line per HTTP request (method, path, status); probes of /health, "
        "/ping and /metrics are never logged. --disable-log-requests (vLLM) is "
        "--no-enable-log-requests.",
    )
    disable_log_stats: bool = _opt(
        False, "No periodic throughput / KV usage line in the log (metrics stay)."
    )
    max_logprobs: int = _opt(
        20, "Most logprobs / top_logprobs a request may ask for (at most 20); more is a 400."
    )
    response_role: str = _opt(
        "assistant", "Role of the generated message in chat completion answers."
    )
    pooling_type: str = _opt(
        "last",
        "/v1/embeddings pooling of the prompt's final hidden states: last (the last "
        "token's, as Qwen3-Embedding) or mean.",
        choices=("last", "mean"),
    )
    allowed_origins: str | None = _opt(
        None,
        "CORS: JSON list of allowed origins (e.g. '[\"*\"]'). Unset: no CORS headers.",
    )
    allowed_methods: str = _opt('["*"]', "CORS: JSON list of allowed methods.")
    allowed_headers: str = _opt('["*"]', "CORS: JSON list of allowed request headers.")
    allow_credentials: bool = _opt(False, "CORS: allow credentials (cookies, auth headers).")
    ssl_keyfile: str | None = _opt(None, "TLS private key file (PEM); with --ssl-certfile.")
    ssl_certfile: str | None = _opt(None, "TLS certificate file (PEM): serve HTTPS.")
    ssl_ca_certs: str | None = _opt(None, "CA certificates file to verify client certificates.")
    root_path: str | None = _opt(
        None, "URL prefix under which a reverse proxy serves this app (ASGI root_path)."
    )
    api_server_count: int = _opt(
        1,
        "HTTP frontend processes sharing --port (SO_REUSEPORT: the kernel spreads "
        "connections over them), each its own client of the one engine core; /metrics "
        "answers the sum over all of them. Raise it when one frontend process is busy "
        "(many concurrent streams of a fast model): each one serves HTTP, JSON and "
        "detokenizing on one core.",
    )
    metrics_prefix: str = _opt(
        "vtllm",
        "Prefix of every Prometheus series: vtllm (vtllm:*) or vllm (vllm:*, so "
        "dashboards and alerts written for vLLM work unchanged).",
        choices=("vtllm", "vllm"),
    )


@dataclass
class EngineEndpointConfig:
    engine_address: str | None = _opt(
        None,
        "serve: connect to this already running engine core (started with `vtllm "
        "engine-core`) instead of starting one. engine-core: the address to bind "
        "(ipc://PATH or tcp://HOST:PORT; default: ipc:// in a private runtime dir).",
    )
    engine_curve_key_file: str | None = _opt(
        None,
        "CurveZMQ key file securing a tcp:// engine address. engine-core: the engine's "
        "file (`vtllm keygen server`: its key pair and the client public keys it admits). "
        "serve --engine-address: this client's file (`vtllm keygen client`). Required to "
        "bind a tcp:// address.",
    )
    engine_allow_insecure_loopback: bool = _opt(
        False,
        "engine-core: allow a loopback tcp:// engine address without CurveZMQ keys. Every "
        "local user can then connect and submit requests (bypassing --api-key); prefer "
        "ipc:// (owner-only) or a key file.",
    )
    engine_max_frame_bytes: int = _opt(
        0,
        "engine-core: longest client message the engine core reads (size with unit); a "
        "longer request is refused, one over 4x this is cut off with its connection. "
        "0: 16 bytes per token of max_model_len, at least 4MiB.",
        kind="size",
    )
    shutdown_timeout: float = _opt(
        30.0,
        "Seconds a stopping server (SIGTERM/SIGINT) lets running requests finish before "
        "it ends the rest with an error; 0 ends them at once. Applies to the HTTP "
        "frontend's open streams and to the engine core's running requests.",
    )


@dataclass
class VtllmConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    engine: EngineEndpointConfig = field(default_factory=EngineEndpointConfig)

    def to_bytes(self) -> bytes:
        """JSON, to hand the config to a spawned process (never pickle)."""
        return msgspec.json.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> VtllmConfig:
        return msgspec.json.decode(data, type=cls)

    def validate(self) -> None:
        """Raise ValueError, naming the flag, for values no engine can run with."""
        problems = []
        if self.cache.block_size <= 0 or self.cache.block_size & (self.cache.block_size - 1):
            problems.append(f"--block-size must be a power of two, got {self.cache.block_size}")
        if not 0.0 < self.cache.gpu_memory_utilization <= 1.0:
            problems.append(
                "--gpu-memory-utilization must be in (0, 1], got "
                f"{self.cache.gpu_memory_utilization}"
            )
        if self.cache.kv_cache_memory <= 0:
            problems.append(f"--kv-cache-memory must be positive, got {self.cache.kv_cache_memory}")
        if self.frontend.api_server_count < 1:
            problems.append(
                f"--api-server-count must be >= 1, got {self.frontend.api_server_count}"
            )
        if self.scheduler.max_num_seqs < 1:
            problems.append(f"--max-num-seqs must be >= 1, got {self.scheduler.max_num_seqs}")
        if self.scheduler.max_num_batched_tokens < 1:
            problems.append(
                "--max-num-batched-tokens must be >= 1, got "
                f"{self.scheduler.max_num_batched_tokens}"
            )
        if self.scheduler.long_prefill_token_threshold < 0:
            problems.append(
                "--long-prefill-token-threshold must be >= 0 (0 = off), got "
                f"{self.scheduler.long_prefill_token_threshold}"
            )
        for flag, value in (
            ("--max-waiting-requests", self.scheduler.max_waiting_requests),
            ("--max-requests-per-client", self.scheduler.max_requests_per_client),
            ("--max-request-id-bytes", self.scheduler.max_request_id_bytes),
        ):
            if value < 1:
                problems.append(f"{flag} must be >= 1, got {value}")
        if self.model.quantization not in (None, "fp8", "none", "int8", "int4"):
            problems.append(
                f"--quantization {self.model.quantization!r} is not supported; supported: "
                "fp8, and on CPUs none, int8, int4"
            )
        if self.model.max_model_len is not None and self.model.max_model_len < 1:
            problems.append(f"--max-model-len must be >= 1, got {self.model.max_model_len}")
        if self.engine.shutdown_timeout < 0:
            problems.append(
                f"--shutdown-timeout must be >= 0 seconds, got {self.engine.shutdown_timeout}"
            )
        if self.parallel.tensor_parallel_size < 1:
            problems.append(
                f"--tensor-parallel-size must be >= 1, got {self.parallel.tensor_parallel_size}"
            )
        problems.extend(self._frontend_problems())
        if problems:
            raise ValueError("; ".join(problems))

    def _frontend_problems(self) -> list[str]:
        """The HTTP flags' values: logprob limit, CORS JSON lists, TLS pair."""
        import json

        problems, fe = [], self.frontend
        if not 0 <= fe.max_logprobs <= 20:
            problems.append(f"--max-logprobs must be in 0..20, got {fe.max_logprobs}")
        for flag, text in (
            ("--allowed-origins", fe.allowed_origins),
            ("--allowed-methods", fe.allowed_methods),
            ("--allowed-headers", fe.allowed_headers),
        ):
            if text is None:
                continue
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                problems.append(
                    f"{flag} takes a JSON list of strings such as '[\"*\"]', got {text!r}"
                )
        if bool(fe.ssl_keyfile) != bool(fe.ssl_certfile):
            problems.append("--ssl-keyfile and --ssl-certfile go together; give both or neither")
        return problems


def config_sections(config: VtllmConfig) -> list[tuple[str, Any]]:
    """(section name, section object) pairs, in CLI order."""
    return [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
