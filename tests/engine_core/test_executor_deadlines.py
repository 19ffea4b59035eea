"""The executor never waits without a deadline: real worker processes (no model, see
``fake_workers``) that hang, freeze or stall a start-up phase each raise
``WorkerDiedError`` within their bound, with a message that says which failure it was."""

from __future__ import annotations

import time

import msgspec
import pytest

from vtllm.config import VtllmConfig
from vtllm.engine_core.executor import MultiprocExecutor, WorkerDiedError, process_state
from vtllm.protocol import messages as m
from vtllm.protocol import transport

ENTRY = "tests.engine_core.fake_workers:run_fake_worker"
STEP = m.SchedulerOutput(step_id=1, new_requests=[], cached_requests=[], num_scheduled_tokens={})


@pytest.fixture
def make_executor(tmp_path):
    executors: list[MultiprocExecutor] = []

    def make(scenario: str, world_size: int = 1) -> MultiprocExecutor:
        config = VtllmConfig()
        config.parallel.tensor_parallel_size = world_size
        executor = MultiprocExecutor(
            config,
            scenario,
            transport.ipc_address(tmp_path, f"workers-{len(executors)}.sock"),
            "tcp://127.0.0.1:1",
            worker_entry=ENTRY,
        )
        executors.append(executor)
        return executor

    yield make
    for executor in executors:
        executor.shutdown(timeout_s=0.5)


def test_a_healthy_worker_serves_steps_and_reports_its_phase(make_executor):
    executor = make_executor("serve")
    executor.start()
    executor.init_kv_cache(4, 16)
    assert executor.execute(STEP).step_id == 1
    time.sleep(0.5)
    executor.execute(STEP)
    assert "rank 0: serving for" in executor.describe_liveness()


def test_a_result_read_while_the_next_step_is_submitted_is_kept(make_executor, monkeypatch):
    """Async scheduling submits step 2 while step 1's result may already wait in the
    socket; submitting reads what is queued, and must keep that result for ``collect``."""
    monkeypatch.setenv("VT_STEP_TIMEOUT_S", "5")
    executor = make_executor("serve")
    executor.start()
    executor.init_kv_cache(4, 16)
    executor.submit(STEP)
    time.sleep(0.3)  # the fake worker answers at once: step 1's result is queued by now
    executor.submit(msgspec.structs.replace(STEP, step_id=2))
    assert executor.collect().step_id == 1
    assert executor.collect().step_id == 2


def test_an_idle_spell_longer_than_the_heartbeat_timeout_is_not_silence(make_executor, monkeypatch):
    """While no step runs nobody reads the socket; the beats queued meanwhile count."""
    monkeypatch.setenv("VT_WORKER_HEARTBEAT_TIMEOUT_S", "1.5")
    executor = make_executor("serve")
    executor.start()
    executor.init_kv_cache(4, 16)
    assert executor.execute(STEP).step_id == 1
    time.sleep(3.0)  # idle: twice the timeout, the worker beating all along
    assert executor.execute(STEP).step_id == 1


def test_a_start_up_phase_past_its_bound_names_the_phase(make_executor, monkeypatch):
    monkeypatch.setenv("VT_WORKER_START_TIMEOUT_S", "1.5")
    executor = make_executor("stuck-loading")
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="spent more than 2s loading the model"):
        executor.start()
    assert time.monotonic() - started < 10


def test_a_step_past_the_deadline_is_a_hung_device(make_executor, monkeypatch):
    monkeypatch.setenv("VT_STEP_TIMEOUT_S", "1.5")
    executor = make_executor("hang-step")
    executor.start()
    executor.init_kv_cache(4, 16)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="did not finish within VT_STEP_TIMEOUT_S=1.5s") as e:
        executor.execute(STEP)
    assert 1.5 <= time.monotonic() - started < 5
    assert "workers are alive" in str(e.value) and "rank 0: serving" in str(e.value)


def test_a_hung_step_with_another_in_flight_is_a_hung_device(make_executor, monkeypatch):
    """Async scheduling: two steps submitted, the first never answered."""
    monkeypatch.setenv("VT_STEP_TIMEOUT_S", "1.5")
    executor = make_executor("hang-step")
    executor.start()
    executor.init_kv_cache(4, 16)
    started = time.monotonic()
    executor.submit(STEP)
    executor.submit(msgspec.structs.replace(STEP, step_id=2))
    with pytest.raises(WorkerDiedError, match="step 1 .* did not finish within VT_STEP_TIMEOUT"):
        executor.collect()
    assert 1.5 <= time.monotonic() - started < 5


def test_a_frozen_worker_is_told_apart_from_a_slow_step(make_executor, monkeypatch):
    monkeypatch.setenv("VT_WORKER_HEARTBEAT_TIMEOUT_S", "1.5")
    monkeypatch.setenv("VT_STEP_TIMEOUT_S", "60")
    executor = make_executor("freeze-on-step")
    executor.start()
    executor.init_kv_cache(4, 16)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="sent no heartbeat for") as e:
        executor.execute(STEP)
    assert time.monotonic() - started < 5
    assert "stopped (SIGSTOP" in str(e.value) and "it was serving" in str(e.value)


def test_a_killed_rank_is_named_not_the_rank_whose_collective_failed(make_executor):
    """Under TP the survivor's failure ("Connection closed by peer") often arrives before
    the dead rank's exit is seen; the error must still blame the dead rank."""
    executor = make_executor("rank1-killed-on-step", world_size=2)
    executor.start()
    executor.init_kv_cache(4, 16)
    with pytest.raises(WorkerDiedError) as e:
        executor.execute(STEP)
    pid = executor.processes[1].pid
    assert f"worker rank 1 (pid {pid}) exited with code -9" in str(e.value), e.value
    assert "rank 0 then failed: RuntimeError: [pair.cc:553] Connection closed" in str(e.value)
    assert "Traceback" not in str(e.value)


def test_an_unreachable_rank_whose_process_exited_is_named_by_its_exit(make_executor):
    """ZMQ may refuse a send to a SIGKILLed rank ("Host unreachable") before the engine
    sees the exit: the error still names the exit, not the unreachable socket."""
    import os
    import signal

    import zmq

    executor = make_executor("serve", world_size=2)
    executor.start()
    executor.init_kv_cache(4, 16)
    pid = executor.processes[1].pid
    os.kill(pid, signal.SIGKILL)
    unreachable = zmq.ZMQError(zmq.EHOSTUNREACH)
    message = executor._describe_unreachable(b"rank-1", unreachable)
    assert message.startswith(f"worker rank 1 (pid {pid}) exited with code -9"), message
    assert "Host unreachable" in message
    # a rank whose process lives is still "cannot reach"
    assert executor._describe_unreachable(b"rank-0", unreachable).startswith(
        "cannot reach worker rank-0: "
    )


def test_a_failing_rank_is_named_while_its_peers_live(make_executor):
    executor = make_executor("rank0-fails-on-step", world_size=2)
    executor.start()
    executor.init_kv_cache(4, 16)
    with pytest.raises(WorkerDiedError, match="^worker rank 0 failed: ValueError: a bug"):
        executor.execute(STEP)


def test_process_state_reads_proc():
    import os

    assert process_state(os.getpid()) == "running"
    assert process_state(None) == ""
