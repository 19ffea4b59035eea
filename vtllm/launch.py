"""``vtllm serve``: resolve the model, start the engine core (which starts the workers),
then run the HTTP frontend in this process until SIGTERM/SIGINT or engine death.

Process tree (titles as ``ps`` shows them)::

    VTLLM::Frontend          this process: uvicorn + Starlette
    ├─ VTLLM::EngineCore     scheduler loop, KV bookkeeping
    │  ├─ VTLLM::Worker_TP0  model + KV cache on device 0
    │  └─ VTLLM::Worker_TP1  ...
    └─ VTLLM::APIServer_1    with --api-server-count 2 and more (api_servers.py)

Every child dies with its parent (PR_SET_PDEATHSIG), and the ipc sockets live in a private
runtime directory removed on exit, so nothing is orphaned or left stale.

Stopping (SIGTERM / SIGINT, to this process alone or to the whole process group as
systemd and Ctrl-C do): the frontend drains its requests (``--shutdown-timeout``) and
says Goodbye, then this process stops the engine core (which stops its workers) and
exits 0 once it has exited. Before the HTTP server is up (the model still loading), a
stop does the same at once: the start-up is abandoned, not waited for.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from vtllm import envs
from vtllm.api_servers import ApiServers, metrics_paths, peers_of
from vtllm.config import VtllmConfig
from vtllm.engine_core.core_proc import run_engine_core
from vtllm.log import configure_logging
from vtllm.process import (
    StopRequested,
    set_process_title,
    stop_resource_tracker,
    stop_signals_handled,
    stop_signals_raise,
)
from vtllm.protocol import transport
from vtllm.startup import (
    StartupError,
    bind_http_sockets,
    check_model_config,
    read_model_config,
)

logger = logging.getLogger("vtllm.launch")

EXIT_ENGINE_DIED = 3


def resolve_model(config: VtllmConfig) -> str:
    """The HF-style model directory to serve: a Hugging Face name downloaded (or found in
    the HF cache), a GGUF converted once (cached), or the directory given; its
    config.json checked (architecture, --max-model-len). StartupError on a user mistake."""
    from vtllm.hub import resolve_model_name
    from vtllm.worker.loader.gguf_convert import resolve_model_dir

    started = time.monotonic()
    model = config.model
    name = resolve_model_name(model.model, model.revision, model.download_dir)
    try:
        model_dir = str(resolve_model_dir(name, envs.VT_CACHE_DIR, progress=logger.info))
    except (FileNotFoundError, NotImplementedError) as e:
        raise StartupError(str(e).splitlines()[0]) from None
    check_model_config(
        read_model_config(model_dir), model_dir, model.max_model_len, model.quantization
    )
    if model.trust_remote_code:
        logger.info(
            "--trust-remote-code is not needed: vtllm never runs code from a checkpoint "
            "(its architectures are built in)"
        )
    elapsed = time.monotonic() - started
    if elapsed > 1.0:
        logger.info("model %s ready in %s (%.1fs)", model.model or "(embedded)", model_dir, elapsed)
    return model_dir


def resolve_tokenizer(config: VtllmConfig, model_dir: str) -> str:
    """The directory the frontend's tokenizer comes from: --tokenizer (a directory or a
    Hugging Face name), else the model's."""
    from vtllm.hub import resolve_model_name

    model = config.model
    name = resolve_model_name(
        model.tokenizer, model.tokenizer_revision, model.download_dir, "tokenizer"
    )
    if name is None:
        return model_dir
    if not (Path(name) / "tokenizer.json").is_file():
        raise StartupError(f"--tokenizer {model.tokenizer!r}: {name} has no tokenizer.json")
    return name


def worker_addresses(runtime_dir) -> tuple[str, str]:
    """(the engine core's worker socket, the torch.distributed rendezvous) for one engine."""
    worker_address = transport.ipc_address(runtime_dir, "workers.sock")
    return worker_address, f"tcp://127.0.0.1:{transport.free_tcp_port()}"


def start_engine_core(
    config: VtllmConfig, model_dir: str, runtime_dir
) -> tuple[multiprocessing.process.BaseProcess, str]:
    """Spawn the engine-core process; returns it and the address clients connect to."""
    client_address = transport.ipc_address(runtime_dir, "engine.sock")
    worker_address, dist_init_address = worker_addresses(runtime_dir)
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(
        target=run_engine_core,
        args=(config.to_bytes(), model_dir, client_address, worker_address, dist_init_address),
        name="VTLLM::EngineCore",
        daemon=False,  # it starts worker processes of its own
    )
    process.start()
    return process, client_address


# Beyond the engine core's own drain (--shutdown-timeout): stopping its workers.
STOP_MARGIN_S = 15.0


def stop_process(process: multiprocessing.process.BaseProcess, timeout_s: float = 10.0) -> None:
    """SIGTERM, wait up to ``timeout_s`` for the process to exit, else SIGKILL."""
    if process.is_alive():
        process.terminate()  # SIGTERM: the engine core stops its workers and exits
        process.join(timeout_s)
    if process.is_alive():
        logger.warning("engine core did not stop within %.0fs; killing it", timeout_s)
        process.kill()
        process.join(5)


def _stop_signals_ignored() -> contextlib.AbstractContextManager[None]:
    """While stopping: a further SIGTERM / SIGINT (a second Ctrl-C, systemd's group
    signal arriving late) must not kill this process before its children have exited."""

    def already_stopping(signum: int, frame: object) -> None:
        logger.info("%s: already stopping", signal.Signals(signum).name)

    return stop_signals_handled(already_stopping)


def serve(
    config: VtllmConfig,
    sock: socket.socket | None = None,
    more_sockets: Sequence[socket.socket] = (),
) -> int:
    """Run until stopped. Exit code 0 on a clean or signal-initiated stop, non-zero if the
    engine died or refused to start, or a frontend process exited on its own (so
    systemd's Restart=on-failure restarts it).

    With ``--engine-address``: only the frontend(s), against a running ``vtllm engine-core``.
    ``more_sockets``: the sockets of frontends 1..N-1 (``--api-server-count``, api_servers.py).
    """
    set_process_title("VTLLM::Frontend")
    configure_logging("VTLLM::Frontend")
    from vtllm.frontend.app import run_frontend

    # the port first (``sock``: bound by the CLI already): a conflict is reported at
    # once, not after loading the model
    if sock is None:
        sock, *more_sockets = bind_http_sockets(
            config.frontend.host, config.frontend.port, config.frontend.api_server_count
        )
    try:
        model_dir = resolve_model(config)
        tokenizer_dir = resolve_tokenizer(config, model_dir)
    except BaseException:
        for one in (sock, *more_sockets):
            one.close()
        raise
    runtime_dir = transport.make_runtime_dir()
    engine = None
    api_servers = ApiServers()
    metrics_peers = None
    try:
        try:
            # until the HTTP server takes the signals over (it drains), a stop unwinds to
            # the cleanup below, which stops the children and waits for them
            with stop_signals_raise():
                client_address = config.engine.engine_address
                if client_address is None:
                    engine, client_address = start_engine_core(config, model_dir, runtime_dir)
                if more_sockets:
                    paths = metrics_paths(runtime_dir, len(more_sockets) + 1)
                    metrics_peers = peers_of(0, paths)
                    engine_pid = engine.pid if engine is not None else None
                    api_servers.start(
                        config, model_dir, tokenizer_dir, client_address, engine_pid,
                        more_sockets, paths,
                    )  # fmt: skip
                code = run_frontend(
                    config,
                    model_dir,
                    client_address,
                    engine_alive=engine.is_alive if engine is not None else None,
                    sock=sock,
                    tokenizer_dir=tokenizer_dir,
                    metrics_peers=metrics_peers,
                )
        except StopRequested as stop:
            logger.info("%s before the server was up: stopping the engine core", stop)
            code = 0
        exitcode = engine.exitcode if engine is not None else None
        if code != 0 and exitcode is not None and exitcode != 0:
            logger.error("engine core exited with code %s", exitcode)
            code = exitcode if exitcode > 0 else EXIT_ENGINE_DIED
        if api_servers.failed is not None:
            code = code or 1
        return code
    finally:
        with _stop_signals_ignored():
            api_servers.stop(config.engine.shutdown_timeout + STOP_MARGIN_S)
            if engine is not None:
                stop_process(engine, config.engine.shutdown_timeout + STOP_MARGIN_S)
            transport.remove_runtime_dir(runtime_dir)
            stop_resource_tracker()
            sock.close()


def engine_core(config: VtllmConfig) -> int:
    """``vtllm engine-core``: the engine core and its workers, headless, serving frontends
    that connect over ZMQ (``vtllm serve --engine-address``, or ``vtllm.protocol.client``).
    """
    configure_logging("VTLLM::EngineCore")
    model_dir = resolve_model(config)
    runtime_dir = transport.make_runtime_dir()
    address = config.engine.engine_address or transport.ipc_address(runtime_dir, "engine.sock")
    worker_address, dist_init_address = worker_addresses(runtime_dir)
    try:
        run_engine_core(
            config.to_bytes(), model_dir, address, worker_address, dist_init_address, headless=True
        )
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        transport.remove_runtime_dir(runtime_dir)
    return 0
