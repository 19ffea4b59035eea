"""Property tests: the block pool, the KV-cache manager and the scheduler keep their
invariants under random workloads (hypothesis state machines).

Checked after every rule:

- each block's ref count equals the number of live holders (requests, or the test's
  owners for the bare pool); the null block's is 1;
- a block is in the free queue exactly when its ref count is 0 (so never free and in use
  at once), and the queue's count matches its length;
- every matchable hash names KV that a forward pass wrote: each slot of its block holds
  the KV of exactly the token prefix the hash stands for (the fake executor records what
  every scheduled step wrote, and itself asserts every read);
- only running requests hold blocks, enough for their computed tokens;

- with async scheduling: at most one step in flight between calls, and each live request
  counts exactly one output placeholder per step in flight that is due its token (the
  fake executor asserts that a fed position takes the token of the step just before);

and when every request has ended: every block is back in the free pool, nothing is left
in the scheduler or the workers, and every request that was not aborted produced exactly
the tokens of an unconstrained run (chunking, prefix hits and preemption change nothing).

Structured outputs: requests with a grammar wait unscheduled until the fake driver
answers their compile (at random moments, or never before an abort); the fake executor
asserts none reaches a step before its answer, and every ended one is released, so the
workers hold grammars exactly for live requests; one whose compile fails ends as
INVALID_REQUEST without a token.

Workloads: fcfs / priority / lpm, small pools (preemption), small budgets (chunking),
shared prefixes (prefix hits), cache salts, aborts at random moments, reserve-full-sequence
on and off, the long-prefill threshold on and off, grammars that compile late or not at
all, async scheduling on and off. Bounded to run in seconds.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from tests.engine_core.fake_executor import UNCOMPILABLE, FakeExecutor, next_token
from vtllm.config import VtllmConfig
from vtllm.engine_core.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from vtllm.engine_core.core import EngineCore, EngineFacts
from vtllm.engine_core.request import RequestStatus
from vtllm.protocol import messages as m

VOCAB = 1000
SETTINGS = settings(
    deadline=None,
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.too_slow],
    # No shrinking: a failure is found in about a second and printed as the whole run
    # (at most ~50 rules), where shrinking it would take up to 5 minutes. Add
    # Phase.shrink here locally for a minimal example.
    phases=[Phase.generate],
)


def check_free_queue(pool: BlockPool, holders: Counter[int]) -> None:
    """Ref counts = holders; free queue ⇔ ref count 0; cached map consistent."""
    assert pool.null_block.ref_cnt == 1
    assert NULL_BLOCK_ID not in holders
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    queue = pool.free_queue.block_ids()
    assert len(queue) == len(set(queue)) == pool.num_free_blocks
    assert set(queue) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash, block


# -- the bare block pool -----------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Owners take new blocks, publish hashes, share cached blocks (prefix hits), free."""

    owners = Bundle("owners")

    @initialize(num_blocks=st.integers(2, 12), caching=st.booleans())
    def make_pool(self, num_blocks: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.held: dict[int, list[KVCacheBlock]] = {}
        self.next_owner = 0

    def _new_owner(self, blocks: list[KVCacheBlock]) -> int:
        self.next_owner += 1
        self.held[self.next_owner] = blocks
        return self.next_owner

    @rule(target=owners, num=st.integers(0, 4))
    def allocate(self, num: int) -> int:
        num = min(num, self.pool.num_free_blocks)
        return self._new_owner(self.pool.get_new_blocks(num))

    @rule(target=owners, data=st.data())
    def hit_cached(self, data: st.DataObject) -> int:
        cached = sorted(self.pool.cached_blocks.values(), key=lambda b: b.block_id)
        chosen = data.draw(st.lists(st.sampled_from(cached), unique=True)) if cached else []
        self.pool.touch(chosen)
        return self._new_owner(chosen)

    @rule(owner=owners, data=st.data(), block_hash=st.binary(min_size=1, max_size=1))
    def publish(self, owner: int, data: st.DataObject, block_hash: bytes) -> None:
        blocks = self.held.get(owner)
        if blocks:
            self.pool.cache_block(data.draw(st.sampled_from(blocks)), block_hash)

    @rule(owner=consumes(owners))
    def free(self, owner: int) -> None:
        self.pool.free_blocks(reversed(self.held.pop(owner, [])))

    @rule()
    def reset_prefix_cache(self) -> None:
        refusal = self.pool.reset_prefix_cache()
        assert (refusal is None) == (self.pool.num_free_blocks == self.pool.num_usable_blocks)
        if refusal is None:
            assert self.pool.cached_blocks == {}

    @invariant()
    def consistent(self) -> None:
        holders = Counter(b.block_id for blocks in self.held.values() for b in blocks)
        check_free_queue(self.pool, holders)

    def teardown(self) -> None:
        for owner in list(self.held):
            self.free(owner)
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(SETTINGS, max_examples=100, stateful_step_count=30)


# -- the scheduler and KV-cache manager through the engine core ------------------------


def expected_tokens(prompt: list[int], num: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num):
        tokens.append(next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


# prefix (one of two shared ones), prefix length, suffix, max_tokens, priority, cache salt,
# grammar (None = free text)
REQUEST = st.tuples(
    st.integers(0, 1),
    st.sampled_from([0, 5, 8, 16, 24]),
    st.lists(st.integers(3, VOCAB - 1), max_size=6),
    st.one_of(st.none(), st.integers(1, 24)),
    st.integers(0, 2),
    st.sampled_from([None, None, None, "s"]),
    st.sampled_from([None, None, None, "root ::= [a-z]+", UNCOMPILABLE]),
)


ENGINE = {
    "policy": st.sampled_from(["fcfs", "priority", "lpm"]),
    "block_size": st.sampled_from([2, 4]),
    "max_model_len": st.integers(8, 40),
    "spare_blocks": st.integers(0, 4),
    "budget": st.integers(1, 48),
    "max_num_seqs": st.sampled_from([1, 2, 3, 4, 6]),
    "caching": st.sampled_from([True, True, False]),
    "reserve": st.sampled_from([False, False, True]),
    "threshold": st.sampled_from([0, 1, 3, 8]),
    "initial": st.lists(REQUEST, min_size=2, max_size=6),  # contention from the start
}
# without grammars (a live one makes async scheduling run steps one at a time)
REQUEST_NO_GRAMMAR = REQUEST.map(lambda spec: (*spec[:-1], None))


class EngineMachine(RuleBasedStateMachine):
    @initialize(**ENGINE, async_scheduling=st.booleans())
    def make_engine(
        self,
        policy: str,
        block_size: int,
        max_model_len: int,
        spare_blocks: int,
        budget: int,
        max_num_seqs: int,
        caching: bool,
        reserve: bool,
        threshold: int,
        initial: list[tuple],
        async_scheduling: bool = False,
    ) -> None:
        config = VtllmConfig()
        config.scheduler.async_scheduling = async_scheduling
        config.cache.block_size = block_size
        config.cache.enable_prefix_caching = caching
        config.scheduler.scheduling_policy = policy
        config.scheduler.max_num_batched_tokens = budget
        config.scheduler.max_num_seqs = max_num_seqs
        config.scheduler.reserve_full_sequence = reserve
        config.scheduler.long_prefill_token_threshold = threshold
        # The start-up guard's promise: the pool holds one max_model_len sequence.
        num_blocks = -(-max_model_len // block_size) + 1 + spare_blocks
        facts = EngineFacts("prop", max_model_len, VOCAB, num_blocks, block_size, (2,))
        self.executor = FakeExecutor(vocab_size=VOCAB, block_size=block_size, auto_compile=False)
        self.core = EngineCore(config, facts, self.executor)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.prefixes = [[3 + i] * 12 + [10 + i] * 12 for i in range(2)]
        self.prompts: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, m.FinishReason] = {}
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}
        self.dropped: set[str] = set()  # requests a faulty worker dropped a token of
        self.grammars: dict[str, str] = {}  # request id → its grammar, if any
        self.num_added = 0
        for spec in initial:
            self.add(spec)

    # -- rules ---------------------------------------------------------------------

    @rule(spec=REQUEST)
    def add(self, spec: tuple) -> None:
        prefix, prefix_len, suffix, max_tokens, priority, salt, grammar = spec
        prompt = (self.prefixes[prefix][:prefix_len] + suffix)[: self.max_model_len - 1]
        if not prompt:
            prompt = [7]
        room = self.max_model_len - len(prompt)
        max_tokens = None if max_tokens is None else min(max_tokens, room)
        self.num_added += 1
        request_id = f"r{self.num_added}"
        structured = None
        if grammar is not None:
            structured = m.StructuredOutputSpec(m.StructuredOutputKind.GRAMMAR, grammar)
            self.grammars[request_id] = grammar
        params = m.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, structured_output=structured
        )
        add = m.AddRequest(request_id, prompt, params, priority=priority, cache_salt=salt)
        assert self.core.add_request(b"c", add) == []  # always valid by construction
        self.prompts[request_id] = prompt
        self.max_tokens[request_id] = room if max_tokens is None else max_tokens
        self.tokens[request_id] = []

    @rule(num_steps=st.integers(1, 8))
    def step(self, num_steps: int = 1) -> None:
        for _ in range(num_steps):
            self._record_hashes()
            outputs, _ = self.core.step()  # nothing to do: no step, no outputs
            self._collect(outputs)

    @rule(data=st.data())
    def finish_compiles(self, data: st.DataObject) -> None:
        """The driver answers some of the compiles in flight (the next step sees them)."""
        compiling = sorted(self.executor.compiling)
        if compiling:
            for request_id in data.draw(st.lists(st.sampled_from(compiling), unique=True)):
                self.executor.finish_compile(request_id)

    @rule(data=st.data(), drop_token=st.booleans())
    def disrupt(self, data: st.DataObject, drop_token: bool) -> None:
        """Abort a live request, or make a faulty worker drop its next due token."""
        if not self.core.scheduler.requests:
            return
        request_id = data.draw(st.sampled_from(sorted(self.core.scheduler.requests)))
        if drop_token:
            self.executor.dropped_tokens.add(request_id)
            self.dropped.add(request_id)
            return
        if self.core.scheduler.requests[request_id].awaiting_grammar:
            event("aborted while its grammar compiled")
        outputs = self.core.abort([request_id], b"c")
        assert [o.finish_reason for _, o in outputs] == [m.FinishReason.ABORT]
        self._collect(outputs)

    def _collect(self, outputs) -> None:
        for _, out in outputs:
            assert out.request_id not in self.finished, f"{out.request_id} output after finish"
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                if out.finish_reason == m.FinishReason.ERROR and "compile" in out.error:
                    assert self.grammars.get(out.request_id) == UNCOMPILABLE, out.error
                    assert out.error_code == m.ErrorCode.INVALID_REQUEST
                    assert self.tokens[out.request_id] == []
                elif out.finish_reason == m.FinishReason.ERROR:
                    assert out.request_id in self.dropped, out.error
                    assert "returned no token for this request" in out.error
                self.finished[out.request_id] = out.finish_reason

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def blocks_and_requests_consistent(self) -> None:
        scheduler = self.core.scheduler
        kv = scheduler.kv
        running = {r.request_id for r in scheduler.running}
        waiting = {r.request_id for r in scheduler.waiting}
        assert not running & waiting
        assert running | waiting == set(scheduler.requests)
        assert len(running) <= scheduler.config.max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)
        assert all(
            r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting
        )
        assert set(kv.req_to_blocks) == running  # waiting requests hold nothing
        # the per-client count (--max-requests-per-client) follows every finish path
        assert self.core.num_unfinished(b"c") == len(scheduler.requests)
        for request in scheduler.running:
            assert len(kv.req_to_blocks[request.request_id]) * self.block_size >= (
                request.num_computed_tokens
            )
        holders = Counter(b.block_id for bs in kv.req_to_blocks.values() for b in bs)
        check_free_queue(kv.pool, holders)
        # the workers hold state only for live requests or ones they are about to drop
        pending_drop = set(scheduler._finished_for_workers)
        assert set(self.executor.states) <= set(scheduler.requests) | pending_drop
        # grammars: held on the driver exactly for live requests that have one; only
        # waiting requests may still wait for theirs, and the count follows them
        with_grammar = {r for r in scheduler.requests if r in self.grammars}
        assert self.executor.grammar_held == with_grammar
        awaiting = [r for r in scheduler.waiting if r.awaiting_grammar]
        assert scheduler.num_awaiting_grammar == len(awaiting)
        assert not any(r.awaiting_grammar for r in scheduler.running)
        assert set(self.core._awaiting_grammars) == {r.request_id for r in awaiting}
        # output placeholders: one per step in flight that is due a token of the request
        in_flight = self.core._in_flight
        assert len(in_flight) <= (1 if self.core.async_scheduling else 0)
        for request in scheduler.requests.values():
            due = sum(
                1
                for step, _submitted_at in in_flight
                if step.requests.get(request.request_id) is request
                and request.request_id in step.due_token_ids
            )
            assert request.num_output_placeholders == due, request

    def _record_hashes(self) -> None:
        """Remember which tokens each hash stands for (every hash a step can publish
        belongs to a request that was live after the previous step)."""
        for request in self.core.scheduler.requests.values():
            for i, block_hash in enumerate(request.block_hashes):
                self.hash_tokens[block_hash] = tuple(
                    request.all_token_ids[: (i + 1) * self.block_size]
                )

    @invariant()
    def hashes_name_written_kv(self) -> None:
        self._record_hashes()
        slots = self.executor.kv_slots
        for block_hash, block in self.core.scheduler.kv.pool.cached_blocks.items():
            tokens = self.hash_tokens[block_hash]
            first = (len(tokens) // self.block_size - 1) * self.block_size
            for offset in range(self.block_size):
                slot = block.block_id * self.block_size + offset
                assert slots.get(slot) == tokens[: first + offset + 1], (block, offset)

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        self.executor.auto_compile = True  # every compile answered from now on
        # Generous: every token of every request computed four times over, one per step.
        max_steps = 100 + 4 * sum(len(p) + self.max_tokens[r] for r, p in self.prompts.items())
        for _ in range(max_steps):
            if not self.core.has_work():
                break
            self.step()
            self.blocks_and_requests_consistent()
            self.hashes_name_written_kv()
        assert not self.core.has_work(), f"work left after {max_steps} steps"
        # what the workload exercised (pytest --hypothesis-show-statistics)
        scheduler = self.core.scheduler
        event(f"preempted: {scheduler.num_preemptions_total > 0}")
        event(f"prefix hits: {self.core.counters.prefix_hits > 0}")
        event(f"aborted: {m.FinishReason.ABORT in self.finished.values()}")
        event(f"dropped token ended one: {m.FinishReason.ERROR in self.finished.values()}")
        chunked = any(
            0 < n < len(self.prompts[rid])
            for step in self.executor.steps
            for rid, n in step.num_scheduled_tokens.items()
            if any(r.request_id == rid for r in step.new_requests)
        )
        event(f"chunked prefill: {chunked}")
        event(f"grammar failed: {any(g == UNCOMPILABLE for g in self.grammars.values())}")
        event(f"async, token fed from the step before: {self.executor.num_placeholder_inputs > 0}")
        pool = self.core.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert self.core.scheduler.requests == {} and self.executor.states == {}
        assert self.executor.grammar_held == set() and self.core._awaiting_grammars == {}
        assert len(self.core.progress) == 0
        for request_id, prompt in self.prompts.items():
            tokens = self.tokens[request_id]
            # the drop came before any other end (async: unless the step in flight at the
            # disruption already sampled the request's last token; then it never applied)
            if request_id in self.dropped and request_id not in self.executor.dropped_tokens:
                assert self.finished[request_id] in (m.FinishReason.ERROR, m.FinishReason.ABORT)
            if self.grammars.get(request_id) == UNCOMPILABLE:  # ended before any step
                assert self.finished[request_id] in (m.FinishReason.ERROR, m.FinishReason.ABORT)
            if self.finished[request_id] != m.FinishReason.LENGTH:
                assert tokens == expected_tokens(prompt, len(tokens)), request_id
            else:
                assert tokens == expected_tokens(prompt, self.max_tokens[request_id]), request_id


TestEngine = EngineMachine.TestCase
TestEngine.settings = settings(SETTINGS, max_examples=100, stateful_step_count=40)


class AsyncEngineMachine(EngineMachine):
    """Async scheduling throughout: no grammars, so steps overlap whenever they can."""

    @initialize(
        **{**ENGINE, "initial": st.lists(REQUEST_NO_GRAMMAR, min_size=2, max_size=6)},
        async_scheduling=st.just(True),
    )
    def make_engine(self, **kwargs) -> None:
        super().make_engine(**kwargs)

    @rule(spec=REQUEST_NO_GRAMMAR)
    def add(self, spec: tuple) -> None:
        super().add(spec)


TestAsyncEngine = AsyncEngineMachine.TestCase
TestAsyncEngine.settings = settings(SETTINGS, max_examples=100, stateful_step_count=40)
