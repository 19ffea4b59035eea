"""EngineClient against FakeEngine: handshake, routing, aborts, utility, death."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frontend.conftest import wait_until
from tests.frontend.fake_engine import FakeEngine
from vtllm.protocol import messages as m
from vtllm.protocol.async_client import (
    EngineClient,
    EngineDeadError,
    HandshakeError,
    UtilityError,
    merge_outputs,
)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VT_HEARTBEAT_INTERVAL_S", "0.05")
    monkeypatch.setenv("VT_HEARTBEAT_TIMEOUT_S", "0.5")
    engine = FakeEngine(f"ipc://{tmp_path}/e.sock", token_ids=[5, 6, 7]).start()
    yield engine
    engine.stop()


async def _connected(fake: FakeEngine, **kwargs) -> EngineClient:
    client = EngineClient()
    await client.connect(fake.address, "t", timeout_s=5, **kwargs)
    return client


async def test_handshake_and_generate(fake: FakeEngine) -> None:
    client = await _connected(fake)
    try:
        assert client.ready is not None and client.ready.max_model_len == 256
        outputs = [o async for o in client.generate("r1", [1, 2], m.SamplingParams())]
        # one output per engine message, unless the consumer lagged (then merged)
        assert [t for o in outputs for t in o.new_token_ids] == [5, 6, 7]
        assert outputs[-1].finish_reason == m.FinishReason.STOP
        assert client.num_in_flight == 0
        assert await client.utility("echo", 1, "a", timeout=5) == ["echo", 1, "a"]
        with pytest.raises(UtilityError, match="it failed"):
            await client.utility("fail", timeout=5)
    finally:
        await client.close()
    await wait_until(lambda: fake.goodbyes == 1)


async def test_a_lagging_consumer_gets_the_queued_outputs_merged(fake: FakeEngine) -> None:
    client = await _connected(fake)
    try:
        outputs = client.generate("r1", [1, 2], m.SamplingParams())
        first = await anext(outputs)  # sends the request; the engine answers all three
        await wait_until(lambda: client.output_queue("r1").qsize() == 2)
        rest = [o async for o in outputs]
        assert first.new_token_ids == [5]
        assert len(rest) == 1 and rest[0].new_token_ids == [6, 7]
        assert rest[0].finish_reason == m.FinishReason.STOP
    finally:
        await client.close()


def test_merge_outputs_keeps_order_and_the_ends() -> None:
    first = m.RequestOutput(
        "r", [4], num_prompt_tokens=3, new_logprobs=[-0.5], queue_time_s=0.1, prefill_time_s=0.2
    )
    second = m.RequestOutput(
        "r", [5, 2], m.FinishReason.STOP, stop_token_id=2, new_logprobs=[-1.0, -2.0]
    )
    merged = merge_outputs(first, second)
    assert merged.new_token_ids == [4, 5, 2] and merged.new_logprobs == [-0.5, -1.0, -2.0]
    assert merged.finish_reason == m.FinishReason.STOP and merged.stop_token_id == 2
    assert (merged.num_prompt_tokens, merged.queue_time_s, merged.prefill_time_s) == (3, 0.1, 0.2)
    assert merge_outputs(m.RequestOutput("r", [1]), m.RequestOutput("r", [2])).new_logprobs is None


async def test_handshake_refused_carries_reason(fake: FakeEngine) -> None:
    fake.refuse_reason = "protocol 0 is too old"
    with pytest.raises(HandshakeError, match="protocol 0 is too old"):
        await _connected(fake)


async def test_handshake_deadline(tmp_path: Path) -> None:
    with pytest.raises(HandshakeError, match="did not answer"):
        await EngineClient().connect(f"ipc://{tmp_path}/nobody.sock", "t", timeout_s=0.3)


async def test_consumer_stopping_early_aborts(fake: FakeEngine) -> None:
    fake.token_interval_s = 0.2
    client = await _connected(fake)
    try:
        async for _ in client.generate("r1", [1], m.SamplingParams()):
            break
        await wait_until(lambda: "r1" in fake.aborted_snapshot())
    finally:
        await client.close()


async def test_garbage_frames_are_dropped(fake: FakeEngine) -> None:
    client = await _connected(fake)
    try:
        fake.send_raw(b"\x93\xa3bad")
        fake.send_raw(b"not msgpack at all \xff")
        outputs = [o async for o in client.generate("r1", [1], m.SamplingParams())]
        assert [t for o in outputs for t in o.new_token_ids] == [5, 6, 7] and client.is_alive
    finally:
        await client.close()


async def test_silence_is_death(fake: FakeEngine) -> None:
    dead: list[str] = []
    fake.first_token_delay_s = 60
    client = await _connected(fake, on_dead=dead.append)
    try:
        stream = client.generate("r1", [1], m.SamplingParams())
        fake.silent = True
        with pytest.raises(EngineDeadError, match="silent"):
            async for _ in stream:
                pass
        assert not client.is_alive and len(dead) == 1
        with pytest.raises(EngineDeadError):
            async for _ in client.generate("r2", [1], m.SamplingParams()):
                pass
    finally:
        await client.close()


async def test_engine_dead_message_and_probe(fake: FakeEngine) -> None:
    dead: list[str] = []
    client = await _connected(fake, on_dead=dead.append)
    fake.send_dead("worker 0 crashed")
    await wait_until(lambda: bool(dead))
    assert "worker 0 crashed" in dead[0] and not client.is_alive
    await client.close()


async def test_engine_alive_probe(fake: FakeEngine) -> None:
    alive = [True]
    dead: list[str] = []
    client = await _connected(fake, engine_alive=lambda: alive[0], on_dead=dead.append)
    alive[0] = False
    await wait_until(lambda: bool(dead), timeout_s=3)
    assert "exited" in dead[0]
    await client.close()
