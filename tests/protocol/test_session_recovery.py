"""Sessions against a real engine-core process (tests/protocol/engine_process.py): a
blocked event loop keeps its session; a client the engine dropped is told so and
re-handshakes; an engine core restarted at the same address serves the old client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from tests.frontend.conftest import wait_until
from tests.protocol.engine_process import ROOT, EngineProcess
from vtllm.protocol import codec
from vtllm.protocol import messages as m
from vtllm.protocol.async_client import EngineClient, EngineDeadError

LONG = m.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHORT = m.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _env(monkeypatch: pytest.MonkeyPatch, interval_s: float, timeout_s: float) -> dict:
    """The same heartbeat settings for this process's clients and the engine process."""
    monkeypatch.setenv("VT_HEARTBEAT_INTERVAL_S", str(interval_s))
    monkeypatch.setenv("VT_HEARTBEAT_TIMEOUT_S", str(timeout_s))
    return dict(os.environ)


@pytest.fixture
def engines():
    started: list[EngineProcess] = []

    def start(address: str, env: dict, step_delay_s: float = 0.02) -> EngineProcess:
        engine = EngineProcess(address, step_delay_s, env).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


async def _tokens(client: EngineClient, request_id: str, params: m.SamplingParams) -> int:
    outputs = [o async for o in client.generate(request_id, [1, 2, 3], params)]
    assert outputs[-1].finish_reason == m.FinishReason.LENGTH
    return sum(len(o.new_token_ids) for o in outputs)


async def test_blocked_event_loop_keeps_its_session(tmp_path: Path, monkeypatch, engines) -> None:
    env = _env(monkeypatch, interval_s=0.2, timeout_s=2)
    engine = engines(f"ipc://{tmp_path}/e.sock", env, step_delay_s=0.02)
    client = EngineClient()
    await client.connect(engine.address, "blocked", timeout_s=10)
    try:
        params = m.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        num_tokens = 0
        async for output in client.generate("r1", [1, 2, 3], params):
            if num_tokens == 0:
                time.sleep(4)  # the event loop is blocked for twice the heartbeat timeout
            num_tokens += len(output.new_token_ids)
        assert num_tokens == 60 and client.is_alive
        assert await _tokens(client, "r2", SHORT) == 5
        assert "treating it as gone" not in engine.log() and "no session" not in engine.log()
    finally:
        await client.close()


async def test_restarted_engine_tells_the_client_which_re_handshakes(
    tmp_path: Path, monkeypatch, engines
) -> None:
    """Killed and back within the heartbeat timeout: the new engine answers the old
    client's heartbeat with SessionUnknown; the lost request fails, new ones are served.
    No ``reconnect``: this is the path of a frontend with a local engine core too."""
    env = _env(monkeypatch, interval_s=0.2, timeout_s=8)
    address = f"ipc://{tmp_path}/e.sock"
    first = engines(address, env)
    dead: list[str] = []
    client = EngineClient()
    await client.connect(address, "old-client", on_dead=dead.append, timeout_s=10)
    try:
        stream = client.generate("r1", [1, 2, 3], LONG)
        await anext(stream)
        first.kill()
        second = engines(address, env)
        with pytest.raises(EngineDeadError, match="no session for this client") as lost:
            async for _ in stream:
                pass
        assert f"(engine {second.engine_id})" in str(lost.value)
        await wait_until(lambda: client.is_alive, timeout_s=5)
        assert client.ready is not None and client.ready.engine_id == second.engine_id
        assert await _tokens(client, "r2", SHORT) == 5
        assert not dead and "has no session" in second.log()
    finally:
        await client.close()


async def test_remote_engine_back_at_the_same_address(tmp_path: Path, monkeypatch, engines):
    """``reconnect``: the engine's death fails in-flight requests within the timeout; the
    client keeps saying Hello and is served once an engine core is back."""
    env = _env(monkeypatch, interval_s=0.2, timeout_s=1)
    address = f"tcp://127.0.0.1:{_free_port()}"
    first = engines(address, env)
    dead: list[str] = []
    client = EngineClient()
    await client.connect(address, "remote", on_dead=dead.append, timeout_s=10, reconnect=True)
    try:
        stream = client.generate("r1", [1, 2, 3], LONG)
        await anext(stream)
        first.kill()
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match="silent for more than 1s"):
            async for _ in stream:
                pass
        assert time.monotonic() - killed_at < 2.5
        assert not client.is_alive and "reconnecting" in (client.dead_reason or "")
        with pytest.raises(EngineDeadError):
            await _tokens(client, "refused", SHORT)
        await asyncio.sleep(1.5)  # nobody there for a while
        second = engines(address, env)
        await wait_until(lambda: client.is_alive, timeout_s=5)
        assert client.ready is not None and client.ready.engine_id == second.engine_id
        assert await _tokens(client, "r2", SHORT) == 5
        assert not dead
    finally:
        await client.close()


_STALLED_CLIENT = """
import sys
from vtllm.protocol.client import EngineCoreClient, EngineDeadError
from vtllm.protocol import messages as m
client = EngineCoreClient(sys.argv[1], "stalled")
client.add_request("r1", [1, 2, 3], m.SamplingParams(max_tokens=400, ignore_eos=True))
next(client.stream("r1"))
print("streaming", flush=True)
try:
    for _ in client.stream("r1", timeout_s=30):
        pass
    print("r1 finished")
except EngineDeadError as e:
    print("r1 lost:", e, flush=True)
assert client.wait_connected(10), client.dead_reason
client.add_request("r2", [1, 2, 3], m.SamplingParams(max_tokens=5, ignore_eos=True))
print("r2 served", sum(len(o.new_token_ids) for o in client.stream("r2", timeout_s=10)))
client.close()
"""


def test_a_dropped_client_is_told_and_re_handshakes(tmp_path: Path, monkeypatch, engines):
    """A whole client process stopped past the timeout (its threads too): the engine drops
    it and aborts its request; once it runs again it is told, and its next request is
    served."""
    env = _env(monkeypatch, interval_s=0.2, timeout_s=1)
    engine = engines(f"ipc://{tmp_path}/e.sock", env, step_delay_s=0.05)
    client = subprocess.Popen(
        [sys.executable, "-c", _STALLED_CLIENT, engine.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "streaming"
        client.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while "treating it as gone" not in engine.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        client.send_signal(signal.SIGCONT)
        out = client.communicate(timeout=20)[0]
    finally:
        client.kill()
    assert "treating it as gone" in engine.log()
    assert "r1 lost: the engine core has no session for this client: this client was " in out
    assert "and was dropped, and the engine aborted its requests" in out
    assert "r2 served 5" in out, out


def test_a_message_without_a_session_is_answered(tmp_path: Path, monkeypatch, engines):
    engine = engines(f"ipc://{tmp_path}/e.sock", _env(monkeypatch, 0.2, 2))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(engine.address)
    try:
        sock.send(codec.encode(m.AddRequest("r", [1], SHORT)))
        assert sock.poll(5000), "the engine dropped the message in silence"
        answer = codec.engine_to_client_decoder().decode(sock.recv())
        assert isinstance(answer, m.SessionUnknown)
        assert "never said hello" in answer.reason and engine.engine_id in answer.reason
    finally:
        sock.close(0)
        ctx.term()


def _free_port() -> int:
    from vtllm.protocol.transport import free_tcp_port

    return free_tcp_port()
