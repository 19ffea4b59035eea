"""A headless engine core whose "GPU" takes a fixed time per step: the real scheduler, KV
bookkeeping and client channel, with an executor that samples token ids at once and
then waits until ``--step-ms`` have passed since the step began. It is the fast engine
that HTTP-frontend measurements need: a GPU's step time (6 ms is SmolLM2-135M at 256
sequences on an H200) on a CPU machine, so the frontend, not the model, sets the pace.

    python -m benchmarks.paced_engine --address ipc:///tmp/paced.sock --step-ms 6 &
    vtllm serve --engine-address ipc:///tmp/paced.sock --model TOKENIZER_DIR \\
        --allow-insecure-loopback ...        # a directory with tokenizer.json + config.json
    vtllm bench serve --base-url http://127.0.0.1:8000 --max-concurrency 256 --ignore-eos

Offline, the same engine serves ``--max-num-seqs`` sequences at (1000 / step-ms) steps/s:
that product is the output tok/s an ideal frontend would deliver at full batch.
"""

from __future__ import annotations

import argparse
import queue
import signal
import time
import uuid
from collections import deque

import zmq

from vtllm.config import VtllmConfig
from vtllm.engine_core.client_channel import ClientChannel, frame_limit
from vtllm.engine_core.core import EngineCore, EngineFacts
from vtllm.engine_core.core_proc import EngineCoreProc
from vtllm.log import configure_logging
from vtllm.protocol import messages as m


class PacedExecutor:
    """Samples ``(position * 7919) % vocab`` (never an EOS below 10) for every request
    whose prompt is done, and makes each step last ``step_s``."""

    def __init__(self, step_s: float, vocab_size: int) -> None:
        self.step_s = step_s
        self.vocab_size = vocab_size
        self._lengths: dict[str, int] = {}  # request id → tokens known to the worker
        self._computed: dict[str, int] = {}
        self._results: deque[m.ModelRunnerOutput] = deque()  # submitted, not collected

    def compile_grammar(self, request_id: str, seq: int, spec: m.StructuredOutputSpec) -> None:
        raise NotImplementedError("the paced engine serves no structured outputs")

    def release_grammars(self, request_ids: list[str]) -> None:
        pass

    def take_grammar_results(self, wait_s: float = 0.0) -> list[m.GrammarReady]:
        return []

    def describe_liveness(self) -> str:
        return "paced executor"

    def shutdown(self) -> None:
        pass

    def submit(self, step: m.SchedulerOutput) -> None:
        self._results.append(self.execute(step))

    def collect(self) -> m.ModelRunnerOutput:
        return self._results.popleft()

    def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        started = time.perf_counter()
        for request_id in step.finished_request_ids:
            self._lengths.pop(request_id, None)
            self._computed.pop(request_id, None)
        for new in step.new_requests:
            self._lengths[new.request_id] = len(new.token_ids)
            self._computed[new.request_id] = new.num_computed_tokens
        for cached in step.cached_requests:
            self._lengths[cached.request_id] += len(cached.new_token_ids)
            self._computed[cached.request_id] = cached.num_computed_tokens
        request_ids, sampled = [], []
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            end = self._computed[request_id] + num_tokens
            self._computed[request_id] = end
            if end >= self._lengths[request_id]:
                request_ids.append(request_id)
                sampled.append(10 + (end * 7919) % (self.vocab_size - 10))
        remaining = self.step_s - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return m.ModelRunnerOutput(
            step_id=step.step_id, request_ids=request_ids, sampled_token_ids=sampled, errors={}
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="ipc://... or tcp://127.0.0.1:PORT")
    parser.add_argument("--step-ms", type=float, default=6.0)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    configure_logging("VTLLM::PacedEngine")
    config = VtllmConfig()
    config.scheduler.max_num_seqs = args.max_num_seqs
    config.scheduler.max_num_batched_tokens = max(
        config.scheduler.max_num_batched_tokens, 8 * args.max_num_seqs
    )
    block_size = config.cache.block_size
    num_blocks = args.max_num_seqs * args.max_model_len // block_size + 1
    facts = EngineFacts("paced", args.max_model_len, args.vocab_size, num_blocks, block_size, (2,))
    ready = m.Ready(
        protocol_version=m.PROTOCOL_VERSION,
        model="paced",
        max_model_len=args.max_model_len,
        vocab_size=args.vocab_size,
        num_kv_blocks=num_blocks,
        block_size=block_size,
        eos_token_ids=[2],
        engine_id=uuid.uuid4().hex[:12],
        max_frame_bytes=frame_limit(config.engine.engine_max_frame_bytes, args.max_model_len),
    )
    core = EngineCore(config, facts, PacedExecutor(args.step_ms / 1000, args.vocab_size))
    inbox: queue.Queue = queue.Queue()
    channel = ClientChannel(
        zmq.Context.instance(), args.address, ready, inbox, None, ready.max_frame_bytes
    )
    channel.start()
    channel.bound.wait(10)
    proc = EngineCoreProc(core, channel, inbox)
    signal.signal(signal.SIGTERM, proc.request_stop)
    signal.signal(signal.SIGINT, proc.request_stop)
    print(f"paced engine ready at {args.address}", flush=True)
    try:
        return proc.run()
    finally:
        channel.stop()
        channel.join(5)
        proc.close()


if __name__ == "__main__":
    raise SystemExit(main())
