"""Async scheduling in the engine core, with the fake executor (which serves async steps
as a worker must: a position after the known tokens takes the token sampled by the step
just before, and nothing else).

Every example test of ``test_engine_core.py`` runs again with async scheduling on, then
the placeholder accounting is checked step by step.
"""

from __future__ import annotations

import inspect
import logging

import pytest

from tests.engine_core import test_engine_core as base
from tests.engine_core.fake_executor import FakeExecutor
from tests.engine_core.test_engine_core import EOS, add, expected_tokens, make_core, prompt_of
from vtllm.config import VtllmConfig
from vtllm.engine_core.core import EngineCore, EngineFacts
from vtllm.protocol import messages as m

# These assert in which call of ``step()`` an output comes; async scheduling hands each
# step's outputs back one call later (the call that submits the next step).
_STEP_TIMING = {
    "test_chunked_prefill_interleaves_with_decodes",
    "test_first_token_output_carries_engine_timings",
    "test_stats_attached_each_step_with_deltas",
}
_BASE_TESTS = sorted(
    name
    for name, fn in inspect.getmembers(base, inspect.isfunction)
    if name.startswith("test_") and not inspect.signature(fn).parameters
)


@pytest.mark.parametrize("name", [n for n in _BASE_TESTS if n not in _STEP_TIMING])
def test_engine_core_example_with_async_scheduling(name, monkeypatch):
    monkeypatch.setattr(base, "ASYNC_SCHEDULING", True)
    getattr(base, name)()


def _step(core: EngineCore, results: dict[str, list[int]], finished: dict) -> None:
    outputs, _ = core.step()
    for _, output in outputs:
        assert output.request_id not in finished, f"{output.request_id}: output after its end"
        results.setdefault(output.request_id, []).extend(output.new_token_ids)
        if output.finish_reason is not None:
            finished[output.request_id] = output.finish_reason


def test_placeholders_follow_the_steps_in_flight():
    core, executor = make_core(async_scheduling=True)
    prompt = prompt_of(6)
    add(core, "a", prompt, max_tokens=4)
    request = core.scheduler.requests["a"]
    results: dict[str, list[int]] = {}
    finished: dict = {}
    _step(core, results, finished)  # the prefill, in flight; nothing collected
    assert results == {} and len(core._in_flight) == 1
    assert request.num_output_placeholders == 1 and request.num_computed_tokens == 6
    _step(core, results, finished)  # decodes position 6 before token 6 is known
    assert results == {"a": expected_tokens(prompt, 1)}
    assert request.num_output_placeholders == 1 and request.num_computed_tokens == 7
    assert executor.num_placeholder_inputs == 1
    step = executor.steps[-1]
    assert step.num_scheduled_tokens == {"a": 1}
    assert step.cached_requests[0].new_token_ids == []  # not known when it was sent
    _step(core, results, finished)
    _step(core, results, finished)  # the step in flight samples the 4th: none after it
    assert request.num_output_placeholders == 1 and len(executor.steps) == 4
    _step(core, results, finished)  # nothing left to schedule: collect only
    assert len(executor.steps) == 4
    _step(core, results, finished)  # tell the workers to drop "a"
    assert executor.steps[-1].num_scheduled_tokens == {}
    assert executor.steps[-1].finished_request_ids == ["a"]
    _step(core, results, finished)  # collect that one
    assert not core.has_work()
    assert results == {"a": expected_tokens(prompt, 4)}
    assert finished == {"a": m.FinishReason.LENGTH}
    assert request.num_output_placeholders == 0


def test_stop_token_mid_flight_drops_the_extra_token_and_frees_the_blocks():
    core, executor = make_core(async_scheduling=True)
    prompt = prompt_of(9, seed=3)
    executor.forced_tokens["s"] = [50, EOS, 60, 61]
    add(core, "s", prompt, max_tokens=10)
    add(core, "t", prompt_of(5, seed=4), max_tokens=6)
    results: dict[str, list[int]] = {}
    finished: dict = {}
    while core.has_work():
        _step(core, results, finished)
    assert results["s"] == [50, EOS] and finished["s"] == m.FinishReason.STOP
    # the step after EOS was already scheduled: it computed a third token for "s", which
    # never reached the client, and the workers were then told to drop "s"
    assert sum("s" in step.num_scheduled_tokens for step in executor.steps) == 3
    assert executor.forced_tokens["s"] == [61]
    assert any("s" in step.finished_request_ids for step in executor.steps)
    assert results["t"] == expected_tokens(prompt_of(5, seed=4), 6)
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and executor.states == {}


def test_abort_in_flight_and_an_id_reused_at_once():
    core, executor = make_core(async_scheduling=True)
    add(core, "x", prompt_of(5, seed=1), max_tokens=20)
    results: dict[str, list[int]] = {}
    finished: dict = {}
    for _ in range(4):
        _step(core, results, finished)
    assert len(results["x"]) == 3 and len(core._in_flight) == 1  # the 4th is in flight
    ((_, aborted),) = core.abort(["x"], b"client")
    assert aborted.finish_reason == m.FinishReason.ABORT
    del results["x"]
    new_prompt = prompt_of(7, seed=2)
    add(core, "x", new_prompt, max_tokens=3)  # same id, while the old one's step runs
    while core.has_work():
        _step(core, results, finished)
    assert results["x"] == expected_tokens(new_prompt, 3)  # no token of the old "x"
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_requests_needing_host_tokens_run_steps_one_at_a_time(caplog):
    core, executor = make_core(async_scheduling=True)
    add(core, "plain", prompt_of(4), max_tokens=6)
    add(core, "lp", prompt_of(5, seed=1), max_tokens=6, logprobs=0)
    results: dict[str, list[int]] = {}
    finished: dict = {}
    with caplog.at_level("INFO"):
        while core.has_work():
            _step(core, results, finished)
            if "lp" in core.scheduler.requests:  # live: nothing left in flight
                assert not core._in_flight
    assert executor.num_placeholder_inputs == 0  # "lp" lived as long as "plain"
    assert "async scheduling paused" in caplog.text
    assert results["plain"] == expected_tokens(prompt_of(4), 6)
    # once it is gone, steps overlap again
    add(core, "later", prompt_of(6, seed=5), max_tokens=5)
    with caplog.at_level("INFO"):
        while core.has_work():
            _step(core, results, finished)
    assert executor.num_placeholder_inputs > 0 and "async scheduling resumed" in caplog.text
    assert core.scheduler.num_needing_host_tokens == 0


def test_at_most_one_step_in_flight_beyond_the_one_collected():
    core, executor = make_core(async_scheduling=True, num_blocks=12, max_num_seqs=4)
    prompts = {f"r{i}": prompt_of(3 + 2 * i, seed=i) for i in range(6)}
    for request_id, prompt in prompts.items():
        add(core, request_id, prompt, max_tokens=7, ignore_eos=True)
    results: dict[str, list[int]] = {}
    finished: dict = {}
    submitted = executor.submit
    depth = []

    def submit(step):
        depth.append(len(executor.results))
        submitted(step)

    executor.submit = submit
    while core.has_work():
        _step(core, results, finished)
    assert max(depth) == 1 and core.scheduler.num_preemptions_total > 0
    for request_id, prompt in prompts.items():
        assert results[request_id] == expected_tokens(prompt, 7)


@pytest.mark.parametrize(
    ("setting", "on_gpu", "expected"),
    [(None, True, True), (None, False, False), (False, True, False), (True, False, True)],
)
def test_async_scheduling_unset_follows_the_workers_device(setting, on_gpu, expected, caplog):
    """Unset ``--async-scheduling``: on over GPU workers, off over CPU ones (the start-up
    log says which and how to change it); a given value is kept either way."""
    config = VtllmConfig()
    config.scheduler.async_scheduling = setting
    facts = EngineFacts("test", 128, 1000, 64, 4, (EOS,), on_gpu=on_gpu)
    with caplog.at_level(logging.INFO, logger="vtllm"):
        core = EngineCore(config, facts, FakeExecutor(vocab_size=1000, block_size=4))
    assert core.async_scheduling is expected
    said = [r.getMessage() for r in caplog.records if "async scheduling" in r.getMessage()]
    if setting is None:
        device = "GPUs" if on_gpu else "CPU"
        flag = "--no-async-scheduling" if expected else "--async-scheduling"
        assert said == [
            f"async scheduling {'on' if expected else 'off'} (the default on {device}; {flag} to change it)"
        ]
    else:
        assert said == []
