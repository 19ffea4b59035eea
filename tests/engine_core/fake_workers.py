"""Worker processes without a model, for the executor's deadline tests.

Each speaks the real start-up RPC and heartbeats (``vtllm.worker.heartbeat``) and then
misbehaves the way its scenario (passed as ``model_dir``) says:

* ``serve``: answers every step with an empty result;
* ``stuck-loading``: beats in phase "loading the model" forever, never reports;
* ``hang-step``: beats, but never answers a step (a hung device or kernel);
* ``freeze-on-step``: stops itself with SIGSTOP on its first step (heartbeats stop too);
* ``rank1-killed-on-step`` (2 ranks): rank 1 SIGKILLs itself on its first step and rank 0
  then fails as a survivor's collective does (gloo: "Connection closed by peer");
* ``rank0-fails-on-step`` (2 ranks): rank 0 fails on its first step, rank 1 lives on.
"""

from __future__ import annotations

import os
import signal
import time

import zmq

from vtllm.protocol import codec
from vtllm.protocol import messages as m
from vtllm.worker.heartbeat import HeartbeatSender

FACTS = m.ModelFacts(
    model_name="fake",
    vocab_size=32,
    max_position_embeddings=64,
    eos_token_ids=[0],
    num_layers=1,
    kv_bytes_per_token=8,
)


def run_fake_worker(
    config_bytes: bytes,
    scenario: str,
    rank: int,
    world_size: int,
    engine_address: str,
    dist_init_address: str,
) -> None:
    heartbeat = HeartbeatSender(engine_address, rank, interval_s=0.2)
    heartbeat.start()
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
    socket.connect(engine_address)
    decoder = codec.engine_to_worker_decoder()
    heartbeat.phase = "loading the model"
    if scenario == "stuck-loading":
        time.sleep(3600)
    socket.send(codec.encode(m.WorkerReport(rank=rank, facts=FACTS, usable_kv_bytes=1 << 20)))
    heartbeat.phase = "waiting for the KV cache size"
    while True:
        message = decoder.decode(socket.recv())
        if isinstance(message, m.InitKVCache):
            heartbeat.phase = "serving"
            socket.send(codec.encode(m.WorkerReady(rank=rank)))
        elif isinstance(message, m.Shutdown):
            return
        elif isinstance(message, m.SchedulerOutput):
            if scenario == "hang-step":
                time.sleep(3600)
            if scenario == "freeze-on-step":
                os.kill(os.getpid(), signal.SIGSTOP)
            if scenario == "rank1-killed-on-step" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if scenario in ("rank1-killed-on-step", "rank0-fails-on-step") and rank == 0:
                error = (
                    "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"
                    if scenario == "rank1-killed-on-step"
                    else "ValueError: a bug in rank 0"
                )
                failure = m.WorkerFailure(rank=0, message=f"{error}\nTraceback ...")
                socket.send(codec.encode(failure))
                continue
            if rank != 0:  # only the driver answers steps
                continue
            result = m.ModelRunnerOutput(message.step_id, [], [])
            socket.send(codec.encode(result))
