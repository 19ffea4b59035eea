"""Scheduler rules added for issue 10, driven through the engine core with the fake
executor: long prefills share the step, a missed due token ends the request, prefix-cache
stats count admissions, the prefill progress log, the reserve-full-sequence warning."""

from __future__ import annotations

import logging

import pytest

from tests.engine_core.test_engine_core import (
    add,
    expected_tokens,
    make_core,
    prompt_of,
    run_to_completion,
)
from vtllm.config import VtllmConfig
from vtllm.engine_core.core import EngineFacts, reserve_full_sequence_warning
from vtllm.protocol import messages as m

# -- long prefills share the step ------------------------------------------------------


def steps_until_first_token(core, request_id: str, max_steps: int = 100) -> tuple[int, list]:
    """Step until ``request_id`` has an output; returns (steps taken, outputs seen)."""
    seen = []
    for i in range(1, max_steps + 1):
        outputs, _ = core.step()
        seen.extend(o for _, o in outputs)
        if any(o.request_id == request_id and o.new_token_ids for _, o in outputs):
            return i, seen
    raise AssertionError(f"{request_id} got no token in {max_steps} steps")


@pytest.mark.parametrize("threshold", [16, 0])
def test_short_request_first_token_while_long_prompt_prefills(threshold):
    # Budget 64: without a cap the 400-token prompt takes all of 7 steps, and a short
    # request sent after the first one waits 6 more; with the cap it gets its first token
    # in the very next step.
    core, executor = make_core(
        num_blocks=160,
        max_model_len=512,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=threshold,
    )
    long_prompt = prompt_of(400, 1)
    add(core, "long", long_prompt, max_tokens=3)
    core.step()
    assert executor.steps[-1].num_scheduled_tokens == {"long": threshold or 64}
    add(core, "short", prompt_of(5, 2), max_tokens=2)
    num_steps, seen = steps_until_first_token(core, "short")
    if threshold:
        assert num_steps == 1
        assert executor.steps[-1].num_scheduled_tokens == {"long": 16, "short": 5}
    else:  # the old behaviour: the long prefill takes every step's budget until done
        assert num_steps == 6
    out = run_to_completion(core)
    long_tokens = [t for o in seen if o.request_id == "long" for t in o.new_token_ids]
    assert long_tokens + out["long"].new_token_ids == expected_tokens(long_prompt, 3)
    assert out["long"].finish_reason == m.FinishReason.LENGTH
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


@pytest.mark.parametrize(
    ("threshold", "chunks"), [(0, [64] * 4 + [44]), (100, [64] * 4 + [44]), (48, [48] * 6 + [12])]
)
def test_lone_long_prompt_chunks(threshold, chunks):
    # The cap holds for a lone prompt too (a newcomer may arrive during any step); a
    # threshold above the budget changes nothing.
    core, executor = make_core(
        num_blocks=160,
        max_model_len=512,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=threshold,
    )
    add(core, "long", prompt_of(300, 3), max_tokens=2)
    out = run_to_completion(core)
    prefill = [s.num_scheduled_tokens.get("long") for s in executor.steps][: len(chunks)]
    assert prefill == chunks
    assert out["long"].new_token_ids == expected_tokens(prompt_of(300, 3), 2)


def test_long_prompt_arriving_beside_decodes_is_capped():
    core, executor = make_core(
        num_blocks=160,
        max_model_len=512,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
    )
    add(core, "decoding", prompt_of(6, 4), max_tokens=30)
    core.step()
    add(core, "long1", prompt_of(100, 5), max_tokens=2)
    add(core, "long2", prompt_of(100, 6), max_tokens=2)
    core.step()
    # decodes keep a short step: each long prompt gets at most the threshold
    assert executor.steps[-1].num_scheduled_tokens == {"decoding": 1, "long1": 16, "long2": 16}
    out = run_to_completion(core)
    for rid, seed in (("long1", 5), ("long2", 6)):
        assert out[rid].new_token_ids == expected_tokens(prompt_of(100, seed), 2)


def test_threshold_must_not_be_negative():
    config = VtllmConfig()
    config.scheduler.long_prefill_token_threshold = -1
    with pytest.raises(ValueError, match="--long-prefill-token-threshold must be >= 0"):
        config.validate()


def test_preempting_a_request_already_scheduled_this_step_undoes_its_chunk():
    # 5 usable blocks of 4. "low" (10 tokens, 3 blocks) runs first; "high" (8 tokens, 2
    # blocks) fills the pool. In step 3 "low" is scheduled (no new block needed), then
    # "high" needs a block: the victim is "low", so its chunk is taken back in that step.
    core, executor = make_core(num_blocks=6, block_size=4, max_model_len=20, policy="priority")
    low_params = m.SamplingParams(temperature=0.0, max_tokens=10)
    core.add_request(b"c", m.AddRequest("low", prompt_of(10, 1), low_params, priority=5))
    low = core.scheduler.requests["low"]
    seen = core.step()[0]
    high_params = m.SamplingParams(temperature=0.0, max_tokens=8)
    core.add_request(b"c", m.AddRequest("high", prompt_of(8, 2), high_params, priority=0))
    seen += core.step()[0] + core.step()[0]
    assert executor.steps[2].num_scheduled_tokens == {"high": 1}
    assert executor.steps[2].finished_request_ids == ["low"]
    out = run_to_completion(core)
    assert low.num_preemptions == 1
    for rid, prompt, num in (("low", prompt_of(10, 1), 10), ("high", prompt_of(8, 2), 8)):
        early = [t for _, o in seen if o.request_id == rid for t in o.new_token_ids]
        assert early + out[rid].new_token_ids == expected_tokens(prompt, num)


# -- a token that was due and never came ---------------------------------------------


@pytest.mark.parametrize(
    ("drop_after_steps", "when"), [(0, "its prefill completed"), (2, "decoding")]
)
def test_missed_due_token_ends_request_with_error(drop_after_steps, when):
    core, executor = make_core()
    add(core, "victim", prompt_of(9, 1), max_tokens=10)
    add(core, "bystander", prompt_of(7, 2), max_tokens=10)
    for _ in range(drop_after_steps):
        core.step()
    executor.dropped_tokens.add("victim")
    outputs, _ = core.step()
    (victim,) = [o for _, o in outputs if o.request_id == "victim"]
    assert victim.finish_reason == m.FinishReason.ERROR
    assert "returned no token for this request in step" in victim.error and when in victim.error
    assert "victim" not in core.scheduler.requests
    out = run_to_completion(core, max_steps=50)
    assert out["bystander"].new_token_ids[-1] == expected_tokens(prompt_of(7, 2), 10)[-1]
    assert "victim" not in executor.states  # the workers were told to drop it
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_mid_prefill_request_is_not_due_a_token():
    core, executor = make_core(max_num_batched_tokens=8)
    add(core, "long", prompt_of(20, 1), max_tokens=2)
    outputs, _ = core.step()  # a chunk of 8 of 20: no token expected, none missing
    assert outputs == [] and "long" in core.scheduler.requests
    assert run_to_completion(core)["long"].finish_reason == m.FinishReason.LENGTH


# -- prefix-cache stats count admissions -----------------------------------------------


def test_prefix_hits_recorded_at_admission_not_first_attempt():
    # 8 usable blocks of 4. "shared" holds 4..5 blocks, "hog" 2..3, so "waiter" (22 tokens,
    # 6 blocks) cannot get blocks until "hog" ends. Meanwhile "shared" decodes the 5th block
    # of the waiter's prompt, so the waiter's hit grows from 16 tokens (first attempt) to 20.
    core, _ = make_core(num_blocks=9, block_size=4, max_model_len=32)
    shared = prompt_of(16, 1)
    add(core, "shared", shared, max_tokens=12)
    add(core, "hog", prompt_of(8, 2), max_tokens=4)
    core.step()
    add(core, "waiter", shared + expected_tokens(shared, 4) + [5, 6], max_tokens=1)
    waiter = core.scheduler.requests["waiter"]
    core.step()
    assert (
        waiter in core.scheduler.waiting
        and core.scheduler.kv.num_matched_prefix_tokens(waiter) == 16
    )
    out = run_to_completion(core)
    assert out["waiter"].num_cached_tokens == 20
    assert core.counters.prefix_hits == 20  # what the admission used, not the first attempt
    assert core.counters.prefix_queries == 16 + 8 + 22


# -- prefill progress log --------------------------------------------------------------


def test_engine_step_logs_prefill_progress(caplog):
    core, _ = make_core(max_num_batched_tokens=8)
    add(core, "long", prompt_of(20, 1), max_tokens=2)
    with caplog.at_level(logging.DEBUG, logger="vtllm.engine_core.step_log"):
        run_to_completion(core)
    messages = [r.message for r in caplog.records]
    for expected in (
        "prefill begin: request=long tokens=0..8 of 20",
        "prefill begin: request=long tokens=16..20 of 20",
        "prefill running: request=long tokens=8/20",
        "prefill running: request=long tokens=16/20",
        "prefill done: request=long tokens=20/20",
    ):
        assert any(expected in x for x in messages), (expected, messages)
    assert len(core.progress) == 0


def test_request_failing_mid_prefill_leaves_no_progress_entry():
    core, executor = make_core(max_num_batched_tokens=8)
    add(core, "long", prompt_of(20, 1), max_tokens=2)
    core.step()
    assert len(core.progress) == 1
    executor.errors["long"] = "out of device memory"
    ((_, out),) = core.step()[0]
    assert out.finish_reason == m.FinishReason.ERROR and "out of device memory" in out.error
    assert len(core.progress) == 0


# -- reserve-full-sequence warning -----------------------------------------------------


def test_reserve_full_sequence_warns_at_start(caplog):
    with caplog.at_level(logging.WARNING, logger="vtllm.engine_core.core"):
        make_core(num_blocks=65, block_size=4, max_model_len=100, reserve_full_sequence=True)
    (record,) = [r for r in caplog.records if "--reserve-full-sequence" in r.message]
    assert "max_model_len (100) tokens" in record.message
    assert "holds 2 such reservations" in record.message  # 64 blocks of 4 = 256 tokens
    assert "set --default-max-tokens" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vtllm.engine_core.core"):
        make_core()
    assert not [r for r in caplog.records if "--reserve-full-sequence" in r.message]


def test_reserve_full_sequence_warning_with_default_max_tokens():
    config = VtllmConfig()
    config.scheduler.reserve_full_sequence = True
    config.frontend.default_max_tokens = 256
    facts = EngineFacts("test", 8192, 1000, 1025, 16, (2,))
    warning = reserve_full_sequence_warning(config, facts)
    assert "holds 2 such reservations" in warning
    assert "--default-max-tokens is 256" in warning
    config.scheduler.reserve_full_sequence = False
    assert reserve_full_sequence_warning(config, facts) is None
