"""``/metrics`` over several frontend processes (``--api-server-count``): whichever one
answers, per-request series are the sum over all of them and engine-wide series count
once. Two apps, each with its own engine client and metrics socket, stand for two
processes (the wiring of real processes is tests/e2e/test_api_servers.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.frontend.conftest import wait_until
from tests.frontend.fake_engine import FakeEngine
from vtllm.api_servers import metrics_paths, peers_of
from vtllm.config import VtllmConfig
from vtllm.frontend.app import build_app
from vtllm.frontend.metrics import FrontendMetrics
from vtllm.frontend.metrics_peers import merge_expositions, serve_own_metrics
from vtllm.protocol import messages as m
from vtllm.protocol.async_client import EngineClient

MODEL = ("model_name", "fake-model")


def _samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset({MODEL, *labels.items()})), 0.0)


async def test_two_frontends_answer_the_same_sums(
    tmp_path: Path, model_dir: Path, tokenizer, monkeypatch
) -> None:
    monkeypatch.setenv("VT_HEARTBEAT_INTERVAL_S", "0.1")
    token_ids = tokenizer.encode("Hello world! The end.", add_special_tokens=False)
    fake = FakeEngine(f"ipc://{tmp_path}/engine.sock", token_ids).start()
    paths = metrics_paths(tmp_path, 2)
    clients, metric_servers, apps, engines = [], [], [], []
    try:
        for i in range(2):  # two clients of one engine, as two frontend processes are
            engine = EngineClient()
            await engine.connect(fake.address, f"frontend-{i}", timeout_s=5)
            engines.append(engine)
            app = build_app(VtllmConfig(), str(model_dir), engine, metrics_peers=peers_of(i, paths))
            apps.append(app)
            metric_servers.append(await serve_own_metrics(app.state.metrics.registry, paths[i]))
            transport = httpx.ASGITransport(app=app)
            clients.append(httpx.AsyncClient(transport=transport, base_url="http://fe", timeout=10))
        # 1 request through frontend 0, 2 through frontend 1
        for client in (clients[0], clients[1], clients[1]):
            r = await client.post("/v1/completions", json={"prompt": "Hi"})
            assert r.status_code == 200, r.text
        # the engine's stats reach every client alike
        fake.send_stats(m.SchedulerStats(num_running=3, prefix_cache_queries=40))
        await wait_until(
            lambda: all(a.state.metrics.latest_stats is not None for a in apps), timeout_s=5
        )
        scrapes = []
        for client in clients:
            r = await client.get("/metrics")
            assert r.status_code == 200
            scrapes.append(_samples(r.text))
        for samples in scrapes:
            assert _value(samples, "vtllm:request_success_total", finished_reason="stop") == 3
            assert _value(samples, "vtllm:generation_tokens_total") == 3 * len(token_ids)
            assert _value(samples, "vtllm:e2e_request_latency_seconds_count") == 3
            # engine-wide: once, not once per frontend
            assert _value(samples, "vtllm:num_requests_running") == 3
            assert _value(samples, "vtllm:prefix_cache_queries_total") == 40
        # each process alone still knows only its own requests
        own = _samples(_own_text(apps[1]))
        assert _value(own, "vtllm:request_success_total", finished_reason="stop") == 2
    finally:
        for client in clients:
            await client.aclose()
        for server in metric_servers:
            server.close()
        for engine in engines:
            await engine.close()
        fake.stop()


def _own_text(app) -> bytes:
    return generate_latest(app.state.metrics.registry)


async def test_a_peer_that_does_not_answer_is_left_out(
    tmp_path: Path, model_dir: Path, tokenizer
) -> None:
    fake = FakeEngine(f"ipc://{tmp_path}/engine.sock", [5]).start()
    engine = EngineClient()
    await engine.connect(fake.address, "frontend-0", timeout_s=5)
    try:
        paths = metrics_paths(tmp_path, 2)  # nobody serves paths[1]
        app = build_app(VtllmConfig(), str(model_dir), engine, metrics_peers=peers_of(0, paths))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fe") as client:
            r = await client.get("/metrics")
        assert r.status_code == 200 and "vtllm:request_success_total" in r.text
    finally:
        await engine.close()
        fake.stop()


def test_merge_sums_per_request_series_and_keeps_the_earliest_created() -> None:
    a, b = FrontendMetrics("fake-model", 1024), FrontendMetrics("fake-model", 1024)
    a.generation_tokens.inc(5)
    b.generation_tokens.inc(7)
    a.time_to_first_token.observe(0.3)
    b.time_to_first_token.observe(3.0)
    a.kv_cache_usage.set(0.25)
    b.kv_cache_usage.set(0.25)
    own, peer = generate_latest(a.registry).decode(), generate_latest(b.registry).decode()
    merged = _samples(merge_expositions(own, [peer], a.engine_wide_names))
    assert _value(merged, "vtllm:generation_tokens_total") == 12
    assert _value(merged, "vtllm:time_to_first_token_seconds_count") == 2
    assert _value(merged, "vtllm:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert _value(merged, "vtllm:time_to_first_token_seconds_bucket", le="5.0") == 2
    assert _value(merged, "vtllm:kv_cache_usage_perc") == 0.25
    created = [_value(_samples(t), "vtllm:generation_tokens_created") for t in (own, peer)]
    assert _value(merged, "vtllm:generation_tokens_created") == min(created)
