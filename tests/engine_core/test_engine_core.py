"""The engine core driven directly with a fake executor: scheduling, chunked prefill,
prefix caching, preemption, guards and stats — milliseconds each."""

from __future__ import annotations

import random

import pytest

from tests.engine_core.fake_executor import FakeExecutor, next_token
from vtllm.config import VtllmConfig
from vtllm.engine_core.core import EngineCore, EngineFacts
from vtllm.protocol import messages as m

VOCAB = 1000
EOS = 2
# every test here runs again with async scheduling (test_async_scheduling.py sets it)
ASYNC_SCHEDULING = False


def make_core(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 128,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    caching: bool = True,
    reserve_full_sequence: bool = False,
    long_prefill_token_threshold: int | None = None,  # None: the config's default
    async_scheduling: bool | None = None,  # None: ASYNC_SCHEDULING
) -> tuple[EngineCore, FakeExecutor]:
    config = VtllmConfig()
    config.scheduler.async_scheduling = (
        ASYNC_SCHEDULING if async_scheduling is None else async_scheduling
    )
    config.cache.block_size = block_size
    config.cache.enable_prefix_caching = caching
    config.scheduler.max_num_batched_tokens = max_num_batched_tokens
    config.scheduler.max_num_seqs = max_num_seqs
    config.scheduler.scheduling_policy = policy
    config.scheduler.reserve_full_sequence = reserve_full_sequence
    if long_prefill_token_threshold is not None:
        config.scheduler.long_prefill_token_threshold = long_prefill_token_threshold
    facts = EngineFacts("test", max_model_len, VOCAB, num_blocks, block_size, (EOS,))
    executor = FakeExecutor(vocab_size=VOCAB, block_size=block_size)
    return EngineCore(config, facts, executor), executor


def add(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int | None = 8, **kw):
    params = m.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return core.add_request(b"client", m.AddRequest(request_id, prompt, params))


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, m.RequestOutput]:
    """Step until idle; returns each request's accumulated output (tokens + finish)."""
    results: dict[str, m.RequestOutput] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return results
        outputs, _ = core.step()
        for _, out in outputs:
            acc = results.setdefault(out.request_id, m.RequestOutput(out.request_id, []))
            acc.new_token_ids.extend(out.new_token_ids)
            acc.finish_reason = out.finish_reason
            acc.error = out.error
            acc.num_cached_tokens = out.num_cached_tokens
    raise AssertionError(f"engine still busy after {max_steps} steps: {core.scheduler.running}")


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def test_single_request_generates_max_tokens():
    core, _ = make_core()
    add(core, "a", prompt_of(10), max_tokens=5)
    out = run_to_completion(core)["a"]
    assert out.new_token_ids == expected_tokens(prompt_of(10), 5)
    assert out.finish_reason == m.FinishReason.LENGTH
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_unset_max_tokens_runs_to_max_model_len():
    core, _ = make_core(max_model_len=32)
    add(core, "a", prompt_of(10), max_tokens=None)
    out = run_to_completion(core)["a"]
    assert len(out.new_token_ids) == 22  # max_model_len - prompt, not a hidden constant
    assert out.finish_reason == m.FinishReason.LENGTH


def test_stop_token_ends_request():
    core, executor = make_core()
    executor.forced_tokens["a"] = [7, 8, EOS, 9]
    add(core, "a", prompt_of(5), max_tokens=10)
    out = run_to_completion(core)["a"]
    assert out.new_token_ids == [7, 8, EOS]
    assert out.finish_reason == m.FinishReason.STOP


def test_chunked_prefill_interleaves_with_decodes():
    core, executor = make_core(max_num_batched_tokens=8, num_blocks=128, max_model_len=256)
    add(core, "short", prompt_of(4, 1), max_tokens=20)
    ((_, first),) = core.step()[0]  # "short" prefilled, now decoding
    add(core, "long", prompt_of(40, 2), max_tokens=3)
    steps_before = len(executor.steps)
    out = run_to_completion(core)
    out["short"].new_token_ids[:0] = first.new_token_ids
    chunked_steps = [s for s in executor.steps[steps_before:] if "long" in s.num_scheduled_tokens][
        :5
    ]
    # every step carries the decode of "short" next to a prefill chunk of "long"
    for step in chunked_steps:
        assert step.num_scheduled_tokens.get("short") == 1
        assert step.num_scheduled_tokens["long"] == 7
    assert out["long"].new_token_ids == expected_tokens(prompt_of(40, 2), 3)
    assert out["short"].new_token_ids == expected_tokens(prompt_of(4, 1), 20)


def test_block_ids_and_free_queue_order():
    core, executor = make_core(num_blocks=8, block_size=4, caching=False)
    add(core, "a", prompt_of(6), max_tokens=1)  # needs 2 blocks
    add(core, "b", prompt_of(3, 1), max_tokens=1)  # needs 1 block
    core.step()
    first = executor.steps[0].new_requests
    assert [r.block_ids for r in first] == [[1, 2], [3]]  # block 0 is the null block
    run_to_completion(core)
    # freed tail-first: a's [2, 1], then b's [3], after the never-used 4..7
    assert core.scheduler.kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 1, 3]


def test_prefix_hit_reuses_blocks_and_gives_identical_output():
    shared = prompt_of(16, 5)
    core, executor = make_core()
    add(core, "first", shared + [11, 12], max_tokens=4)
    first = run_to_completion(core)["first"]
    add(core, "second", shared + [11, 12], max_tokens=4)
    second = run_to_completion(core)["second"]
    assert second.new_token_ids == first.new_token_ids
    assert second.num_cached_tokens == 16  # four full blocks of the 18-token prompt
    new = [r for s in executor.steps for r in s.new_requests if r.request_id == "second"][0]
    assert new.num_computed_tokens == 16
    stats = core.utility("get_stats", [])
    assert stats["prefix_cache_hits_total"] == 16
    assert stats["prefix_cache_queries_total"] == 36


def test_get_stats_splits_steps_into_prompt_and_decode_steps():
    core, executor = make_core(max_num_batched_tokens=8, long_prefill_token_threshold=0)
    add(core, "a", prompt_of(18, 3), max_tokens=4)
    run_to_completion(core)
    stats = core.utility("get_stats", [])
    # 18 prompt tokens in chunks of at most 8: three steps with prompt tokens (the last
    # samples the first output token), then three decode steps of one token each
    assert (stats["prefill_steps_total"], stats["prefill_tokens_total"]) == (3, 18)
    assert (stats["decode_steps_total"], stats["decode_tokens_total"]) == (3, 3)
    assert stats["prefill_seconds_total"] >= 0.0 and stats["decode_seconds_total"] >= 0.0
    computed = [s for s in executor.steps if sum(s.num_scheduled_tokens.values())]
    assert stats["prefill_steps_total"] + stats["decode_steps_total"] == len(computed)


def test_cache_salt_isolates_prefixes():
    shared = prompt_of(16, 5)
    core, _ = make_core()
    core.add_request(
        b"c", m.AddRequest("a", shared, m.SamplingParams(max_tokens=1), cache_salt="x")
    )
    run_to_completion(core)
    core.add_request(
        b"c", m.AddRequest("b", shared, m.SamplingParams(max_tokens=1), cache_salt="y")
    )
    assert run_to_completion(core)["b"].num_cached_tokens == 0
    core.add_request(
        b"c", m.AddRequest("c", shared, m.SamplingParams(max_tokens=1), cache_salt="x")
    )
    assert run_to_completion(core)["c"].num_cached_tokens == 12


def test_probe_is_pure_and_failed_admission_publishes_nothing():
    # Pool of 6 usable blocks (24 tokens); "hog" takes 5 of them.
    core, executor = make_core(num_blocks=7, block_size=4, max_model_len=24)
    add(core, "hog", prompt_of(17, 9), max_tokens=3)
    core.step()
    probe = prompt_of(12, 3)
    add(core, "waiter", probe, max_tokens=1)
    kv = core.scheduler.kv
    waiter = core.scheduler.requests["waiter"]
    for _ in range(3):
        assert kv.num_matched_prefix_tokens(waiter) == 0
    core.step()  # waiter cannot be admitted (needs 3 blocks, 1 free): it waits
    assert waiter in core.scheduler.waiting
    assert kv.stats.queries == 0 and core.counters.prefix_queries == 17  # not admitted yet
    assert len(kv.pool.cached_blocks) == 4  # only hog's computed full blocks
    run_to_completion(core)
    # The identical request matches only KV that a forward pass wrote (the fake executor
    # asserts every read) and gives the no-cache output.
    add(core, "again", probe, max_tokens=1)
    out = run_to_completion(core)["again"]
    assert out.new_token_ids == expected_tokens(probe, 1)


def test_waiting_request_counted_once_at_admission():
    core, _ = make_core(num_blocks=7, block_size=4, max_model_len=24)
    add(core, "hog", prompt_of(17, 9), max_tokens=5)
    core.step()
    add(core, "waiter", prompt_of(12, 3), max_tokens=1)
    for _ in range(3):
        core.step()
        assert core.scheduler.requests["waiter"] in core.scheduler.waiting
    assert core.counters.prefix_queries == 17  # failed attempts count nothing
    run_to_completion(core)
    assert core.counters.prefix_queries == 17 + 12  # its admission, once


def test_preemption_gives_same_outputs_as_unconstrained_run():
    prompts = {f"r{i}": prompt_of(6 + 3 * i, i) for i in range(6)}
    big, _ = make_core(num_blocks=256, max_model_len=64)
    small, _ = make_core(num_blocks=10, max_model_len=36)  # 9 usable blocks = 36 tokens
    for core in (big, small):
        for rid, prompt in prompts.items():
            add(core, rid, prompt, max_tokens=12)
    expected = run_to_completion(big)
    got = run_to_completion(small)
    assert small.scheduler.num_preemptions_total > 0
    for rid in prompts:
        assert got[rid].new_token_ids == expected[rid].new_token_ids, rid
    pool = small.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_priority_policy_admits_and_keeps_the_highest_priority():
    # 6 usable blocks of 4; each request grows to 16 tokens = 4 blocks, so one of the two
    # must be preempted. fcfs would admit "low" first and preempt the newest, "high".
    core, executor = make_core(num_blocks=7, max_model_len=24, policy="priority")
    params = m.SamplingParams(temperature=0.0, max_tokens=8)
    core.add_request(b"c", m.AddRequest("low", prompt_of(8, 1), params, priority=5))
    core.add_request(b"c", m.AddRequest("high", prompt_of(8, 2), params, priority=0))
    low, high = core.scheduler.requests["low"], core.scheduler.requests["high"]
    out = run_to_completion(core)
    assert [r.request_id for r in executor.steps[0].new_requests] == ["high", "low"]
    assert high.num_preemptions == 0 and low.num_preemptions >= 1
    assert out["high"].new_token_ids == expected_tokens(prompt_of(8, 2), 8)
    assert out["low"].new_token_ids == expected_tokens(prompt_of(8, 1), 8)


def test_lpm_policy_prefers_longest_cached_prefix():
    shared = prompt_of(16, 4)
    core, executor = make_core(max_num_seqs=1, policy="lpm")
    add(core, "warm", shared + [5], max_tokens=1)
    run_to_completion(core)
    add(core, "cold", prompt_of(17, 8), max_tokens=1)
    add(core, "hit", shared + [6], max_tokens=1)
    core.step()
    assert [r.request_id for r in executor.steps[-1].new_requests] == ["hit"]


def test_reserve_full_sequence_admits_only_what_fits_whole():
    core, executor = make_core(num_blocks=9, max_model_len=32, reserve_full_sequence=True)
    add(core, "a", prompt_of(8, 1), max_tokens=16)  # 24 tokens = 6 blocks reserved
    add(core, "b", prompt_of(8, 2), max_tokens=16)
    core.step()
    assert list(executor.steps[0].num_scheduled_tokens) == ["a"]
    out = run_to_completion(core)
    assert core.scheduler.num_preemptions_total == 0
    assert len(out["b"].new_token_ids) == 16


def test_abort_frees_blocks_and_leaves_no_state():
    core, executor = make_core()
    for i in range(6):
        add(core, f"r{i}", prompt_of(9, i), max_tokens=30)
    for _ in range(3):
        core.step()
    aborted = core.abort(["r1", "r4", "nope"], b"client")
    assert {o.request_id for _, o in aborted} == {"r1", "r4"}
    assert all(o.finish_reason == m.FinishReason.ABORT for _, o in aborted)
    core.step()
    assert "r1" in executor.steps[-1].finished_request_ids
    run_to_completion(core)
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert core.scheduler.requests == {} and executor.states == {}
    assert len(core.progress) == 0


def test_fail_all_ends_everything_as_retryable_and_frees_the_pool():
    core, _ = make_core()
    for i in range(3):
        add(core, f"r{i}", prompt_of(9, i), max_tokens=30)
    core.step()
    failed = core.fail_all("the workers are gone")
    assert {o.request_id for _, o in failed} == {"r0", "r1", "r2"}
    for _, output in failed:
        assert output.finish_reason == m.FinishReason.ERROR
        assert output.error == "the workers are gone"
        assert output.error_code == m.ErrorCode.UNAVAILABLE  # HTTP 503: retry elsewhere
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and core.scheduler.requests == {}


def test_abort_ignores_other_clients_requests():
    core, _ = make_core()
    add(core, "mine", prompt_of(5), max_tokens=3)
    assert core.abort(["mine"], b"someone-else") == []
    assert "mine" in core.scheduler.requests


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        ([], m.SamplingParams(), "prompt is empty"),
        ([5, VOCAB + 3], m.SamplingParams(), "outside the vocabulary"),
        (
            list(range(3, 131)),
            m.SamplingParams(),
            "prompt has 128 tokens, but max_model_len is 128",
        ),
        (
            list(range(3, 103)),
            m.SamplingParams(max_tokens=50),
            "prompt has 100 tokens and max_tokens is 50",
        ),
        ([5], m.SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        ([5], m.SamplingParams(temperature=float("nan")), "temperature must be in [0, 2]"),
    ],
)
def test_engine_refuses_bad_requests_and_keeps_serving(prompt, params, needle):
    core, _ = make_core()
    add(core, "ok", prompt_of(5), max_tokens=4)
    refused = core.add_request(b"client", m.AddRequest("bad", prompt, params))
    assert len(refused) == 1
    out = refused[0][1]
    assert out.finish_reason == m.FinishReason.ERROR
    assert needle in out.error
    assert len(run_to_completion(core)["ok"].new_token_ids) == 4


def test_tiny_pool_long_prompt_never_hangs():
    # 4 blocks of 4 = 3 usable = 12 tokens; max_model_len fitted to 12 by the start-up guard.
    core, _ = make_core(num_blocks=4, block_size=4, max_model_len=12)
    refused = add(core, "huge", prompt_of(200), max_tokens=None)
    assert refused and "max_model_len is 12" in refused[0][1].error
    add(core, "fits", prompt_of(8), max_tokens=None)
    out = run_to_completion(core, max_steps=100)
    assert len(out["fits"].new_token_ids) == 4


def test_huge_waiter_not_aborted_while_something_runs():
    core, _ = make_core(num_blocks=9, block_size=4, max_model_len=32)
    add(core, "runner", prompt_of(20), max_tokens=10)
    core.step()
    add(core, "big", prompt_of(28, 1), max_tokens=4)
    for _ in range(3):
        outputs, _ = core.step()
        assert all(o.request_id != "big" for _, o in outputs)
    assert core.scheduler.requests["big"] in core.scheduler.waiting
    out = run_to_completion(core)
    assert len(out["big"].new_token_ids) == 4  # admitted once the runner freed its blocks


def test_stats_attached_each_step_with_deltas():
    core, _ = make_core()
    add(core, "a", prompt_of(9), max_tokens=2)
    _, stats = core.step()
    assert stats.num_running == 1 and stats.prefix_cache_queries == 9
    _, stats = core.step()
    assert stats.prefix_cache_queries == 0  # a delta, not counted again


def test_reset_prefix_cache_refuses_while_in_use():
    core, _ = make_core()
    add(core, "a", prompt_of(9), max_tokens=20)
    core.step()
    with pytest.raises(ValueError, match="in use"):
        core.utility("reset_prefix_cache", [])
    run_to_completion(core)
    assert core.utility("reset_prefix_cache", []) is True
    assert core.scheduler.kv.pool.cached_blocks == {}


def test_first_token_output_carries_engine_timings():
    core, _ = make_core()
    add(core, "a", prompt_of(9), max_tokens=3)
    ((_, first),) = core.step()[0]
    assert first.queue_time_s is not None and first.queue_time_s >= 0.0
    assert first.prefill_time_s is not None and first.prefill_time_s >= 0.0
    ((_, second),) = core.step()[0]
    assert second.queue_time_s is None and second.prefill_time_s is None
