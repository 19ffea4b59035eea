"""A real engine-core process for session tests, without workers or a model: the real
``EngineCore``, ``ClientChannel`` and ``EngineCoreProc`` over the test ``FakeExecutor``
(each step sleeps ``--step-delay`` seconds, so requests stay in flight). Being a process,
it can be SIGKILLed, SIGSTOPped and restarted at the same address.

    python -m tests.protocol.engine_process ADDRESS [--step-delay S] [--curve-key-file F]
        [--max-frame-bytes N]

Prints ``ready <engine_id>`` once its socket is bound. SIGTERM stops it cleanly.
"""

from __future__ import annotations

import argparse
import logging
import queue
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq

from tests.engine_core.fake_executor import FakeExecutor
from vtllm.config import VtllmConfig
from vtllm.engine_core.client_channel import ClientChannel, frame_limit
from vtllm.engine_core.core import EngineCore, EngineFacts
from vtllm.engine_core.core_proc import EngineCoreProc
from vtllm.protocol import messages as m
from vtllm.protocol.transport import ServerKeys

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 512
VOCAB = 1000


@dataclass
class SlowExecutor(FakeExecutor):
    step_delay_s: float = 0.0

    def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        time.sleep(self.step_delay_s)
        return super().execute(step)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--curve-key-file", default=None)
    parser.add_argument("--max-frame-bytes", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = VtllmConfig()
    config.cache.block_size = 16
    facts = EngineFacts("fake-model", MAX_MODEL_LEN, VOCAB, 256, 16, (2,))
    executor = SlowExecutor(vocab_size=VOCAB, block_size=16, step_delay_s=args.step_delay)
    core = EngineCore(config, facts, executor)
    engine_id = uuid.uuid4().hex[:12]
    max_frame_bytes = frame_limit(args.max_frame_bytes, MAX_MODEL_LEN)
    ready = m.Ready(
        m.PROTOCOL_VERSION,
        "fake-model",
        MAX_MODEL_LEN,
        VOCAB,
        256,
        16,
        [2],
        engine_id,
        max_frame_bytes,
    )
    inbox: queue.Queue = queue.Queue()
    keys = ServerKeys.load(args.curve_key_file) if args.curve_key_file else None
    channel = ClientChannel(
        zmq.Context.instance(), args.address, ready, inbox, keys, max_frame_bytes
    )
    channel.start()
    assert channel.bound.wait(10)
    proc = EngineCoreProc(core, channel, inbox)
    signal.signal(signal.SIGTERM, lambda *_: (proc.request_stop(), proc.request_stop()))
    print(f"ready {engine_id}", flush=True)
    try:
        return proc.run()
    finally:
        channel.stop()
        channel.join(5)
        proc.close()


class EngineProcess:
    """The process above, from a test: ``start()``, ``kill()``, ``stop()``."""

    def __init__(
        self,
        address: str,
        step_delay_s: float = 0.0,
        env: dict | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        self.extra_args = extra_args
        self.address = address
        self.step_delay_s = step_delay_s
        self.env = env
        self.process: subprocess.Popen | None = None
        self.engine_id = ""

    def start(self, timeout_s: float = 30.0) -> EngineProcess:
        command = [sys.executable, "-m", "tests.protocol.engine_process", self.address]
        command += ["--step-delay", str(self.step_delay_s), *self.extra_args]
        self.log_path = Path(tempfile.mkstemp(prefix="vtllm-fake-engine-", suffix=".log")[1])
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            match = re.search(r"^ready (\w+)$", self.log(), re.MULTILINE)
            if match:
                self.engine_id = match.group(1)
                return self
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"engine process did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        assert self.process is not None
        with open(f"/proc/{self.process.pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.kill(signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
