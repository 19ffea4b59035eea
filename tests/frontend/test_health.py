"""/health tells the truth: 503 with the reason while requests are in flight and the
engine core has completed no step for longer than VT_STEP_TIMEOUT_S (it heart-beats but
makes no progress), 200 again once it does."""

from __future__ import annotations

import asyncio

import pytest

from tests.frontend.conftest import wait_until


@pytest.mark.asyncio
async def test_health_is_503_while_the_engine_makes_no_progress(serve, monkeypatch) -> None:
    monkeypatch.setenv("VT_STEP_TIMEOUT_S", "0.5")
    served = await serve()
    served.fake.first_token_delay_s = 2.5
    assert (await served.http.get("/health")).status_code == 200  # idle is healthy
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3}
    request = asyncio.create_task(served.http.post("/v1/completions", json=body))
    await asyncio.sleep(1.2)
    stalled = await served.http.get("/health")
    assert stalled.status_code == 503, stalled.text
    message = stalled.json()["error"]["message"]
    assert "1 requests in flight" in message and "VT_STEP_TIMEOUT_S=0.5s" in message
    assert (await request).status_code == 200
    await wait_until(lambda: served.engine.num_in_flight == 0)
    assert (await served.http.get("/health")).status_code == 200


@pytest.mark.asyncio
async def test_health_stays_200_while_a_slow_engine_makes_progress(serve, monkeypatch) -> None:
    monkeypatch.setenv("VT_STEP_TIMEOUT_S", "0.5")
    served = await serve(text="one two three four five six seven eight")
    served.fake.token_interval_s = 0.2
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
    request = asyncio.create_task(served.http.post("/v1/completions", json=body))
    codes = []
    while not request.done():
        codes.append((await served.http.get("/health")).status_code)
        await asyncio.sleep(0.1)
    assert (await request).status_code == 200
    assert codes and set(codes) == {200}, codes
