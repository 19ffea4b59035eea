"""The engine-core process: ``EngineCore`` behind a ZMQ ROUTER, workers behind an executor.

Threads::

    client I/O thread (client_channel.py)        engine loop (main thread)
      recv → decode → handshake / heartbeats  ─▶  inbox queue ─▶ add / abort / utility
      send ◀── inproc PULL ◀──────────────────────  PUSH ◀── outputs + stats per step
    heartbeat thread (VT_ENGINE_STEP_LOG)         reads loop counters
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import sys
import threading
import time
import uuid

import msgspec
import zmq

from vtllm import envs
from vtllm.config import VtllmConfig
from vtllm.engine_core.client_channel import ClientChannel, ClientGone, frame_limit
from vtllm.engine_core.core import ClientId, EngineCore, EngineFacts, Outputs
from vtllm.engine_core.executor import MultiprocExecutor, WorkerDiedError
from vtllm.engine_core.guards import KVCacheTooSmallError, check_kv_cache_fits
from vtllm.engine_core.step_log import StepHeartbeat
from vtllm.process import (
    StopRequested,
    become_child_process,
    stop_resource_tracker,
    stop_signals_raise,
)
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m

logger = logging.getLogger(__name__)

EXIT_START_FAILED = 2
EXIT_WORKER_DIED = 3


class EngineCoreProc:
    """The engine loop: drain the inbox, step, publish.

    Stopping (SIGTERM/SIGINT, which systemd and Ctrl-C deliver to every process at once):
    the first signal starts a drain — new requests are refused with an error that says
    so, running and waiting ones go on until they finish or ``--shutdown-timeout``
    passes, then the rest end with an error finish and the loop returns 0. A second
    signal stops at once. Clients are told (``EngineDead``) before the loop returns, so
    none waits for a heartbeat timeout. A lost worker returns ``EXIT_WORKER_DIED``.
    """

    def __init__(
        self,
        core: EngineCore,
        channel: ClientChannel,
        inbox: queue.Queue,
        shutdown_timeout_s: float = 0.0,
    ):
        self.core = core
        self.channel = channel
        self.inbox = inbox
        self.shutdown_timeout_s = shutdown_timeout_s
        self._outbox = channel.ctx.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.connect(channel.outbox_address)
        self._stopping = False
        self._draining_since: float | None = None

    def request_stop(self, *_: object) -> None:
        """Signal handler: the first call starts the drain, the second stops now."""
        if self._draining_since is None:
            self._draining_since = time.monotonic()
            logger.info(
                "stopping: refusing new requests; %d unfinished requests may finish within "
                "%gs (--shutdown-timeout); signal again to stop now",
                self.core.scheduler.num_unfinished,
                self.shutdown_timeout_s,
            )
        else:
            self._stopping = True

    def _drain_done(self) -> bool:
        """While draining: True once nothing is left, or (after failing what is left)
        once the shutdown timeout has passed."""
        if self._draining_since is None:
            return False
        if not self.core.scheduler.num_unfinished:
            return True
        waited = time.monotonic() - self._draining_since
        if waited < self.shutdown_timeout_s:
            return False
        reason = (
            f"the engine core is stopping and this request did not finish within the "
            f"shutdown timeout ({self.shutdown_timeout_s:g}s, --shutdown-timeout)"
        )
        logger.warning("shutdown timeout: ending %d requests", self.core.scheduler.num_unfinished)
        self._publish(self.core.fail_all(reason), None)
        return True

    def run(self) -> int:
        code = self._loop()
        if code == 0:
            self._publish(self.core.fail_all("the engine core stopped (signalled twice)"), None)
            self._broadcast(m.EngineDead("the engine core stopped (SIGTERM/SIGINT)"))
            time.sleep(0.2)  # let the I/O thread flush
        return code

    def _loop(self) -> int:
        while not self._stopping and not self._drain_done():
            try:
                item = self.inbox.get(timeout=0.0 if self.core.has_work() else 0.1)
                self._handle(*item)
                while True:
                    self._handle(*self.inbox.get_nowait())
            except queue.Empty:
                pass
            if not self.core.has_work():
                continue
            try:
                outputs, stats = self.core.step()
            except WorkerDiedError as e:
                reason = f"the engine lost a worker: {e}"
                logger.error("%s; failing every request and exiting", reason)
                self._publish(self.core.fail_all(reason), None)
                self._broadcast(m.EngineDead(reason))
                time.sleep(0.5)  # let the I/O thread flush
                return EXIT_WORKER_DIED
            self._publish(outputs, stats)
        return 0

    def _handle(self, client_id: ClientId, message: object) -> None:
        if isinstance(message, m.AddRequest) and self._draining_since is not None:
            refusal = m.RequestOutput(
                request_id=message.request_id,
                new_token_ids=[],
                finish_reason=m.FinishReason.ERROR,
                error="the engine core is shutting down and accepts no new requests; "
                "send it to another server or retry after the restart",
                num_prompt_tokens=len(message.prompt_token_ids),
                error_code=m.ErrorCode.UNAVAILABLE,
            )
            self._publish([(client_id, refusal)], None)
        elif isinstance(message, m.AddRequest):
            self._publish(self.core.add_request(client_id, message), None)
        elif isinstance(message, m.AbortRequests):
            self._publish(self.core.abort(message.request_ids, client_id), None)
        elif isinstance(message, ClientGone):
            self.core.abort_client(client_id)
        elif isinstance(message, m.UtilityRequest):
            self._utility(client_id, message)

    def _utility(self, client_id: ClientId, call: m.UtilityRequest) -> None:
        try:
            args = [codec.decode_value(a) for a in call.args]
            result = self.core.utility(call.method, args)
            response = m.UtilityResponse(
                call.call_id, True, msgspec.Raw(codec.encode_value(result))
            )
        except Exception as e:  # a refusal or a bad argument: the caller gets the reason
            response = m.UtilityResponse(call.call_id, False, error=str(e))
        self._outbox.send_multipart([client_id, codec.encode(response)])

    def _publish(self, outputs: Outputs, stats: m.SchedulerStats | None) -> None:
        """One EngineOutputs per client; stats (once per step) go to every client."""
        per_client: dict[ClientId, list[m.RequestOutput]] = {}
        for client_id, output in outputs:
            per_client.setdefault(client_id, []).append(output)
        if stats is not None:
            for client_id in list(self.channel.clients):
                per_client.setdefault(client_id, [])
        now = time.time()
        for client_id, client_outputs in per_client.items():
            message = m.EngineOutputs(client_outputs, stats, now)
            self._outbox.send_multipart([client_id, codec.encode(message)])

    def _broadcast(self, message: m.EngineDead) -> None:
        payload = codec.encode(message)
        for client_id in list(self.channel.clients):
            self._outbox.send_multipart([client_id, payload])

    def close(self) -> None:
        self._outbox.close(linger=0)


def start_engine(config: VtllmConfig, model_dir: str, worker_address: str, dist_init_address: str):
    """Start workers, size and fit the KV cache. Returns (executor, facts)."""
    executor = MultiprocExecutor(config, model_dir, worker_address, dist_init_address)
    try:
        reports = executor.start()
        facts = reports[0].facts
        usable_kv_bytes = min(r.usable_kv_bytes for r in reports)
        block_size = config.cache.block_size
        fit = check_kv_cache_fits(
            usable_kv_bytes=usable_kv_bytes,
            kv_bytes_per_token=facts.kv_bytes_per_token,
            block_size=block_size,
            model_max_len=facts.max_position_embeddings,
            pinned_max_model_len=config.model.max_model_len,
            memory_flag="--kv-cache-memory on CPU, --gpu-memory-utilization on GPU",
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.3f GiB, %d bytes/token, --kv-cache-dtype %s)"
            "; max_model_len %d",
            fit.num_blocks,
            block_size,
            fit.num_blocks * block_size * facts.kv_bytes_per_token / 1024**3,
            facts.kv_bytes_per_token,
            config.cache.kv_cache_dtype,
            fit.max_model_len,
        )
        executor.init_kv_cache(fit.num_blocks, block_size)
    except BaseException:
        executor.shutdown()
        raise
    engine_facts = EngineFacts(
        model_name=config.model.served_model_name or facts.model_name,
        max_model_len=fit.max_model_len,
        vocab_size=facts.vocab_size,
        num_blocks=fit.num_blocks,
        block_size=block_size,
        eos_token_ids=tuple(facts.eos_token_ids),
        on_gpu=reports[0].on_gpu,
    )
    return executor, engine_facts


def run_engine_core(
    config_bytes: bytes,
    model_dir: str,
    client_address: str,
    worker_address: str,
    dist_init_address: str,
    headless: bool = False,
) -> None:
    """Process entry. Exit codes: 0 clean stop, 2 start-up refused, 3 a worker died.

    ``headless``: the engine core is the top process (``vtllm engine-core``), not a child
    of ``vtllm serve``."""
    if headless:
        from vtllm.log import configure_logging
        from vtllm.process import set_process_title

        set_process_title("VTLLM::EngineCore")
        configure_logging("VTLLM::EngineCore")
    else:
        become_child_process("VTLLM::EngineCore")
    config = VtllmConfig.from_bytes(config_bytes)
    curve_keys = None
    try:
        if config.engine.engine_curve_key_file:
            curve_keys = transport.ServerKeys.load(config.engine.engine_curve_key_file)
        transport.check_bind_security(
            client_address,
            curve_keys,
            allow_insecure_loopback=config.engine.engine_allow_insecure_loopback,
        )
    except (OSError, ValueError, KeyError) as e:
        logger.error("%s", e)
        sys.exit(EXIT_START_FAILED)
    # a stop signal from here until the loop takes over is recorded (and honoured then);
    # during start_engine it ends the start-up at once: the workers are stopped (killed
    # when they do not answer, e.g. while loading weights) and the process exits 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        with stop_signals_raise():
            executor, facts = start_engine(config, model_dir, worker_address, dist_init_address)
    except StopRequested as e:
        # a worker whose start the signal cut short is no executor's to stop: it ignores
        # SIGTERM, so multiprocessing's exit-time join would wait for it for ever
        for child in multiprocessing.active_children():
            child.kill()
            child.join(2)
        logger.info("%s during start-up: workers stopped, engine core exiting", e)
        stop_resource_tracker()
        sys.exit(0)
    except (KVCacheTooSmallError, WorkerDiedError) as e:
        logger.error("refusing to start: %s", e)
        sys.exit(EXIT_START_FAILED)

    ready = m.Ready(
        protocol_version=m.PROTOCOL_VERSION,
        model=facts.model_name,
        max_model_len=facts.max_model_len,
        vocab_size=facts.vocab_size,
        num_kv_blocks=facts.num_blocks,
        block_size=facts.block_size,
        eos_token_ids=list(facts.eos_token_ids),
        engine_id=uuid.uuid4().hex[:12],
        max_frame_bytes=frame_limit(config.engine.engine_max_frame_bytes, facts.max_model_len),
    )
    core = EngineCore(config, facts, executor)
    inbox: queue.Queue = queue.Queue()
    ctx = zmq.Context.instance()
    channel = ClientChannel(ctx, client_address, ready, inbox, curve_keys, ready.max_frame_bytes)
    channel.start()
    channel.bound.wait(10)
    proc = EngineCoreProc(core, channel, inbox, config.engine.shutdown_timeout)
    signal.signal(signal.SIGTERM, proc.request_stop)
    signal.signal(signal.SIGINT, proc.request_stop)
    if stop.is_set():
        proc.request_stop()
    heartbeat = None
    if envs.VT_ENGINE_STEP_LOG:
        heartbeat = StepHeartbeat(
            envs.VT_ENGINE_STEP_LOG,
            core.counters,
            core.heartbeat_snapshot,
            executor.describe_liveness,
        )
        heartbeat.start()
    logger.info("engine core ready at %s", client_address)
    code = 1
    try:
        code = proc.run()
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        executor.shutdown()
        stop_resource_tracker()  # spawned with the workers: reaped, so none outlives us
        channel.stop()
        channel.join(5)
        proc.close()
        logger.info("engine core stopped (exit %d)", code)
    sys.exit(code)
