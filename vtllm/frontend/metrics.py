"""Prometheus metrics of the frontend (vLLM's v1 series, see ``FrontendMetrics``), and its
periodic one-line stats log.

``FrontendMetrics`` is a ``RequestObserver`` of the engine client: it folds in every
``EngineOutputs`` batch as it arrives (engine gauges and counters from ``SchedulerStats``,
per-request token timings from the outputs), so a scrape only reads. It owns its
``CollectorRegistry``: two apps in one process (tests) never share series.

Per-request timeline as the frontend sees it (``time.monotonic()``)::

    added ──── first report ──── first token ── token ── ... ── last token ── done
      |<- queue (engine) ->|<- prefill (engine) ->|<- itl ->|      |
      |<------------- ttft -------------->|<------- decode ------->|
      |<------------------------------- e2e ------------------------------->|

Queue and prefill times come from the engine core (``RequestOutput.queue_time_s`` /
``prefill_time_s`` on the first token's output): the frontend cannot see when a request
is first scheduled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from vtllm.protocol import messages as m

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (token-count histograms)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


class HistogramAlias(Collector):
    """A histogram's series served a second time under another name, from the same
    observations (vLLM keeps older names beside the new ones): one observe per event
    instead of one per name, which matters for a per-token histogram."""

    def __init__(self, source: Histogram, name: str, documentation: str) -> None:
        self._source = source
        self._name = name
        self._documentation = documentation

    def collect(self) -> Iterable[Metric]:
        for family in self._source.collect():
            alias = Metric(self._name, self._documentation, family.type)
            for sample in family.samples:
                suffix = sample.name[len(family.name) :]  # _bucket, _count, _sum, _created
                alias.samples.append(sample._replace(name=self._name + suffix))
            yield alias


@dataclass
class _RequestTimes:
    added: float
    num_prompt_tokens: int
    first_report: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    prefill_s: float = 0.0


_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class FrontendMetrics:
    """Every series of vLLM's v1 engine (same names after the prefix, types, buckets and
    ``model_name`` label), under ``prefix:`` (``--metrics-prefix``: ``vtllm`` or
    ``vllm``). Feed it through ``EngineClient.add_observer`` and ``on_http_request``;
    serve ``registry`` at ``/metrics``."""

    # Series every frontend process holds alike: the engine's gauges, and the counters
    # folded from its SchedulerStats (sent to every client). Several frontend processes
    # (--api-server-count) report them once, never summed (metrics_peers.py).
    ENGINE_WIDE = (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "gpu_cache_usage_perc",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "gpu_prefix_cache_queries",
        "gpu_prefix_cache_hits",
        "num_preemptions",
        "cache_config_info",
    )

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        prefix: str = "vtllm",
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_wide_names = frozenset(f"{prefix}:{name}" for name in self.ENGINE_WIDE)
        self._requests: dict[str, _RequestTimes] = {}
        # plain running totals for the console stats line
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.latest_stats: m.SchedulerStats | None = None

        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{prefix}:{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=reg).labels(
                model_name
            )

        tokens = token_buckets(max_model_len)
        self.num_requests_running = gauge(
            "num_requests_running", "Requests in the engine's running batch."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting in the engine's queue."
        )
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of usable KV-cache blocks in use (0..1)."
        )
        self.gpu_cache_usage = gauge(
            "gpu_cache_usage_perc", "Same as kv_cache_usage_perc (vLLM's deprecated name)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.gpu_prefix_cache_queries = counter(
            "gpu_prefix_cache_queries", "Same as prefix_cache_queries (vLLM's deprecated name)."
        )
        self.gpu_prefix_cache_hits = counter(
            "gpu_prefix_cache_hits", "Same as prefix_cache_hits (vLLM's deprecated name)."
        )
        self.num_preemptions = counter(
            "num_preemptions", "Requests preempted by the engine (KV cache full)."
        )
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests the engine started serving."
        )
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated and delivered to the frontend."
        )
        self._request_success = Counter(
            f"{prefix}:request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Arrival at the frontend to the first generated token.",
            _LATENCY_BUCKETS,
        )
        inter_token_latency = Histogram(
            f"{prefix}:inter_token_latency_seconds",
            "Time between successive token deliveries of a request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.inter_token_latency = inter_token_latency.labels(model_name)
        # observed once per token, served under both names
        reg.register(
            HistogramAlias(
                inter_token_latency,
                f"{prefix}:time_per_output_token_seconds",
                "Same observations as inter_token_latency_seconds (vLLM's older name).",
            )
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Arrival at the frontend to the end of the request.",
            _REQUEST_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Seconds from the engine core receiving a request to its first scheduling "
            "(engine clock), observed when the first token arrives.",
            _REQUEST_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Seconds from a request's first scheduling to its first token (engine clock): "
            "the prefill, over however many chunks it took.",
            _REQUEST_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "First token to last token of a request.",
            _REQUEST_BUCKETS,
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "First scheduling to the last token (prefill + decode) of a finished request.",
            _REQUEST_BUCKETS,
        )
        self.time_per_prefill_token = histogram(
            "time_per_prefill_token_request_seconds",
            "Prefill time of a request divided by its prompt tokens.",
            _PREFILL_TOKEN_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", tokens
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Generated tokens of a finished request's longest sequence (one per engine "
            "request here: n is split into separate requests).",
            tokens,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens per engine output batch (one per step): prompt tokens first reported "
            "in it plus tokens generated in it.",
            _ITERATION_BUCKETS,
        )
        self.request_params_n = histogram(
            "request_params_n", "The n parameter of HTTP generation requests.", _N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens",
            "The max_tokens parameter of HTTP generation requests that set it.",
            tokens,
        )
        info = dict(cache_info or {})
        if info:
            Gauge(
                f"{prefix}:cache_config_info",
                "KV-cache configuration (labels; the value is always 1).",
                list(info),
                registry=reg,
            ).labels(**info).set(1)

    # -- HTTP requests (app.py) --------------------------------------------------------

    def on_http_request(self, n: int, max_tokens: int | None) -> None:
        """A generation request the HTTP layer accepted (its ``n`` and ``max_tokens``)."""
        self.request_params_n.observe(n)
        if max_tokens is not None and max_tokens > 0:
            self.request_params_max_tokens.observe(max_tokens)

    # -- RequestObserver ---------------------------------------------------------------

    def on_request_added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        self._requests[request_id] = _RequestTimes(now, num_prompt_tokens)

    def on_outputs(self, message: m.EngineOutputs, now: float) -> None:
        if message.scheduler_stats is not None:
            self._fold_stats(message.scheduler_stats)
        step_tokens = 0
        num_generated = self.num_generation_tokens
        for output in message.outputs:
            times = self._requests.get(output.request_id)
            if times is not None:  # None: finished or released already
                step_tokens += self._fold_output(times, output, now)
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        if self.num_generation_tokens > num_generated:  # one locked inc per batch, not per request
            self.generation_tokens.inc(self.num_generation_tokens - num_generated)

    def on_request_done(self, request_id: str, finish_reason: str, now: float) -> None:
        times = self._requests.pop(request_id, None)
        if times is None:
            return
        self._request_success.labels(self._model_name, finish_reason).inc()
        self.e2e_request_latency.observe(now - times.added)
        self.request_prompt_tokens.observe(times.num_prompt_tokens)
        self.request_generation_tokens.observe(times.num_generation_tokens)
        self.request_max_num_generation_tokens.observe(times.num_generation_tokens)
        if times.first_token is not None and times.last_token is not None:
            decode = times.last_token - times.first_token
            self.request_decode_time.observe(decode)
            self.request_inference_time.observe(times.prefill_s + decode)

    # -- folding -----------------------------------------------------------------------

    def _fold_stats(self, stats: m.SchedulerStats) -> None:
        self.latest_stats = stats
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        # these three are deltas since the previous stats
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.gpu_prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.gpu_prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions)
        self.num_prefix_queries += stats.prefix_cache_queries
        self.num_prefix_hits += stats.prefix_cache_hits

    def _fold_output(self, times: _RequestTimes, output: m.RequestOutput, now: float) -> int:
        """Fold one output in; returns the tokens it adds to this step (prompt tokens on
        the first report, plus the new tokens)."""
        step_tokens = 0
        if times.first_report is None:
            times.first_report = now
            num_prompt = output.num_prompt_tokens or times.num_prompt_tokens
            times.num_prompt_tokens = num_prompt
            self.prompt_tokens.inc(num_prompt)
            self.num_prompt_tokens += num_prompt
            step_tokens += num_prompt
        num_new = len(output.new_token_ids)
        if num_new == 0:
            return step_tokens
        if times.first_token is None:
            times.first_token = now
            self.time_to_first_token.observe(now - times.added)
            # engine-side timings when the engine sends them (vtllm's engine core does);
            # otherwise the frontend's view, where the queue includes the prefill
            if output.queue_time_s is not None and output.prefill_time_s is not None:
                queue_s, prefill_s = output.queue_time_s, output.prefill_time_s
            else:
                queue_s, prefill_s = now - times.added, 0.0
            times.prefill_s = prefill_s
            self.request_queue_time.observe(queue_s)
            self.request_prefill_time.observe(prefill_s)
            if times.num_prompt_tokens > 0:
                self.time_per_prefill_token.observe(prefill_s / times.num_prompt_tokens)
        else:
            assert times.last_token is not None
            self.inter_token_latency.observe(now - times.last_token)
        times.last_token = now
        times.num_generation_tokens += num_new
        self.num_generation_tokens += num_new  # generation_tokens: once per batch (on_outputs)
        return step_tokens + num_new


class StatsLogger:
    """One console line every ``interval_s`` while there is activity (tokens flowed in
    the interval, or the engine has requests), plus one more line after it stops."""

    def __init__(self, metrics: FrontendMetrics, interval_s: float = STATS_LOG_INTERVAL_S):
        self.metrics = metrics
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last = (0, 0, 0, 0)  # prompt, generation, prefix queries, prefix hits
        self._was_active = False

    def line(self, now: float) -> str | None:
        """The stats line for the interval ending ``now``, or None when idle."""
        mt = self.metrics
        current = (
            mt.num_prompt_tokens,
            mt.num_generation_tokens,
            mt.num_prefix_queries,
            mt.num_prefix_hits,
        )
        prompt, generation, queries, hits = (
            c - p for c, p in zip(current, self._last, strict=True)
        )
        elapsed = max(now - self._last_time, 1e-9)
        self._last, self._last_time = current, now
        stats = mt.latest_stats or m.SchedulerStats()
        active = prompt > 0 or generation > 0 or stats.num_running > 0 or stats.num_waiting > 0
        if not active and not self._was_active:
            return None
        self._was_active = active
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (
            f"prompt throughput: {prompt / elapsed:.1f} tok/s, generation throughput: "
            f"{generation / elapsed:.1f} tok/s, running: {stats.num_running}, waiting: "
            f"{stats.num_waiting}, KV usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"prefix hit rate: {hit_rate:.1f}%"
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line(time.monotonic())
            if text is not None:
                logger.info("%s", text)
