"""ChoiceMerger.get_batch: every delta that is ready comes at once (one SSE write per
wake-up), in order, and an error comes after the deltas queued before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frontend.conftest import wait_until
from tests.frontend.fake_engine import FakeEngine
from vtllm.frontend.generation import ChoiceJob, ChoiceMerger
from vtllm.protocol import messages as m
from vtllm.protocol.async_client import EngineClient


@pytest.fixture
async def engine(tmp_path: Path, tokenizer):
    ids = tokenizer.encode("Hello world! The end.", add_special_tokens=False)
    fake = FakeEngine(f"ipc://{tmp_path}/e.sock", token_ids=ids).start()
    client = EngineClient()
    await client.connect(fake.address, "t", timeout_s=5)
    yield client
    await client.close()
    fake.stop()


def _jobs(n: int) -> list[ChoiceJob]:
    params = m.SamplingParams(max_tokens=50)
    return [ChoiceJob(i, f"req-{i}", [1, 2], params, []) for i in range(n)]


async def test_ready_deltas_come_in_one_batch(engine: EngineClient, tokenizer) -> None:
    async with ChoiceMerger(engine, tokenizer, _jobs(2)) as merger:
        # both choices run to the end before the consumer looks
        await wait_until(lambda: sum(1 for t in merger._tasks if t.done()) == 2)
        batch = await merger.get_batch(timeout=5)
        assert await merger.get_batch(timeout=5) == []
    texts = {i: "".join(d.text for d in batch if d.index == i) for i in (0, 1)}
    assert texts == {0: "Hello world! The end.", 1: "Hello world! The end."}
    assert [d.finish_reason for d in batch if d.finish_reason] == ["stop", "stop"]


async def test_an_error_comes_after_the_deltas_before_it(
    tmp_path: Path, tokenizer, engine: EngineClient
) -> None:
    fake = FakeEngine(f"ipc://{tmp_path}/paced.sock", token_ids=[40, 41, 42])
    fake.token_interval_s = 1.0
    fake.start()
    paced = EngineClient()
    await paced.connect(fake.address, "t", timeout_s=5)
    try:
        async with ChoiceMerger(paced, tokenizer, _jobs(1)) as merger:
            await wait_until(lambda: len(merger._items) == 1)  # the first token's delta
            merger.interrupt(RuntimeError("stopping"))  # a drain, while the choice runs
            batch = await merger.get_batch(timeout=5)
            assert [d.num_new_tokens for d in batch] == [1]
            with pytest.raises(RuntimeError, match="stopping"):
                await merger.get_batch(timeout=5)
    finally:
        await paced.close()
        fake.stop()


async def test_nothing_ready_within_the_timeout_is_a_timeout(
    tmp_path: Path, tokenizer, engine: EngineClient
) -> None:
    fake = FakeEngine(f"ipc://{tmp_path}/slow.sock", token_ids=[5])
    fake.first_token_delay_s = 5.0
    fake.start()
    slow = EngineClient()
    await slow.connect(fake.address, "t", timeout_s=5)
    try:
        async with ChoiceMerger(slow, tokenizer, _jobs(1)) as merger:
            with pytest.raises(TimeoutError):
                await merger.get_batch(timeout=0.05)
    finally:
        await slow.close()
        fake.stop()
