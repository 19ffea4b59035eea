"""The worker as a real process: this test plays the engine core on a ZMQ ROUTER."""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch
import zmq

from vtllm.config import VtllmConfig
from vtllm.protocol import codec
from vtllm.protocol import messages as m
from vtllm.worker.worker import run_worker

from .tiny_models import VOCAB_SIZE, hf_last_logprobs, make_hf_model

DEADLINE_S = 90.0
PROMPT = [5, 9, 17, 33, 65, 1, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_llama")
    return model_dir, make_hf_model("llama_tied", model_dir)


class FakeEngine:
    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(address)
        self.decoder = codec.worker_to_engine_decoder()

    def receive(self, deadline_s: float = DEADLINE_S) -> tuple[bytes, m.WorkerToEngine]:
        """The next message from a worker's main socket; heartbeats are skipped."""
        deadline = time.monotonic() + deadline_s
        while self.router.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            identity, frame = self.router.recv_multipart()
            message = self.decoder.decode(frame)
            if not isinstance(message, m.WorkerHeartbeat):
                return identity, message
        raise TimeoutError(f"no message from a worker within {deadline_s}s")

    def send(self, rank: int, message) -> None:
        self.router.send_multipart([f"rank-{rank}".encode(), codec.encode(message)])

    def close(self) -> None:
        self.router.close()
        self.context.term()


def _start_workers(model_dir, tmp_path, world_size: int):
    config = VtllmConfig()
    config.model.model = str(model_dir)
    address = f"ipc://{tmp_path}/engine.sock"
    engine = FakeEngine(address)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dist_address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(
            target=run_worker,
            args=(config.to_bytes(), str(model_dir), rank, world_size, address, dist_address),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    return config, engine, procs


def _join(procs, timeout_s: float = 30.0) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
    codes = [proc.exitcode for proc in procs]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    return codes


def _prompt_step() -> m.SchedulerOutput:
    new = m.NewRequestData(
        request_id="r0",
        token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        sampling_params=m.SamplingParams(temperature=0.0, logprobs=VOCAB_SIZE),
        block_ids=[3, 1],
        num_computed_tokens=0,
    )
    return m.SchedulerOutput(
        step_id=1, new_requests=[new], cached_requests=[], num_scheduled_tokens={"r0": 7}
    )


@pytest.fixture
def cpu_only(monkeypatch):
    """The spawned workers see no GPU, so these tests take the CPU path everywhere."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")


@pytest.mark.parametrize("world_size", [1, 2])
def test_worker_rpc_round_trip(model, tmp_path, world_size, cpu_only):
    model_dir, hf_model = model
    config, engine, procs = _start_workers(model_dir, tmp_path, world_size)
    try:
        reports = dict(engine.receive() for _ in range(world_size))
        for rank in range(world_size):
            report = reports[f"rank-{rank}".encode()]
            assert isinstance(report, m.WorkerReport), report
            assert report.rank == rank
            assert report.usable_kv_bytes == config.cache.kv_cache_memory
            facts = report.facts
            assert (facts.vocab_size, facts.num_layers, facts.eos_token_ids) == (
                VOCAB_SIZE,
                2,
                [2, 3],
            )
            # 2 (K, V) x 2 layers x kv heads on this rank x head_dim 16 x 4 bytes
            assert facts.kv_bytes_per_token == 2 * 2 * (2 // world_size) * 16 * 4
        for rank in range(world_size):
            engine.send(rank, m.InitKVCache(num_blocks=8, block_size=4))
        ready = [engine.receive()[1] for _ in range(world_size)]
        assert sorted(r.rank for r in ready if isinstance(r, m.WorkerReady)) == list(
            range(world_size)
        )
        for rank in range(world_size):
            engine.send(rank, _prompt_step())
        identity, output = engine.receive()
        assert identity == b"rank-0" and isinstance(output, m.ModelRunnerOutput)
        expected = hf_last_logprobs(hf_model, PROMPT)
        assert output.request_ids == ["r0"]
        assert output.sampled_token_ids == [int(expected.argmax())]
        actual = torch.full((VOCAB_SIZE,), float("nan"))
        for token_id, logprob in output.top_logprobs[0]:
            actual[token_id] = logprob
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
        for rank in range(world_size):
            engine.send(rank, m.Shutdown())
        assert _join(procs) == [0] * world_size
    finally:
        _join(procs, timeout_s=1.0)
        engine.close()


def test_load_failure_is_reported(model, tmp_path, cpu_only):
    model_dir, _ = model
    broken_dir = tmp_path / "no_weights"
    broken_dir.mkdir()
    (broken_dir / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    _, engine, procs = _start_workers(broken_dir, tmp_path, world_size=1)
    try:
        _, message = engine.receive()
        assert isinstance(message, m.WorkerFailure)
        assert message.rank == 0 and "no *.safetensors files" in message.message
        assert _join(procs) == [1]
    finally:
        _join(procs, timeout_s=1.0)
        engine.close()
