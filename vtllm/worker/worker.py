"""The worker process of one tensor-parallel rank: entry ``run_worker``.

Start-up RPC with the engine core (ZMQ DEALER, identity ``rank-N``)::

    worker                                   engine core
      load model, profile memory
      WorkerReport{rank, facts, usable_kv} ─▶
                                          ◀─ InitKVCache{num_blocks, block_size}
      allocate KV, warm up
      WorkerReady{rank}                    ─▶
                                          ◀─ SchedulerOutput   (every step, every rank)
      ModelRunnerOutput (rank 0 only)      ─▶
                                          ◀─ CompileGrammar    (rank 0, between steps)
      GrammarReady (when the compile ends) ─▶
                                          ◀─ ReleaseGrammars   (rank 0)
                                          ◀─ Shutdown          → exit 0

Grammars compile on background threads (``worker/grammar.py``); the main loop polls every
``_GRAMMAR_POLL_MS`` while a compile is unreported, so ``GrammarReady`` goes out promptly
whether the worker is idle or between steps, and no step ever waits for a compile.

Async scheduling (``--async-scheduling``): the driver's step output is deferred (its
sampled ids copied to the host behind the step's device work). While one is pending the
loop waits for whichever comes first — the next message (a next step is prepared and
queued on the device *before* the pending output is sent, so the device never idles while
the host works) or the copy being done (then the output goes out at once)::

    recv N+1 ─ prepare + queue N+1 ─ send N (waits for N's copy) ─ recv N+2 ─ ...

Any exception sends ``WorkerFailure{rank, message}`` and exits non-zero.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import torch
import zmq

from vtllm import envs
from vtllm.config import VtllmConfig, async_scheduling_enabled
from vtllm.process import become_child_process
from vtllm.protocol import codec
from vtllm.protocol import messages as m
from vtllm.worker.compile_watch import CompileWatch
from vtllm.worker.compile_watch import install as watch_compiles
from vtllm.worker.decode_graphs import capture_sizes
from vtllm.worker.distributed import destroy_distributed, init_distributed
from vtllm.worker.heartbeat import HeartbeatSender
from vtllm.worker.kv_cache_dtype import describe_kv_scales, is_fp8, resolve_kv_cache_dtype
from vtllm.worker.layers.cpu_quant import choose_quantization, fast_int4_cpu
from vtllm.worker.layers.small_batch import tune_small_batch_linears
from vtllm.worker.loader.hf_config import load_hf_config, model_facts
from vtllm.worker.loader.quant_config import resolve_quantization
from vtllm.worker.memory_budget import memory_budget
from vtllm.worker.model_runner import ModelRunner, attention_backend
from vtllm.worker.platform import MemorySnapshot, Platform, detect_platform
from vtllm.worker.runner_output import DeferredOutput
from vtllm.worker.sampler import penalty_state_bytes

logger = logging.getLogger(__name__)

_POLL_MS = 1000
_GRAMMAR_POLL_MS = 2
_PENDING_SPIN_S = 20e-6  # how long a wait for the next step or a pending output naps


class _ParentGone(RuntimeError):
    pass


def run_worker(
    config_bytes: bytes,
    model_dir: str,
    rank: int,
    world_size: int,
    engine_address: str,
    dist_init_address: str,
) -> None:
    """Process entry (spawned). Returns only by ``sys.exit``: 0 after ``Shutdown``."""
    become_child_process(f"VTLLM::Worker_TP{rank}", controlled_by_parent=True)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
    socket.setsockopt(zmq.LINGER, 2000)
    socket.connect(engine_address)
    heartbeat = HeartbeatSender(engine_address, rank)
    heartbeat.start()
    exit_code = 0
    try:
        config = VtllmConfig.from_bytes(config_bytes)
        _serve(config, model_dir, rank, world_size, socket, dist_init_address, heartbeat)
    except Exception as e:
        logger.exception("worker rank %d failed", rank)
        message = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
        socket.send(codec.encode(m.WorkerFailure(rank=rank, message=message)))
        exit_code = 1
    finally:
        heartbeat.stop()
        socket.close()
        context.term()
        destroy_distributed()
    sys.exit(exit_code)


def _serve(
    config: VtllmConfig,
    model_dir: str,
    rank: int,
    world_size: int,
    socket: zmq.Socket,
    dist_init_address: str,
    heartbeat: HeartbeatSender,
) -> None:
    heartbeat.phase = "loading the model"
    platform = detect_platform(rank)
    platform.set_device()
    compiles = CompileWatch()
    watching_compiles = platform.is_gpu and watch_compiles(compiles)
    at_start = platform.memory_snapshot()  # other processes and our context, nothing else
    if not platform.is_gpu:
        torch.set_num_threads(envs.VT_CPU_THREADS or max(1, (os.cpu_count() or 1) // world_size))
    tp = init_distributed(
        rank, world_size, platform.dist_backend, dist_init_address, platform.device
    )
    dtype = platform.resolve_dtype(config.model.dtype)
    kv_dtype = resolve_kv_cache_dtype(
        config.cache.kv_cache_dtype, dtype, platform, attention_backend(platform.device)
    )
    hf_config = load_hf_config(model_dir)
    # --quantization fp8 (or unset: the checkpoint's own) for FP8; none/int8/int4 and the
    # unset default on CPUs for the weight-only formats of layers/cpu_quant.py
    requested = config.model.quantization
    fp8_quantization = requested if requested in (None, "fp8") else None
    cpu_quantization = choose_quantization(requested, platform.is_gpu, hf_config, fast_int4_cpu())
    started = time.monotonic()
    logger.info("loading %s (%s, CPU quantization %s) ...", model_dir, dtype, cpu_quantization)
    runner = ModelRunner.from_model_dir(
        model_dir,
        platform.device,
        dtype,
        config.model.seed,
        tp,
        config.model.load_format,
        config.model.max_model_len,
        fp8_quantization,
        kv_dtype,
        cpu_quantization,
    )
    quant = resolve_quantization(hf_config, fp8_quantization)
    logger.info(
        "loaded %s (%s) in %.1fs; weights %s",
        model_dir,
        dtype,
        time.monotonic() - started,
        quant.describe() if quant else "not quantised",
    )
    _log_weights_loaded(runner, platform, rank, world_size)
    if runner.bf16_prefill:
        logger.info(
            "prompt steps in bf16 arithmetic (float32 accumulation, VT_CPU_BF16_PREFILL=%s; "
            "off for float32 throughout)",
            envs.VT_CPU_BF16_PREFILL,
        )
    name = config.model.default_served_name(model_dir)
    facts = model_facts(model_dir, hf_config, name, runner.kv_cache_specs(), kv_dtype)
    _log_kv_cache_dtype(config, runner, kv_dtype, facts.kv_bytes_per_token)
    use_graphs = _use_graphs(config, platform, runner)
    if use_graphs and envs.VT_SMALL_BATCH_GEMV == "auto":
        heartbeat.phase = "timing small-batch linears"
        tune_small_batch_linears(runner.model, platform, dtype)
    heartbeat.phase = "profiling memory"
    started = time.monotonic()
    max_position = facts.max_position_embeddings
    usable = _usable_kv_bytes(config, platform, runner, max_position, use_graphs, at_start)
    _log_phase("profiled memory", started)
    report = m.WorkerReport(rank=rank, facts=facts, usable_kv_bytes=usable, on_gpu=platform.is_gpu)
    socket.send(codec.encode(report))

    decoder = codec.engine_to_worker_decoder()
    heartbeat.phase = "waiting for the KV cache size"
    init = _receive(socket, decoder, (m.InitKVCache, m.Shutdown))
    if isinstance(init, m.Shutdown):
        return
    heartbeat.phase = "allocating the KV cache and warming up"
    started = time.monotonic()
    logger.info("allocating the KV cache (%d blocks) and warming up ...", init.num_blocks)
    runner.init_kv_cache(init.num_blocks, init.block_size)
    _log_phase("allocated the KV cache", started)
    started = time.monotonic()
    runner.dummy_run(min(init.block_size, init.num_blocks * init.block_size))
    _log_phase("warmed up", started)
    if not platform.is_gpu:
        heartbeat.phase = "compiling the CPU decode and prompt steps"
        runner.use_native_decode()
        runner.compile_cpu_steps(config.scheduler.max_num_seqs, config.model.enforce_eager)
    if use_graphs:
        heartbeat.phase = "capturing decode graphs"
        max_len = _graph_max_len(config, facts.max_position_embeddings, init)
        sizes = capture_sizes(config.scheduler.max_num_seqs)
        started = time.monotonic()
        used = _capture_graphs(runner, platform, max_len, sizes)
        logger.info(
            "captured %d decode graphs (batch %d..%d, up to %d tokens) using %.0f MiB in %.1fs",
            runner.decode_graphs.num_graphs,
            sizes[0],
            sizes[-1],
            max_len,
            used / 2**20,
            time.monotonic() - started,
        )
    heartbeat.phase = "serving"
    socket.send(codec.encode(m.WorkerReady(rank=rank)))
    _log_ready(runner, platform, rank, world_size, init)
    if watching_compiles:
        compiles.serving = True
        logger.info("%s", compiles.startup_summary())

    expected = (m.SchedulerOutput, m.CompileGrammar, m.ReleaseGrammars, m.Shutdown)
    async_on = async_scheduling_enabled(config.scheduler.async_scheduling, platform.is_gpu)
    defer = async_on and runner.is_driver
    runner.share_sampled_ids = async_on and world_size > 1
    pending: DeferredOutput | None = None  # the driver's last step output, not sent yet
    while True:
        compiling = _report_grammars(socket, runner)
        if pending is not None:
            message = _receive_or_ready(socket, decoder, expected, pending)
            if message is None:  # the pending output is ready first: send it
                socket.send(codec.encode(pending.resolve()))
                pending = None
                continue
        else:
            wait_ms = _GRAMMAR_POLL_MS if compiling else None
            message = _receive(socket, decoder, expected, wait_ms)
        if message is None:
            continue
        if isinstance(message, m.Shutdown):
            logger.info("shutdown requested")
            return
        if isinstance(message, m.CompileGrammar):
            if runner.is_driver:
                runner.grammars().prepare(message.request_id, message.seq, message.spec)
            continue
        if isinstance(message, m.ReleaseGrammars):
            if runner.structured is not None:
                runner.structured.release(message.request_ids)
            continue
        delay = envs.VT_TEST_WORKER_STEP_DELAY_S
        if delay > 0:
            time.sleep(delay)
        output = runner.execute(message, defer_output=defer)
        if pending is not None:  # the step before, sent now that this one is queued
            socket.send(codec.encode(pending.resolve()))
            pending = None
        if isinstance(output, DeferredOutput):
            pending = output
        elif output is not None:
            socket.send(codec.encode(output))


def _report_grammars(socket: zmq.Socket, runner: ModelRunner) -> bool:
    """Send ``GrammarReady`` for every compile that ended; True while some still run."""
    grammars = runner.structured
    if grammars is None or not grammars.has_unreported:
        return False
    for request_id, seq, error in grammars.take_ready():
        socket.send(codec.encode(m.GrammarReady(request_id=request_id, seq=seq, error=error)))
    return grammars.has_unreported


def _log_weights_loaded(runner: ModelRunner, platform: Platform, rank: int, world: int) -> None:
    """Weight bytes on this rank's device (on a GPU: what torch holds there after loading,
    quantised layers' own tensors included) and the host RSS peak while loading."""
    on_device = platform.memory_allocated() if platform.is_gpu else runner.weight_bytes()
    stats = runner.load_stats
    read = (
        f"{stats.checkpoint_bytes / 2**30:.2f} GiB read from {stats.num_tensors} tensors in "
        f"{stats.num_files} files (largest {stats.largest_tensor_bytes / 2**20:.0f} MiB)"
        if stats is not None
        else "random weights (--load-format dummy)"
    )
    host = runner.load_host_peak.describe() if runner.load_host_peak else "host RSS unknown"
    logger.info(
        "weights: %.2f GiB on %s (rank %d of %d); %s; %s",
        on_device / 2**30,
        platform.device,
        rank,
        world,
        read,
        host,
    )


def _log_ready(
    runner: ModelRunner, platform: Platform, rank: int, world: int, init: m.InitKVCache
) -> None:
    """The last start-up line: the KV cache this rank holds (its share of the KV heads;
    every rank holds all ``num_blocks``), beside the ``weights:`` line's per-rank bytes."""
    logger.info(
        "ready: %d KV blocks of %d tokens; KV cache %.2f GiB on %s (rank %d of %d)",
        init.num_blocks,
        init.block_size,
        runner.kv_cache_bytes() / 2**30,
        platform.device,
        rank,
        world,
    )


def _log_kv_cache_dtype(
    config: VtllmConfig, runner: ModelRunner, kv_dtype: torch.dtype, bytes_per_token: int
) -> None:
    """One start-up line: the KV cache's element type, its bytes per token on this rank
    and, for FP8, the per-layer scales in use (kv_cache_dtype.py)."""
    line = f"KV cache dtype {str(kv_dtype).removeprefix('torch.')}"
    line += f" (--kv-cache-dtype {config.cache.kv_cache_dtype}): {bytes_per_token} bytes/token"
    if is_fp8(kv_dtype):
        layers = [layer.self_attn for layer in runner.model.model.layers]
        line += f"; scales {describe_kv_scales(layers)}"
    logger.info("%s", line)


def _log_phase(what: str, started: float) -> None:
    """A start-up phase's duration: INFO when it took over a second, else DEBUG."""
    elapsed = time.monotonic() - started
    logger.log(logging.INFO if elapsed > 1.0 else logging.DEBUG, "%s in %.1fs", what, elapsed)


def _use_graphs(config: VtllmConfig, platform: Platform, runner: ModelRunner) -> bool:
    """Decode graphs unless ``--enforce-eager``, on a GPU, over the Triton attention."""
    if config.model.enforce_eager or not platform.supports_graphs:
        return False
    if runner.attention_backend != "triton":
        logger.info("no decode graphs: VT_ATTENTION_BACKEND=%s", runner.attention_backend)
        return False
    return True


def _capture_graphs(runner: ModelRunner, platform: Platform, max_len: int, sizes: list[int]) -> int:
    """Capture decode graphs of ``sizes`` into ``runner``; returns the device memory
    they took (the drop in free memory across the capture)."""
    free_before, _ = platform.memory_info()
    runner.capture_decode_graphs(platform, sizes[-1], max_len, sizes=sizes)
    return max(0, free_before - platform.memory_info()[0])


def _graph_max_len(config: VtllmConfig, max_position: int, init: m.InitKVCache) -> int:
    """Longest sequence a decode graph must serve: the model length cap, no more than
    the KV cache holds (the engine core's fitted ``max_model_len`` is never above it)."""
    max_len = config.model.max_model_len or max_position
    return max(1, min(max_len, init.num_blocks * init.block_size))


def _usable_kv_bytes(
    config: VtllmConfig,
    platform: Platform,
    runner: ModelRunner,
    max_position: int,
    use_graphs: bool,
    at_start: MemorySnapshot,
) -> int:
    """CPU: ``--kv-cache-memory``. GPU: what ``memory_budget`` leaves after the weights,
    the peak activation of a max-size dummy step (run over a temporary KV cache just big
    enough for it), the largest decode graph (captured once here to measure it) times
    their number, the sampler's penalty state, and the device memory torch does not hold
    (``at_start``: before loading). Raises ``NoMemoryForKVCache`` when nothing is left."""
    sampler_state = 0
    if runner.is_driver:  # only rank 0 samples
        sampler_state = penalty_state_bytes(config.scheduler.max_num_seqs, runner.vocab_size)
    if not platform.is_gpu:
        logger.info(
            "memory: KV cache %.2f GiB (--kv-cache-memory); sampler penalty state up to "
            "%.0f MiB besides",
            config.cache.kv_cache_memory / 2**30,
            sampler_state / 2**20,
        )
        return config.cache.kv_cache_memory
    block_size = config.cache.block_size
    max_len = config.model.max_model_len or max_position
    num_tokens = max(1, min(config.scheduler.max_num_batched_tokens, max_len))
    platform.synchronize()
    platform.empty_cache()
    weights = platform.memory_allocated()
    platform.reset_peak_memory()
    runner.init_kv_cache(-(-num_tokens // block_size), block_size)
    probe_kv = runner.kv_cache_bytes()
    runner.dummy_run(num_tokens, config.scheduler.max_num_seqs)
    peak = platform.memory_snapshot().torch_peak_allocated
    peak_activation = max(0, peak - weights - probe_kv)
    graph_bytes = 0
    if use_graphs:
        # capture the largest size once; every graph costs about as much device memory
        # (its executable; the activations share one pool), so scale by their number
        # (small sizes also get an unsplit variant: DecodeGraphs.split_counts)
        sizes = capture_sizes(config.scheduler.max_num_seqs)
        largest = _capture_graphs(runner, platform, max(1, max_len), sizes[-1:])
        graphs = runner.decode_graphs
        count = sum(len(graphs.split_counts(size)) for size in sizes)
        graph_bytes = largest // graphs.num_graphs * count
        runner.decode_graphs = None
    runner.kv_caches = []
    platform.empty_cache()
    budget = memory_budget(
        config.cache.gpu_memory_utilization,
        at_start,
        platform.memory_snapshot(),
        weights,
        peak_activation,
        graph_bytes,
        sampler_state,
    )
    logger.info("memory: %s", budget.describe())
    return budget.kv_cache_bytes()


def _receive_or_ready(
    socket: zmq.Socket,
    decoder: codec.Decoder,
    expected: tuple[type, ...],
    pending: DeferredOutput,
):
    """The next message of an expected kind, or None as soon as ``pending`` is ready
    (whichever comes first; a short spin: a step's device time is milliseconds)."""
    while not pending.ready():
        if socket.poll(0):
            message = _receive(socket, decoder, expected, 0)
            if message is not None:
                return message
        else:
            time.sleep(_PENDING_SPIN_S)
    return None


def _receive(
    socket: zmq.Socket,
    decoder: codec.Decoder,
    expected: tuple[type, ...],
    wait_ms: int | None = None,
):
    """Next message of an expected kind (None once ``wait_ms`` passed with nothing; no
    bound when None). Garbage and unexpected kinds are logged and dropped; a vanished
    parent ends the wait."""
    parent = os.getppid()
    while True:
        if not socket.poll(_POLL_MS if wait_ms is None else wait_ms):
            if os.getppid() != parent:
                raise _ParentGone("the engine core process went away")
            if wait_ms is not None:
                return None
            continue
        frame = socket.recv_multipart()[-1]  # tolerate an empty delimiter frame
        try:
            message = decoder.decode(frame)
        except codec.ProtocolError as e:
            logger.warning("dropped an undecodable frame from the engine core: %s", e)
            continue
        if isinstance(message, expected):
            return message
        logger.warning("dropped an unexpected %s", type(message).__name__)
