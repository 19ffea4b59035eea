"""An executor for engine-core tests: keeps per-request state from SchedulerOutput deltas
exactly as a worker must, checks every delta against its own bookkeeping, and "samples"
a token that is a pure function of the request's whole token sequence — so outputs are
the same whatever the batching, chunking, prefix hits or preemptions.

Grammars as the driver worker holds them: ``compile_grammar`` starts a "compile" (one
whose spec text is ``UNCOMPILABLE`` fails), answered by ``take_grammar_results`` at once
(``auto_compile``) or when a test calls ``finish_compile``; a request with a structured
output must not reach a step before its compile was answered, and must be released once
it ends (``grammar_held``).

Async scheduling as a worker must serve it: ``submit`` runs a step at once and ``collect``
hands back the oldest result. A token the fake sampled stays *unconfirmed* until the
engine sends it back in ``new_token_ids``; a step may compute the position after the
known tokens only with the token sampled by the step just before (what the real worker
feeds from the device), and only right after that step. A request that failed (error or
dropped token) in the step before may still be scheduled once more: it gets an error."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vtllm.protocol import messages as m

UNCOMPILABLE = "uncompilable"


def next_token(token_ids: list[int], vocab_size: int) -> int:
    h = 17
    for t in token_ids:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return 3 + h % (vocab_size - 3)  # never 0..2 (eos-like ids in tests)


@dataclass
class _State:
    token_ids: list[int]  # every token the fake knows: sent by the engine or fed by it
    block_ids: list[int]
    num_computed_tokens: int
    num_sent: int = 0  # tokens the engine has sent
    pending: int | None = None  # sampled, neither sent back nor fed yet
    pending_step: int = 0  # the step that sampled ``pending``


@dataclass
class FakeExecutor:
    vocab_size: int = 1000
    block_size: int = 4
    states: dict[str, _State] = field(default_factory=dict)
    # slot → (request id, position) of the KV "written" there; checks reads hit real writes
    kv_slots: dict[int, tuple[int, ...]] = field(default_factory=dict)
    steps: list[m.SchedulerOutput] = field(default_factory=list)
    forced_tokens: dict[str, list[int]] = field(default_factory=dict)
    # requests whose next due token is silently dropped (a faulty worker)
    dropped_tokens: set[str] = field(default_factory=set)
    # request id → the error a worker reports for it in its next scheduled step
    errors: dict[str, str] = field(default_factory=dict)
    auto_compile: bool = True
    compiling: dict[str, tuple[int, m.StructuredOutputSpec]] = field(default_factory=dict)
    grammar_held: set[str] = field(default_factory=set)  # asked to compile, not released
    grammar_ok: set[str] = field(default_factory=set)  # answered as compiled
    grammar_answers: list[m.GrammarReady] = field(default_factory=list)
    num_grammar_messages: int = 0
    results: deque = field(default_factory=deque)  # submitted, not collected
    failed: dict[str, int] = field(default_factory=dict)  # request id → step it failed in
    num_placeholder_inputs: int = 0  # positions computed from an unconfirmed token
    last_step_id: int = 0
    # the "model": (a request's known tokens, vocab size) → its next token; the default
    # hashes the whole sequence (O(length): schedule simulations pass a cheaper one)
    sample: Callable[[list[int], int], int] = next_token

    def submit(self, step: m.SchedulerOutput) -> None:
        self.results.append(self.execute(step))

    def collect(self) -> m.ModelRunnerOutput:
        return self.results.popleft()

    def compile_grammar(self, request_id: str, seq: int, spec: m.StructuredOutputSpec) -> None:
        self.num_grammar_messages += 1
        assert request_id not in self.grammar_held, f"{request_id} compiled twice"
        self.compiling[request_id] = (seq, spec)
        self.grammar_held.add(request_id)

    def release_grammars(self, request_ids: list[str]) -> None:
        self.num_grammar_messages += 1
        for request_id in request_ids:
            assert request_id in self.grammar_held, f"{request_id} released, never compiled"
            self.grammar_held.discard(request_id)
            self.grammar_ok.discard(request_id)
            self.compiling.pop(request_id, None)

    def finish_compile(self, request_id: str) -> None:
        seq, spec = self.compiling.pop(request_id)
        error = None
        if spec.spec == UNCOMPILABLE:
            error = "invalid grammar: the fake compiler refuses this one"
        else:
            self.grammar_ok.add(request_id)
        self.grammar_answers.append(m.GrammarReady(request_id, seq, error))

    def take_grammar_results(self, wait_s: float = 0.0) -> list[m.GrammarReady]:
        if self.auto_compile:
            for request_id in list(self.compiling):
                self.finish_compile(request_id)
        answers, self.grammar_answers = self.grammar_answers, []
        return answers

    def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        self.steps.append(step)
        previous_step_id, self.last_step_id = self.last_step_id, step.step_id
        for request_id in step.finished_request_ids:
            self.states.pop(request_id, None)
            self.failed.pop(request_id, None)
        for new in step.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} sent twice"
            if new.sampling_params.structured_output is not None:
                assert new.request_id in self.grammar_ok, f"{new.request_id}: no grammar yet"
            self.failed.pop(new.request_id, None)
            self.states[new.request_id] = _State(
                list(new.token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                len(new.token_ids),
            )
        request_ids, sampled, errors = [], [], {}
        for cached in step.cached_requests:
            state = self.states.get(cached.request_id)
            if state is None:  # failed in the step before, scheduled again meanwhile
                assert self.failed.get(cached.request_id) == previous_step_id, cached
                errors[cached.request_id] = "the fake worker holds no state for it"
                continue
            for token in cached.new_token_ids:
                if state.num_sent < len(state.token_ids):  # fed already: must agree
                    assert state.token_ids[state.num_sent] == token, (cached, state)
                else:
                    assert state.pending in (None, token), (cached, state)
                    state.token_ids.append(token)
                    state.pending = None
                state.num_sent += 1
            state.block_ids.extend(cached.new_block_ids)
            assert state.num_computed_tokens == cached.num_computed_tokens, cached
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            if request_id in errors:
                continue
            if request_id in self.errors:
                errors[request_id] = self.errors.pop(request_id)
                del self.states[request_id]  # as a worker drops a failed request
                self.failed[request_id] = step.step_id
                continue
            state = self.states[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            if end == len(state.token_ids) + 1 and self.failed.get(request_id) == previous_step_id:
                errors[request_id] = "its token of the step before was dropped"
                continue
            if end > len(state.token_ids):
                # the position after the known tokens: fed from the step just before
                assert end == len(state.token_ids) + 1, (request_id, end, state)
                assert state.pending is not None, (request_id, state)
                assert state.pending_step == previous_step_id, (request_id, state)
                state.token_ids.append(state.pending)
                state.pending = None
                self.num_placeholder_inputs += 1
            assert len(state.block_ids) * self.block_size >= end, "not enough blocks"
            # Reads of the cached prefix must find KV that was really written for the same
            # tokens; then write this chunk's KV.
            for pos in range(start):
                slot = (
                    state.block_ids[pos // self.block_size] * self.block_size
                    + pos % self.block_size
                )
                assert self.kv_slots.get(slot) == tuple(state.token_ids[: pos + 1]), (
                    f"{request_id} reads never-computed KV at position {pos}"
                )
            for pos in range(start, end):
                slot = (
                    state.block_ids[pos // self.block_size] * self.block_size
                    + pos % self.block_size
                )
                self.kv_slots[slot] = tuple(state.token_ids[: pos + 1])
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                if request_id in self.dropped_tokens:
                    self.dropped_tokens.discard(request_id)
                    self.failed[request_id] = step.step_id
                    continue
                forced = self.forced_tokens.get(request_id)
                token = forced.pop(0) if forced else self.sample(state.token_ids, self.vocab_size)
                state.pending, state.pending_step = token, step.step_id
                request_ids.append(request_id)
                sampled.append(token)
        return m.ModelRunnerOutput(
            step_id=step.step_id, request_ids=request_ids, sampled_token_ids=sampled, errors=errors
        )
