"""The HTTP server: Starlette routes over a connected ``EngineClient``.

Every error is answered in OpenAI shape ``{"error": {message, type, param, code}}``:
bad JSON or a wrong field → 400 naming the field (also: not UTF-8, nested deeper than
``--max-json-depth``), unknown model → 404, a body over ``--max-request-bytes`` → 413, a
client too slow to send its request → 408 (http_deadlines.py), engine dead → 503. A
client mistake is never a 500, and client values echoed in errors are clipped.

With an API key (``--api-key`` / ``VT_API_KEY``), ``/v1/*``, ``/tokenize`` and
``/detokenize`` need ``Authorization: Bearer <key>`` (else 401; the scheme in any case,
the key compared in constant time); ``/health``, ``/ping``, ``/metrics``, ``/version`` and
``/openapi.json`` stay open. Probes of ``/health``, ``/ping`` and ``/metrics`` never reach
the access log (``--enable-log-requests`` controls the rest). No route redirects (a
trailing slash is a 404, never a
redirect built from the ``Host`` header).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

import vtllm
from vtllm import envs
from vtllm.config import VtllmConfig
from vtllm.frontend.body_guard import check_body
from vtllm.frontend.chat_template import detect_tool_parser
from vtllm.frontend.drain import Drain, DrainingServer, DrainMiddleware
from vtllm.frontend.generation import GenerationError, error_for
from vtllm.frontend.health import EngineHealth
from vtllm.frontend.http_deadlines import DeadlineH11Protocol
from vtllm.frontend.metrics import FrontendMetrics, StatsLogger
from vtllm.frontend.metrics_peers import MetricsPeers, scrape_all, serve_own_metrics
from vtllm.frontend.openai_types import OpenAIError, clip
from vtllm.frontend.openapi import openapi_document
from vtllm.frontend.request_defaults import (
    RequestDefaults,
    load_generation_defaults,
    request_params,
)
from vtllm.frontend.serving_chat import create_chat_completion
from vtllm.frontend.serving_completion import create_completion
from vtllm.frontend.serving_context import ServingContext, json_response, now_s
from vtllm.frontend.serving_embedding import POOLING_TYPES, create_embedding
from vtllm.frontend.serving_tokenize import detokenize, tokenize
from vtllm.frontend.tokenizer import ModelTokenizer
from vtllm.process import stop_signals_handled
from vtllm.protocol import transport
from vtllm.protocol.async_client import EngineClient, EngineDeadError, HandshakeError

logger = logging.getLogger(__name__)

# Largest request head (request line and headers) h11 buffers; more is a 400.
MAX_HEADER_BYTES = 64 * 1024

Handler = Callable[[ServingContext, bytes, Callable[[], Awaitable[bool]]], Awaitable[Response]]


def error_response(error: OpenAIError) -> Response:
    return json_response(error.to_dict(), error.status_code)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) more than ``max_bytes`` before reading it all."""
    too_large = OpenAIError(
        413,
        f"request body is larger than {max_bytes} bytes; send less or raise --max-request-bytes",
        "invalid_request_error",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def bearer_token(authorization: str) -> bytes | None:
    """The credentials of an ``Authorization: Bearer <token>`` header (the scheme is
    case-insensitive, RFC 7235), as the bytes the client sent; None for another scheme."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip().encode("latin-1")  # Starlette decoded the header as latin-1


def uvicorn_config(app: Starlette, config: VtllmConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings every vtllm HTTP server uses: h11 with read deadlines
    (``--http-header-timeout``, ``--http-body-timeout``), bounded headers, the
    keep-alive timeout; ``overrides`` are passed on (host, port, log settings)."""
    frontend = config.frontend
    protocol = DeadlineH11Protocol.with_deadlines(
        frontend.http_header_timeout, frontend.http_body_timeout
    )
    settings: dict[str, Any] = {
        "host": frontend.host,
        "port": frontend.port,
        "http": protocol,
        "timeout_keep_alive": frontend.http_keep_alive_timeout,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "access_log": frontend.enable_log_requests,
        "ssl_keyfile": frontend.ssl_keyfile,
        "ssl_certfile": frontend.ssl_certfile,
        "ssl_ca_certs": frontend.ssl_ca_certs,
        "root_path": frontend.root_path or "",
        **overrides,
    }
    return uvicorn.Config(app, **settings)


def _served_name(config: VtllmConfig, model_dir: str, engine: EngineClient) -> str:
    if config.model.served_model_name:
        return config.model.served_model_name
    if config.model.model:
        return config.model.model
    if engine.ready is not None and engine.ready.model:
        return engine.ready.model
    return Path(model_dir).name


def build_context(
    config: VtllmConfig,
    model_dir: str,
    engine_client: EngineClient,
    tokenizer_dir: str | None = None,
    default_max_tokens: int | None = None,
) -> ServingContext:
    """Load the tokenizer (``tokenizer_dir``, default the model's) and take the engine's
    limits from its ``Ready``."""
    ready = engine_client.ready
    if ready is None:
        raise RuntimeError("build_app needs a connected engine client (call connect first)")
    tokenizer = ModelTokenizer.from_dir(tokenizer_dir or model_dir, config.frontend.chat_template)
    unknown_eos = [i for i in tokenizer.eos_token_ids if i not in ready.eos_token_ids]
    if unknown_eos:  # the engine core decides EOS; say so if it disagrees with the tokenizer
        logger.warning(
            "the tokenizer's eos ids %s are not among the engine core's %s; generation "
            "does not stop on them (is the engine serving another model directory?)",
            unknown_eos,
            ready.eos_token_ids,
        )
    name = _served_name(config, model_dir, engine_client)
    aliases = tuple({ready.model, config.model.model or "", Path(model_dir).name} - {"", name})
    return ServingContext(
        tokenizer=tokenizer,
        engine=engine_client,
        model_name=name,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size or tokenizer.vocab_size,
        default_max_tokens=config.frontend.default_max_tokens or default_max_tokens,
        model_aliases=aliases,
        # --tool-call-parser, else the format the chat template teaches (if known)
        tool_call_parser=config.frontend.tool_call_parser
        or detect_tool_parser(tokenizer.chat_template),
        reasoning_parser=config.frontend.reasoning_parser,
        max_choices_per_request=config.frontend.max_choices_per_request,
        response_role=config.frontend.response_role,
        pooling_type=POOLING_TYPES[config.frontend.pooling_type],
    )


def build_app(
    config: VtllmConfig,
    model_dir: str,
    engine_client: EngineClient,
    tokenizer_dir: str | None = None,
    metrics_peers: MetricsPeers | None = None,
) -> Starlette:
    """The OpenAI-compatible app. ``engine_client`` must already be connected; the app's
    metrics (``app.state.metrics``) observe it from now on. ``metrics_peers``: the other
    frontend processes of this server, whose metrics ``/metrics`` adds to its own."""
    sampling_defaults, max_new_tokens = load_generation_defaults(
        model_dir, config.model.generation_config
    )
    request_defaults = RequestDefaults(sampling_defaults, config.frontend.max_logprobs)
    ctx = build_context(config, model_dir, engine_client, tokenizer_dir, max_new_tokens)
    metrics = FrontendMetrics(
        ctx.model_name,
        ctx.max_model_len,
        config.frontend.metrics_prefix,
        cache_info(config, engine_client),
    )
    engine_client.add_observer(metrics)
    engine_health = EngineHealth(engine_client)
    engine_client.add_observer(engine_health)
    max_bytes = config.frontend.max_request_bytes
    api_key = config.frontend.api_key or envs.VT_API_KEY
    expected_key = (api_key or "").encode()
    max_depth = config.frontend.max_json_depth
    openapi = json_response(openapi_document(vtllm.__version__, bool(api_key), ctx.vocab_size)).body

    def check_auth(request: Request) -> None:
        if not api_key:
            return
        given = bearer_token(request.headers.get("authorization", ""))
        if given is None or not hmac.compare_digest(given, expected_key):
            raise OpenAIError(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
            )

    def endpoint(
        handler: Handler, generation: str | None = None
    ) -> Callable[[Request], Awaitable[Response]]:
        """``generation`` ("chat", "completion"): the request defaults apply to its body."""

        async def run(request: Request) -> Response:
            try:
                check_auth(request)
                body = await read_body(request, max_bytes)
                # a worker thread for large bodies: the scan is numpy, the loop keeps serving
                await ctx.off_loop(len(body), check_body, body, max_depth)
                params = None
                if generation is not None:
                    params = request_params(body)
                    if request_defaults.active:
                        chat = generation == "chat"
                        body = await ctx.off_loop(len(body), request_defaults.apply, body, chat)
                if not engine_client.is_alive:
                    raise EngineDeadError(engine_client.dead_reason or "not connected")
                response = await handler(ctx, body, request.is_disconnected)
                if params is not None and response.status_code < 400:
                    metrics.on_http_request(*params)
                return response
            except ClientDisconnect:
                return Response(status_code=499)
            except (OpenAIError, EngineDeadError, GenerationError) as e:
                return error_response(error_for(e))

        return run

    def model_card() -> dict[str, Any]:
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": now_s(),
            "owned_by": "vtllm",
            "root": model_dir,
            "max_model_len": ctx.max_model_len,
        }

    async def models(request: Request) -> Response:
        check_auth(request)
        return json_response({"object": "list", "data": [model_card()]})

    async def model_by_id(request: Request) -> Response:
        check_auth(request)
        model_id = request.path_params["model_id"]
        if model_id != ctx.model_name:
            raise OpenAIError(
                404,
                f"model {clip(model_id)!r} does not exist; this server serves {ctx.model_name!r}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        return json_response(model_card())

    async def health(request: Request) -> Response:
        problem = engine_health.problem()
        if problem is None:
            return Response(status_code=200)
        return error_response(OpenAIError(503, problem, "service_unavailable"))

    async def version(request: Request) -> Response:
        return json_response({"version": vtllm.__version__})

    async def prometheus(request: Request) -> Response:
        if metrics_peers is not None and metrics_peers.peer_paths:
            body = await scrape_all(metrics.registry, metrics_peers, metrics.engine_wide_names)
            return Response(body, media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi_json(request: Request) -> Response:
        return Response(openapi, media_type="application/json")

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(exc.status_code, str(exc.detail), kind))

    async def on_openai_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return error_response(exc)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(error_for(exc))

    routes = [
        Route("/v1/chat/completions", endpoint(create_chat_completion, "chat"), methods=["POST"]),
        Route("/v1/completions", endpoint(create_completion, "completion"), methods=["POST"]),
        Route("/v1/embeddings", endpoint(create_embedding), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_by_id, methods=["GET"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET"]),  # SageMaker's probe (vLLM's too)
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[*cors_middleware(config), Middleware(DrainMiddleware, drain=ctx.drain)],
        exception_handlers={
            HTTPException: on_http_error,
            OpenAIError: on_openai_error,
            Exception: on_unexpected,
        },
    )
    # a trailing slash is a 404: Starlette's redirect would build Location from Host
    app.router.redirect_slashes = False
    app.state.serving = ctx
    app.state.metrics = metrics
    app.state.health = engine_health
    return app


def cache_info(config: VtllmConfig, engine: EngineClient) -> dict[str, str]:
    """Labels of the cache_config_info series (vLLM's names for the KV-cache settings)."""
    ready = engine.ready
    return {
        "block_size": str(ready.block_size if ready else config.cache.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(config.cache.enable_prefix_caching),
        "gpu_memory_utilization": str(config.cache.gpu_memory_utilization),
        "num_gpu_blocks": str(ready.num_kv_blocks if ready else 0),
    }


def cors_middleware(config: VtllmConfig) -> list[Middleware]:
    """CORS as vLLM's --allowed-origins/--allowed-methods/--allowed-headers/
    --allow-credentials set it; none when --allowed-origins is unset."""
    fe = config.frontend
    if fe.allowed_origins is None:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=json.loads(fe.allowed_origins),
            allow_methods=json.loads(fe.allowed_methods),
            allow_headers=json.loads(fe.allowed_headers),
            allow_credentials=fe.allow_credentials,
        )
    ]


PROBE_PATHS = frozenset({"/health", "/ping", "/metrics"})


class ProbeAccessFilter(logging.Filter):
    """Drops uvicorn access-log records of probe paths (load balancers and Prometheus
    poll them every few seconds; vLLM leaves them out too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in PROBE_PATHS
        return True


def install_probe_filter() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, ProbeAccessFilter) for f in access.filters):
        access.addFilter(ProbeAccessFilter())


def run_frontend(
    config: VtllmConfig,
    model_dir: str,
    engine_address: str,
    engine_alive: Callable[[], bool] | None = None,
    sock: socket.socket | None = None,
    tokenizer_dir: str | None = None,
    metrics_peers: MetricsPeers | None = None,
) -> int:
    """Connect to the engine core and serve HTTP until SIGINT/SIGTERM or engine death.
    ``metrics_peers``: one of several frontend processes (``--api-server-count``).

    A signal drains (drain.py): new requests get 503, running ones may finish within
    ``--shutdown-timeout``, the rest end with an error; then the engine client says
    Goodbye. Returns 0 after a signal-initiated stop (whatever the engine did meanwhile),
    1 if the engine died first or never got ready."""
    if metrics_peers is None:  # else: one of several, named by its process (api_servers.py)
        try:
            import setproctitle

            setproctitle.setproctitle("VTLLM::Frontend")
        except ImportError:  # pragma: no cover - optional at runtime
            pass
    return asyncio.run(
        _serve(config, model_dir, engine_address, engine_alive, sock, tokenizer_dir, metrics_peers)
    )


@contextlib.contextmanager
def _signals_recorded() -> Iterator[None]:
    """uvicorn re-raises the SIGINT/SIGTERM it handled once it has stopped; with the
    default handlers that would kill the process before the engine client says Goodbye.
    Record them instead (main thread only: that is where signal handlers live)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with stop_signals_handled(lambda signum, frame: None):
        yield


async def _serve(
    config: VtllmConfig,
    model_dir: str,
    engine_address: str,
    engine_alive: Callable[[], bool] | None,
    sock: socket.socket | None = None,
    tokenizer_dir: str | None = None,
    metrics_peers: MetricsPeers | None = None,
) -> int:
    """``sock``: the listening socket bound at start-up (launch.py), else host:port."""
    engine = EngineClient()
    server: DrainingServer | None = None
    drain: Drain | None = None
    died_while_serving = False
    metrics_server: asyncio.AbstractServer | None = None

    def on_dead(reason: str) -> None:
        nonlocal died_while_serving
        if drain is not None and drain.stopping:
            logger.warning("engine core gone while stopping: %s", reason)
        else:
            died_while_serving = True
            logger.error("stopping the HTTP server: %s", reason)
        if server is not None:
            server.should_exit = True

    try:
        key_file = config.engine.engine_curve_key_file
        await engine.connect(
            engine_address,
            f"frontend-{os.getpid()}",
            engine_alive=engine_alive,
            on_dead=on_dead,
            curve_keys=transport.ClientKeys.load(key_file) if key_file else None,
            # a remote engine core (no probe) may come back: 503 meanwhile, then reconnect
            reconnect=engine_alive is None,
        )
    except (HandshakeError, OSError, ValueError) as e:  # refused, or a bad key file
        logger.error("%s", e)
        return 1
    try:
        app = build_app(config, model_dir, engine, tokenizer_dir, metrics_peers)
        drain = app.state.serving.drain
        if metrics_peers is not None:
            metrics_server = await serve_own_metrics(
                app.state.metrics.registry, metrics_peers.own_path
            )
        install_probe_filter()
        uv_config = uvicorn_config(
            app,
            config,
            log_level=config.frontend.uvicorn_log_level or envs.VT_LOG_LEVEL.lower(),
            log_config=None,  # vtllm's own handlers (text or JSON lines, see vtllm/log.py)
            timeout_graceful_shutdown=5,  # a backstop: the drain has ended every request
        )
        server = DrainingServer(uv_config, drain, config.engine.shutdown_timeout)
        logger.info(
            "serving %s on %s://%s:%d",
            app.state.serving.model_name,
            "https" if config.frontend.ssl_certfile else "http",
            uv_config.host,
            uv_config.port,
        )
        stats_log = asyncio.create_task(
            StatsLogger(app.state.metrics).run()
            if not config.frontend.disable_log_stats
            else asyncio.sleep(0)
        )
        try:
            with _signals_recorded():
                await server.serve(sockets=[sock] if sock is not None else None)
        finally:
            stats_log.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stats_log
            if metrics_server is not None:
                metrics_server.close()
        if not server.started and engine.dead_reason is None:
            return 1  # could not bind the port (uvicorn logged why)
    finally:
        dead = engine.dead_reason is not None
        await engine.close()
    if died_while_serving or (dead and server.stop_signal is None):
        return 1
    return 0  # a requested stop, whatever the engine core did meanwhile
