"""Heartbeat lines and the bounded prefill-progress map."""

from __future__ import annotations

import logging

from vtllm.engine_core.step_log import (
    HeartbeatSnapshot,
    LoopCounters,
    PrefillProgress,
    StepHeartbeat,
    heartbeat_line,
)


def test_heartbeat_states():
    idle = heartbeat_line(HeartbeatSnapshot(0, 0, 0.0), 0, 0, 0, 0)
    busy = heartbeat_line(HeartbeatSnapshot(2, 1, 0.5), 10, 10, 100, 25)
    stalled = heartbeat_line(HeartbeatSnapshot(1, 3, 0.25), 0, 0, 100, 25)
    assert "state=idle" in idle
    assert "state=busy running=2 waiting=1 steps=10 model_executions=10" in busy
    assert "kv_usage=50.0%" in busy and "prefix_hit_rate=25.0%" in busy
    assert "state=stalled running=1 waiting=3" in stalled


def test_heartbeat_reports_deltas_since_last_line():
    counters = LoopCounters()
    snapshot = HeartbeatSnapshot(1, 0, 0.1)
    beat = StepHeartbeat(60.0, counters, lambda: snapshot)
    counters.steps = counters.model_executions = 5
    first = beat.tick()
    assert "state=busy" in first and "steps=5 model_executions=5" in first
    # nothing executed since the last line while a request is running: stalled
    assert "state=stalled" in beat.tick()
    counters.steps += 1  # a step with no model execution (only finished ids) is not progress
    assert "state=stalled" in beat.tick()


def test_stalled_lines_say_what_the_workers_heartbeats_say():
    counters = LoopCounters()
    liveness = "rank 0: serving for 42s, last heartbeat 31.0s ago"
    beat = StepHeartbeat(60.0, counters, lambda: HeartbeatSnapshot(1, 0, 0.1), lambda: liveness)
    counters.steps = counters.model_executions = 5
    assert "workers=" not in beat.tick()  # busy: nothing to explain
    assert beat.tick().endswith(f"workers=[{liveness}]")  # stalled: frozen, not slow


def test_heartbeat_thread_logs_periodically(caplog):
    counters = LoopCounters()
    beat = StepHeartbeat(0.05, counters, lambda: HeartbeatSnapshot(0, 0, 0.0))
    with caplog.at_level(logging.INFO, logger="vtllm.engine_core.step_log"):
        beat.start()
        import time

        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(caplog.records) < 2:
            time.sleep(0.02)
        beat.stop()
        beat.join(2)
    assert len(caplog.records) >= 2 and "state=idle" in caplog.records[0].message


def test_prefill_progress_two_phases_with_wall_clock(caplog):
    now = [100.0]
    progress = PrefillProgress(clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="vtllm.engine_core.step_log"):
        progress.begin("r", 0, 512, 1024)
        now[0] = 102.5
        progress.after("r", 512, 1024)
        progress.begin("r", 512, 512, 1024)
        now[0] = 105.0
        progress.after("r", 1024, 1024)
    messages = [r.message for r in caplog.records]
    assert any("prefill begin: request=r tokens=0..512 of 1024" in x for x in messages)
    assert any("prefill running: request=r tokens=512/1024 elapsed_s=2.500" in x for x in messages)
    assert any("prefill done: request=r tokens=1024/1024 elapsed_s=5.000" in x for x in messages)
    assert len(progress) == 0  # done: forgotten


def test_prefill_progress_map_is_bounded():
    progress = PrefillProgress(max_entries=8)
    for i in range(100):
        progress.begin(f"r{i}", 0, 16, 64)  # never finished (e.g. aborted without forget)
    assert len(progress) == 8
    progress.forget("r99")
    assert len(progress) == 7
