"""``/metrics``: counters and histograms move by exactly what the requests did, gauges
follow the engine's SchedulerStats; and the console stats line."""

from __future__ import annotations

from tests.frontend.conftest import scrape, wait_until
from vtllm.frontend.metrics import FrontendMetrics, StatsLogger, token_buckets
from vtllm.protocol import messages as m

COMPLETIONS = "/v1/completions"
MODEL = ("model_name", "fake-model")


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset({MODEL, *labels.items()}))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def test_request_counters_and_histograms(serve) -> None:
    served = await serve(text="Hello world! The end.")  # 6 tokens
    served.fake.first_token_delay_s = 0.1
    before = await scrape(served.http)
    r1 = await served.http.post(COMPLETIONS, json={"prompt": "Hi"})
    r2 = await served.http.post(COMPLETIONS, json={"prompt": "Hello world", "max_tokens": 2})
    assert r1.json()["choices"][0]["finish_reason"] == "stop"
    assert r2.json()["choices"][0]["finish_reason"] == "length"
    after = await scrape(served.http)

    def d(name: str, **labels: str) -> float:
        return _delta(before, after, name, **labels)

    num_prompt = sum(len(a.prompt_token_ids) for a in served.fake.added)
    assert d("vtllm:prompt_tokens_total") == num_prompt
    assert d("vtllm:generation_tokens_total") == 6 + 2
    assert d("vtllm:request_success_total", finished_reason="stop") == 1
    assert d("vtllm:request_success_total", finished_reason="length") == 1
    assert d("vtllm:request_success_total", finished_reason="abort") == 0
    for name in (
        "vtllm:time_to_first_token_seconds",
        "vtllm:e2e_request_latency_seconds",
        "vtllm:request_queue_time_seconds",
        "vtllm:request_prefill_time_seconds",
        "vtllm:request_decode_time_seconds",
        "vtllm:request_prompt_tokens",
        "vtllm:request_generation_tokens",
    ):
        assert d(f"{name}_count") == 2, name
    # one inter-token gap per token after the first: 5 + 1
    assert d("vtllm:inter_token_latency_seconds_count") == 6
    assert d("vtllm:request_prompt_tokens_sum") == num_prompt
    assert d("vtllm:request_generation_tokens_sum") == 8
    assert d("vtllm:request_generation_tokens_bucket", le="1.0") == 0
    assert d("vtllm:request_generation_tokens_bucket", le="2.0") == 1
    assert d("vtllm:request_generation_tokens_bucket", le="10.0") == 2
    # each request waited >= 0.1 s for its first token
    assert d("vtllm:time_to_first_token_seconds_sum") >= 0.2
    assert d("vtllm:request_queue_time_seconds_sum") >= 0.2
    e2e = d("vtllm:e2e_request_latency_seconds_sum")
    assert e2e >= d("vtllm:time_to_first_token_seconds_sum")


async def test_stop_string_counts_as_stop(serve) -> None:
    served = await serve(text="Hello world! The end.")
    before = await scrape(served.http)
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi", "stop": "world"})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    after = await scrape(served.http)
    assert _delta(before, after, "vtllm:request_success_total", finished_reason="stop") == 1
    assert _delta(before, after, "vtllm:request_success_total", finished_reason="abort") == 0


async def test_queue_and_prefill_time_come_from_the_engine(serve) -> None:
    served = await serve(text="Hello")
    served.fake.report_before_first_token = True
    served.fake.first_token_timings = (0.125, 0.375)
    before = await scrape(served.http)
    await served.http.post(COMPLETIONS, json={"prompt": "Hi"})
    after = await scrape(served.http)
    assert _delta(before, after, "vtllm:request_queue_time_seconds_sum") == 0.125
    assert _delta(before, after, "vtllm:request_prefill_time_seconds_sum") == 0.375
    assert _delta(before, after, "vtllm:request_queue_time_seconds_count") == 1
    # the empty report counts the prompt once, and no generated token
    assert _delta(before, after, "vtllm:generation_tokens_total") == 1
    prompt = len(served.fake.added[0].prompt_token_ids)
    assert _delta(before, after, "vtllm:prompt_tokens_total") == prompt


async def test_gauges_follow_scheduler_stats(serve) -> None:
    served = await serve()
    stats = m.SchedulerStats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        num_preemptions=1,
    )
    before = await scrape(served.http)
    served.fake.send_stats(stats)
    await wait_until(lambda: served.engine.latest_stats == stats)
    now = await scrape(served.http)
    assert now[("vtllm:num_requests_running", frozenset({MODEL}))] == 3
    assert now[("vtllm:num_requests_waiting", frozenset({MODEL}))] == 2
    assert now[("vtllm:kv_cache_usage_perc", frozenset({MODEL}))] == 0.25

    second = m.SchedulerStats(num_running=1, prefix_cache_queries=50, prefix_cache_hits=50)
    served.fake.send_stats(second)
    await wait_until(lambda: served.engine.latest_stats == second)
    after = await scrape(served.http)
    assert after[("vtllm:num_requests_running", frozenset({MODEL}))] == 1
    assert after[("vtllm:num_requests_waiting", frozenset({MODEL}))] == 0
    assert after[("vtllm:kv_cache_usage_perc", frozenset({MODEL}))] == 0.0
    # the prefix and preemption fields are deltas: they add up
    assert _delta(before, after, "vtllm:prefix_cache_queries_total") == 150
    assert _delta(before, after, "vtllm:prefix_cache_hits_total") == 90
    assert _delta(before, after, "vtllm:num_preemptions_total") == 1


def test_stats_line_only_while_active() -> None:
    metrics = FrontendMetrics("m", max_model_len=100)
    log = StatsLogger(metrics, interval_s=10.0)
    assert log.line(now=log._last_time + 10) is None  # idle
    metrics.on_request_added("r", 30, now=0.0)
    metrics.on_outputs(
        m.EngineOutputs(
            [m.RequestOutput("r", [1, 2], num_prompt_tokens=30)],
            m.SchedulerStats(
                num_running=1, kv_cache_usage=0.5, prefix_cache_queries=30, prefix_cache_hits=10
            ),
        ),
        now=1.0,
    )
    start = log._last_time
    assert log.line(now=start + 10) == (
        "prompt throughput: 3.0 tok/s, generation throughput: 0.2 tok/s, running: 1, "
        "waiting: 0, KV usage: 50.0%, prefix hit rate: 33.3%"
    )
    metrics.on_outputs(m.EngineOutputs([], m.SchedulerStats()), now=2.0)
    # activity stopped: one more line showing it, then silence
    assert log.line(now=start + 20) is not None
    assert log.line(now=start + 30) is None


def test_token_buckets() -> None:
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(4) == [1, 2]
