"""Observability of the engine loop: the ``VT_ENGINE_STEP_LOG`` heartbeat and the
two-phase prefill progress log.

The heartbeat runs on its own thread so that it keeps reporting while the loop is stuck
inside a model execution — that is exactly when ``stalled`` matters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("vtllm.engine_core.step_log")


@dataclass
class LoopCounters:
    """Written by the engine loop, read (and the deltas reset) by the heartbeat thread."""

    steps: int = 0
    model_executions: int = 0
    prefix_queries: int = 0  # cumulative tokens
    prefix_hits: int = 0


@dataclass
class StepTimes:
    """Where the engine's busy time went, by kind of step: ``decode`` (every request of the
    step computes one output token) and ``prefill`` (some request computes prompt tokens:
    a prefill or a mixed prefill+decode step).

    A step's time runs from when the workers could start it (its submission, or the
    collection of the step before it, whichever is later) to its collection: with async
    scheduling, steps back to back, that is the workers' time for it plus the collection;
    time the engine sat idle counts nowhere. Steps without tokens count nowhere either.
    Cumulative over the process (read deltas: ``vtllm bench throughput`` does)."""

    decode_steps: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0
    prefill_steps: int = 0
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    _last_collected_at: float = float("-inf")

    def record(
        self, has_prompt_tokens: bool, num_tokens: int, submitted_at: float, collected_at: float
    ) -> None:
        """One collected step of ``num_tokens`` (monotonic ``submitted_at`` and
        ``collected_at`` seconds)."""
        seconds = max(0.0, collected_at - max(submitted_at, self._last_collected_at))
        self._last_collected_at = collected_at
        if num_tokens <= 0:
            return
        if has_prompt_tokens:
            self.prefill_steps += 1
            self.prefill_s += seconds
            self.prefill_tokens += num_tokens
        else:
            self.decode_steps += 1
            self.decode_s += seconds
            self.decode_tokens += num_tokens

    def totals(self) -> dict[str, float]:
        """``get_stats``' keys: ``{decode,prefill}_{steps,seconds,tokens}_total``."""
        return {
            "decode_steps_total": self.decode_steps,
            "decode_seconds_total": self.decode_s,
            "decode_tokens_total": self.decode_tokens,
            "prefill_steps_total": self.prefill_steps,
            "prefill_seconds_total": self.prefill_s,
            "prefill_tokens_total": self.prefill_tokens,
        }


@dataclass(frozen=True)
class HeartbeatSnapshot:
    num_running: int
    num_waiting: int
    kv_usage: float


def heartbeat_line(
    snapshot: HeartbeatSnapshot,
    steps: int,
    executions: int,
    prefix_queries: int,
    prefix_hits: int,
    workers: str = "",
) -> str:
    """One heartbeat line. ``idle``: nothing unfinished; ``busy``: the model ran since the
    last line; ``stalled``: unfinished work but no model execution since the last line —
    then ``workers`` (what their heartbeats say) follows, so that a slow step (beating,
    in "serving") and a frozen worker (last heartbeat long ago) read differently."""
    unfinished = snapshot.num_running + snapshot.num_waiting
    if unfinished == 0:
        state = "idle"
    elif executions > 0:
        state = "busy"
    else:
        state = "stalled"
    hit_rate = 100.0 * prefix_hits / prefix_queries if prefix_queries else 0.0
    line = (
        f"engine step log: state={state} running={snapshot.num_running} "
        f"waiting={snapshot.num_waiting} steps={steps} model_executions={executions} "
        f"kv_usage={100.0 * snapshot.kv_usage:.1f}% prefix_hit_rate={hit_rate:.1f}%"
    )
    if state == "stalled" and workers:
        line += f" workers=[{workers}]"
    return line


class StepHeartbeat(threading.Thread):
    """Logs ``heartbeat_line`` every ``period_s`` seconds until ``stop()``."""

    def __init__(
        self,
        period_s: float,
        counters: LoopCounters,
        snapshot: Callable[[], HeartbeatSnapshot],
        workers: Callable[[], str] = str,
    ) -> None:
        super().__init__(name="vtllm-step-log", daemon=True)
        self.period_s = period_s
        self.counters = counters
        self.snapshot = snapshot
        self.workers = workers  # the executor's describe_liveness (read on stalled lines)
        self._stop_event = threading.Event()
        self._last_steps = 0
        self._last_executions = 0

    def tick(self) -> str:
        steps = self.counters.steps
        executions = self.counters.model_executions
        line = heartbeat_line(
            self.snapshot(),
            steps - self._last_steps,
            executions - self._last_executions,
            self.counters.prefix_queries,
            self.counters.prefix_hits,
            self.workers(),
        )
        self._last_steps, self._last_executions = steps, executions
        logger.info(line)
        return line

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            try:
                self.tick()
            except Exception:  # never let logging kill the engine
                logger.exception("step log failed")

    def stop(self) -> None:
        self._stop_event.set()


class PrefillProgress:
    """Two-phase prefill log: ``begin`` when a chunk is scheduled, ``running``/``done``
    after it executed, with wall-clock ``elapsed_s`` since the request's first chunk.

    Holds at most ``max_entries`` requests (oldest dropped) and forgets a request as soon
    as its prefill is done or it finishes, so it cannot grow with the process lifetime.
    """

    def __init__(self, max_entries: int = 1024, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.clock = clock
        self._started: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._started)

    def begin(self, request_id: str, num_done: int, num_chunk: int, num_total: int) -> None:
        if request_id not in self._started:
            self._started[request_id] = self.clock()
            while len(self._started) > self.max_entries:
                self._started.popitem(last=False)
        logger.debug(
            "prefill begin: request=%s tokens=%d..%d of %d",
            request_id,
            num_done,
            num_done + num_chunk,
            num_total,
        )

    def after(self, request_id: str, num_done: int, num_total: int) -> None:
        started = self._started.get(request_id)
        if started is None:
            return
        elapsed = self.clock() - started
        phase = "done" if num_done >= num_total else "running"
        # Quick prefills stay out of an INFO log; long ones (the ones people ask about) show.
        level = logging.INFO if phase == "running" or elapsed >= 1.0 else logging.DEBUG
        logger.log(
            level,
            "prefill %s: request=%s tokens=%d/%d elapsed_s=%.3f",
            phase,
            request_id,
            num_done,
            num_total,
            elapsed,
        )
        if phase == "done":
            del self._started[request_id]

    def forget(self, request_id: str) -> None:
        self._started.pop(request_id, None)
