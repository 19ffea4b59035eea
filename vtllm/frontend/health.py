"""``/health``'s verdict: 200 only while the engine core is serving.

503, with the reason, when the engine core is gone or dead (the engine client says so), or
when requests are in flight and no engine step has completed for longer than the step
deadline (``VT_STEP_TIMEOUT_S``): an engine that heart-beats but makes no progress is not
serving. The engine core itself ends such a wedge when its step deadline passes; this
check makes it visible to a load balancer meanwhile, and covers an engine core whose loop
is stuck outside a step.
"""

from __future__ import annotations

import time

from vtllm import envs
from vtllm.protocol import messages as m
from vtllm.protocol.async_client import EngineClient


class EngineHealth:
    """A ``RequestObserver`` of the engine client that remembers when the engine last made
    progress (any ``EngineOutputs``: each step sends one with its stats)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.last_progress = time.monotonic()
        self.stopping_reason: str | None = None  # set when the server is shutting down

    # -- RequestObserver -----------------------------------------------------------------

    def on_request_added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        if self.engine.num_in_flight <= 1:  # idle until now: the wait starts here
            self.last_progress = now

    def on_outputs(self, message: m.EngineOutputs, now: float) -> None:
        self.last_progress = now

    def on_request_done(self, request_id: str, finish_reason: str, now: float) -> None:
        pass

    # -- the verdict ---------------------------------------------------------------------

    def problem(self, now: float | None = None) -> str | None:
        """Why the server is not serving, or None when it is."""
        if self.stopping_reason is not None:
            return self.stopping_reason
        if not self.engine.is_alive:
            return f"engine core is not available: {self.engine.dead_reason or 'not connected'}"
        num_in_flight = self.engine.num_in_flight
        if num_in_flight:
            now = time.monotonic() if now is None else now
            silent_s = now - self.last_progress
            limit_s = envs.VT_STEP_TIMEOUT_S
            if silent_s > limit_s:
                return (
                    f"engine core has {num_in_flight} requests in flight and has completed "
                    f"no step for {silent_s:.0f}s (more than VT_STEP_TIMEOUT_S={limit_s:g}s)"
                )
        return None
