"""Hostile ZeroMQ clients against a real engine-core process (the real EngineCore,
ClientChannel and loop over the test executor, tests/protocol/engine_process.py; and the
`vtllm engine-core` command for its start-up refusal): a second socket presenting a live
client's routing id gets nothing and aborts nothing; tcp:// admits only allow-listed
CurveZMQ keys; an oversized frame is refused without growing the engine while another
client is served; socket files are owner-only. Loopback only, seconds each."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from tests.e2e.server import free_port
from tests.protocol.engine_process import EngineProcess
from vtllm.cli import main as vtllm_main
from vtllm.protocol import codec
from vtllm.protocol import messages as m
from vtllm.protocol.client import EngineCoreClient, FrameTooLargeError, HandshakeError
from vtllm.protocol.transport import ClientKeys, ServerKeys

LONG = m.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
SHORT = m.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
DECODER = codec.engine_to_client_decoder()


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VT_HEARTBEAT_INTERVAL_S", "0.2")
    monkeypatch.setenv("VT_HEARTBEAT_TIMEOUT_S", "3")
    started: list[EngineProcess] = []

    def start(address: str | None = None, *extra: str) -> EngineProcess:
        address = address or f"ipc://{tmp_path}/engine.sock"
        started.append(EngineProcess(address, 0.02, dict(os.environ), extra).start())
        return started[-1]

    yield start
    for process in started:
        process.stop()


def _raw(ctx: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _received(sock: zmq.Socket, within_s: float) -> list:
    got, deadline = [], time.monotonic() + within_s
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        got.append(DECODER.decode(sock.recv()))
    return got


def test_a_second_socket_with_a_victims_routing_id_gets_nothing(engine):
    process = engine()
    victim = EngineCoreClient(process.address, "victim", timeout_s=10)
    ctx = zmq.Context()
    try:
        victim.add_request("secret-request", [1, 2, 3], LONG)
        first = next(victim.stream("secret-request", timeout_s=10))
        identity = victim._session._dealer.getsockopt(zmq.IDENTITY)  # as if it leaked
        thief = _raw(ctx, process.address, identity)
        thief.send(codec.encode(m.AbortRequests(["secret-request"])))
        thief.send(codec.encode(m.Hello(m.PROTOCOL_VERSION, "thief", "s")))
        thief.send(codec.encode(m.AbortRequests(["secret-request"])))
        stolen = _received(thief, within_s=1.0)
        assert stolen == [], f"the thief received {stolen!r}"
        rest = list(victim.stream("secret-request", timeout_s=20))
        assert rest[-1].finish_reason == m.FinishReason.LENGTH  # not aborted
        num_tokens = sum(len(o.new_token_ids) for o in [first, *rest])
        assert num_tokens == LONG.max_tokens
        assert identity.hex() not in process.log() and "victim" in process.log()
        victim.close()
        time.sleep(0.3)
        assert _received(thief, within_s=0.5) == []  # not even once the victim has left
    finally:
        ctx.destroy(linger=0)


def test_a_predictable_routing_id_gets_no_session(engine):
    process = engine()
    ctx = zmq.Context()
    try:
        anonymous = ctx.socket(zmq.DEALER)  # libzmq gives it a sequential 5-byte id
        anonymous.connect(process.address)
        anonymous.send(codec.encode(m.Hello(m.PROTOCOL_VERSION, "raw", "s")))
        [refusal] = _received(anonymous, within_s=2.0)
        assert isinstance(refusal, m.HandshakeRefused) and "at least 16" in refusal.reason
    finally:
        ctx.destroy(linger=0)
    assert Path(process.address[len("ipc://") :]).stat().st_mode & 0o777 == 0o600


@pytest.fixture
def keys(tmp_path: Path):
    server_file = tmp_path / "engine.key"
    assert vtllm_main(["keygen", "server", "--out", str(server_file)]) == 0
    client_file = tmp_path / "client.key"
    args = ["--server", str(server_file), "--name", "admitted", "--out", str(client_file)]
    assert vtllm_main(["keygen", "client", *args]) == 0
    stranger = ClientKeys.generate(ServerKeys.load(server_file).public, "stranger")
    return server_file, ClientKeys.load(client_file), stranger


def test_tcp_admits_only_allow_listed_keys(engine, keys):
    server_file, admitted, stranger = keys
    address = f"tcp://127.0.0.1:{free_port()}"
    process = engine(address, "--curve-key-file", str(server_file))
    started = time.monotonic()
    with pytest.raises(HandshakeError, match="security handshake failed"):
        EngineCoreClient(address, "no-key", timeout_s=10)
    with pytest.raises(HandshakeError, match="does not admit this client's CurveZMQ key"):
        EngineCoreClient(address, "wrong-key", timeout_s=10, curve_keys=stranger)
    assert time.monotonic() - started < 5, "refusals should be immediate, not timeouts"
    with EngineCoreClient(address, "ok", timeout_s=10, curve_keys=admitted) as client:
        client.add_request("r", [1, 2, 3], SHORT)
        assert sum(len(o.new_token_ids) for o in client.stream("r", timeout_s=10)) == 3
    assert "(key 'admitted')" in process.log()


def test_loopback_tcp_without_keys_needs_the_opt_in_flag(smollm2_dir, vt_cache_dir):
    env = {**os.environ, "VT_CACHE_DIR": str(vt_cache_dir)}
    address = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "vtllm.cli", "engine-core", "--engine-address", address],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--engine-allow-insecure-loopback" in done.stdout + done.stderr


def _rss_mib(process: EngineProcess) -> float:
    return process.rss_bytes() / 2**20


def test_an_oversized_frame_is_refused_and_others_are_served(engine):
    process = engine()
    limit = 4 * 2**20  # the default for this engine's max_model_len of 512
    other = EngineCoreClient(process.address, "bystander", timeout_s=10)
    assert other.ready.max_frame_bytes == limit
    ctx = zmq.Context()
    try:
        sock = _raw(ctx, process.address, os.urandom(16))
        sock.send(codec.encode(m.Hello(m.PROTOCOL_VERSION, "big-sender", "s")))
        assert any(isinstance(x, m.Ready) for x in _received(sock, within_s=1.0))
        before = _rss_mib(process)
        # just over the limit: read, not decoded, answered
        big = codec.encode(m.AddRequest("too-big", [1] * (5 * 2**20), SHORT))
        sock.send(big)
        answers = [x for x in _received(sock, 2.0) if isinstance(x, m.EngineOutputs)]
        [refusal] = [o for x in answers for o in x.outputs if o.request_id == "too-big"]
        assert refusal.finish_reason == m.FinishReason.ERROR
        assert "--engine-max-frame-bytes" in refusal.error and "4.0 MiB" in refusal.error
        # 47 MiB: libzmq drops the sender before allocating it; the engine stays healthy
        huge = codec.encode(m.AddRequest("huge", [300] * (47 * 2**20 // 3), SHORT))
        sock.send(huge)
        started = time.monotonic()
        other.add_request("normal", [1, 2, 3], SHORT)
        outputs = list(other.stream("normal", timeout_s=10))
        assert sum(len(o.new_token_ids) for o in outputs) == 3
        assert time.monotonic() - started < 2.0
        grown = _rss_mib(process) - before
        assert grown < 64, f"engine core grew by {grown:.0f} MiB"
        with pytest.raises(FrameTooLargeError, match="at most 4194304 bytes"):
            other.add_request("refused-locally", [1] * (5 * 2**20), SHORT)
    finally:
        ctx.destroy(linger=0)
        other.close()
