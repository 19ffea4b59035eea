"""Requests with a structured output wait for their grammar without holding anyone: the
engine core asks the (fake) driver to compile at admission, schedules the request only
after the answer, fails it as INVALID_REQUEST when the compile fails or is too slow, and
releases the driver's grammar however the request ends. Without structured outputs,
nothing of this happens (no message)."""

from __future__ import annotations

import pytest

from tests.engine_core.fake_executor import UNCOMPILABLE
from tests.engine_core.test_engine_core import add, make_core, run_to_completion
from vtllm.protocol import messages as m

GRAMMAR = m.StructuredOutputSpec(m.StructuredOutputKind.GRAMMAR, 'root ::= "a"+')


def _run(core) -> dict[str, m.RequestOutput]:
    """Step while a step has something to do (requests waiting only for grammars do not
    count); each request's accumulated output."""
    results: dict[str, m.RequestOutput] = {}
    for _ in range(1000):
        if not core.scheduler.has_work():
            return results
        for _, out in core.step()[0]:
            acc = results.setdefault(out.request_id, m.RequestOutput(out.request_id, []))
            acc.new_token_ids.extend(out.new_token_ids)
            acc.finish_reason = out.finish_reason
    raise AssertionError("still busy after 1000 steps")


def _scheduled(executor) -> list[set[str]]:
    return [set(step.num_scheduled_tokens) for step in executor.steps]


def test_a_request_waiting_for_its_grammar_lets_the_others_run():
    core, executor = make_core()
    executor.auto_compile = False
    add(core, "slow", [5, 6, 7], max_tokens=4, structured_output=GRAMMAR)
    add(core, "plain", [8, 9], max_tokens=4)
    assert executor.compiling.keys() == {"slow"}  # asked at admission, before any step
    results = _run(core)
    # "plain" ran to the end while "slow" waited, in its place, for its compile
    assert results["plain"].finish_reason == m.FinishReason.LENGTH
    assert "slow" not in results and all("slow" not in s for s in _scheduled(executor))
    assert core.has_work() and [r.request_id for r in core.scheduler.waiting] == ["slow"]
    assert core.step() == ([], None)  # nothing to execute: no empty step is sent
    num_steps = len(executor.steps)
    executor.finish_compile("slow")
    results = run_to_completion(core)
    assert results["slow"].finish_reason == m.FinishReason.LENGTH
    assert len(results["slow"].new_token_ids) == 4
    assert "slow" in _scheduled(executor)[num_steps]
    assert executor.grammar_held == set()  # released when it finished


def test_the_waiting_request_keeps_its_place_in_the_queue():
    """Admitted first, it is scheduled first once compiled, ahead of later arrivals."""
    core, executor = make_core(max_num_seqs=1)
    executor.auto_compile = False
    add(core, "g", [5, 6], max_tokens=2, structured_output=GRAMMAR)
    add(core, "a", [7, 8], max_tokens=6)
    add(core, "b", [9, 10], max_tokens=2)
    core.step()
    assert _scheduled(executor)[-1] == {"a"}
    executor.finish_compile("g")
    while core.scheduler.running:
        core.step()
    core.step()
    assert _scheduled(executor)[-1] == {"g"}  # before "b", which arrived after it


def test_an_uncompilable_grammar_ends_as_invalid_request_and_others_go_on():
    core, executor = make_core()
    bad = m.StructuredOutputSpec(m.StructuredOutputKind.GRAMMAR, UNCOMPILABLE)
    add(core, "bad", [5, 6, 7], structured_output=bad)
    add(core, "good", [8, 9], max_tokens=3)
    outputs, _ = core.step()
    (failed,) = [o for _, o in outputs if o.request_id == "bad"]
    assert failed.finish_reason == m.FinishReason.ERROR and failed.new_token_ids == []
    assert failed.error_code == m.ErrorCode.INVALID_REQUEST
    assert "does not compile" in failed.error and "fake compiler refuses" in failed.error
    assert run_to_completion(core)["good"].finish_reason == m.FinishReason.LENGTH
    assert executor.grammar_held == set() and core.num_unfinished(b"client") == 0


def test_a_compile_past_the_deadline_fails_its_request(monkeypatch):
    monkeypatch.setenv("VT_GRAMMAR_COMPILE_TIMEOUT_S", "0")
    core, executor = make_core()
    executor.auto_compile = False
    add(core, "slow", [5, 6, 7], structured_output=GRAMMAR)
    outputs, _ = core.step()
    ((_, failed),) = outputs
    assert failed.finish_reason == m.FinishReason.ERROR
    assert failed.error_code == m.ErrorCode.INVALID_REQUEST
    assert "did not compile within 0s" in failed.error
    assert "VT_GRAMMAR_COMPILE_TIMEOUT_S" in failed.error
    assert executor.grammar_held == set() and not core.has_work()


def test_aborting_a_request_waiting_for_its_grammar_leaves_no_state():
    core, executor = make_core()
    executor.auto_compile = False
    add(core, "x", [5, 6, 7], structured_output=GRAMMAR)
    ((_, aborted),) = core.abort(["x"])
    assert aborted.finish_reason == m.FinishReason.ABORT
    assert executor.grammar_held == set() and executor.compiling == {}
    assert core.scheduler.requests == {} and core.scheduler.num_awaiting_grammar == 0
    assert core._awaiting_grammars == {} and not core.has_work()
    # the same id, reused at once: the first compile's late answer is not taken for its own
    add(core, "x", [5, 6, 7], max_tokens=2, structured_output=GRAMMAR)
    stale_seq = core._awaiting_grammars["x"][0] - 1
    executor.grammar_answers.append(m.GrammarReady("x", stale_seq))
    assert core.step() == ([], None)
    assert core.scheduler.waiting[0].awaiting_grammar
    executor.finish_compile("x")
    assert run_to_completion(core)["x"].finish_reason == m.FinishReason.LENGTH


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
def test_without_structured_outputs_no_grammar_message_is_sent(policy):
    core, executor = make_core(policy=policy)
    for i in range(4):
        add(core, f"r{i}", [5 + i, 6, 7], max_tokens=3)
    core.abort(["r3"])
    results = run_to_completion(core)
    assert len(results) == 3 and executor.num_grammar_messages == 0
