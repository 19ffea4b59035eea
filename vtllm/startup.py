"""Start-up checks that turn user mistakes into one-line errors (exit 2) before anything
slow happens: the HTTP port bound first (a taken port is reported within a second, before
the model is loaded), then the model resolved (Hugging Face name, GGUF, directory) and its
``config.json`` checked (architecture, ``--max-model-len`` against its context).

No torch here: the frontend process runs this.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
from pathlib import Path
from typing import Any

from vtllm import envs

logger = logging.getLogger("vtllm.startup")

# config.json ``architectures[0]`` values the workers build (vtllm.worker.models._MODELS;
# a test keeps the two equal, this copy avoids importing torch in the frontend).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
)


class StartupError(Exception):
    """A user mistake found at start-up; the CLI prints the one-line message, exits 2."""


def bind_http_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets bound to ``host:port`` (``--api-server-count``), one per frontend
    process: with more than one, each has SO_REUSEPORT and the kernel spreads incoming
    connections over them. The port is first bound alone (so one in use, even by a
    server that shares ports, is a StartupError as for one socket); a port 0 becomes the
    one the system chose, the same for all."""
    first = bind_http_socket(host, port)
    if count == 1:
        return [first]
    chosen = first.getsockname()[1]
    first.close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(bind_http_socket(host, chosen, reuse_port=True))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_http_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening: connections are refused until
    the server is ready, never left hanging). StartupError when the port is taken or the
    address is not this host's."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"--host {host!r} is not an address of this machine ({e})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {port} on {host} is already in use (another server?): stop it or "
                "choose another --port"
            ) from None
        if e.errno == errno.EACCES:
            raise StartupError(
                f"no permission to listen on port {port} (ports below 1024 need privileges): "
                "choose another --port"
            ) from None
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a model directory (StartupError when it is not readable JSON)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StartupError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise StartupError(f"{path} is not a JSON object")
    return config


def model_context_len(hf_config: dict[str, Any]) -> int | None:
    """The model's own context limit (``max_position_embeddings``, also inside a
    multimodal ``text_config``), None when the config does not say."""
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        value = cfg.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_model_config(
    hf_config: dict[str, Any],
    model_dir: str,
    max_model_len: int | None,
    quantization: str | None = None,
) -> None:
    """Refuse an architecture no worker builds, a quantisation no worker runs
    (``--quantization`` or the checkpoint's ``quantization_config``), and a
    ``--max-model-len`` above the model's context unless VT_ALLOW_LONG_MAX_MODEL_LEN is set
    (then a warning)."""
    from vtllm.worker.loader.quant_config import resolve_quantization  # plain Python

    architectures = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise StartupError(
            f"{model_dir}: architecture {architectures[0]!r} is not supported; vtllm serves "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    fp8_request = quantization if quantization in (None, "fp8") else None  # else CPU formats
    try:
        resolve_quantization(hf_config, fp8_request)
    except ValueError as e:
        raise StartupError(f"{model_dir}: {e}") from None
    context = model_context_len(hf_config)
    if max_model_len is None or context is None or max_model_len <= context:
        return
    if not envs.VT_ALLOW_LONG_MAX_MODEL_LEN:
        raise StartupError(
            f"--max-model-len {max_model_len} is above the model's context of {context} "
            f"tokens (max_position_embeddings in {model_dir}/config.json): lower it to "
            f"{context} or less, or set VT_ALLOW_LONG_MAX_MODEL_LEN=1 to go past it "
            "(outputs past the trained length are unreliable)"
        )
    logger.warning(
        "--max-model-len %d is above the model's context of %d tokens "
        "(VT_ALLOW_LONG_MAX_MODEL_LEN is set): outputs past %d tokens are unreliable",
        max_model_len,
        context,
        context,
    )
