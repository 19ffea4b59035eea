"""Heartbeat lines and the bounded prefill-progress map."""

from __future__ import annotations

import logging

from vtllm.engine_core.step_log import (
    HeartbeatSnapshot,
    LoopCounters,
    PrefillProgress,
    StepHeartbeat,
    StepTimes,
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


def test_step_times_count_from_when_the_workers_could_start_each_step():
    times = StepTimes()
    # sync: each step submitted after the one before was collected; idle time between
    # (3.0 .. 5.0) counts nowhere
    times.record(True, 64, submitted_at=1.0, collected_at=1.5)
    times.record(False, 4, submitted_at=1.6, collected_at=1.7)
    times.record(False, 4, submitted_at=5.0, collected_at=5.25)
    # async: step submitted at 5.2, while the one before ran: it starts at 5.25
    times.record(True, 10, submitted_at=5.2, collected_at=5.5)
    # a step without tokens (only finished ids) counts nowhere, but it was collected
    times.record(False, 0, submitted_at=5.5, collected_at=5.6)
    times.record(False, 3, submitted_at=5.55, collected_at=5.7)
    assert (times.prefill_steps, times.prefill_tokens) == (2, 74)
    assert abs(times.prefill_s - (0.5 + 0.25)) < 1e-9
    assert (times.decode_steps, times.decode_tokens) == (3, 11)
    assert abs(times.decode_s - (0.1 + 0.25 + 0.1)) < 1e-9
    totals = times.totals()
    assert totals["decode_steps_total"] == 3 and totals["prefill_tokens_total"] == 74
    assert set(totals) == {
        f"{kind}_{key}_total"
        for kind in ("decode", "prefill")
        for key in ("steps", "seconds", "tokens")
    }
