"""An executor for engine-core tests: keeps per-request state from SchedulerOutput deltas
exactly as a worker must, checks every delta against its own bookkeeping, and "samples"
a token that is a pure function of the request's whole token sequence — so outputs are
the same whatever the batching, chunking, prefix hits or preemptions."""

from __future__ import annotations

from dataclasses import dataclass, field

from vtllm.protocol import messages as m


def next_token(token_ids: list[int], vocab_size: int) -> int:
    h = 17
    for t in token_ids:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return 3 + h % (vocab_size - 3)  # never 0..2 (eos-like ids in tests)


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


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

    def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        self.steps.append(step)
        for request_id in step.finished_request_ids:
            self.states.pop(request_id, None)
        for new in step.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} sent twice"
            self.states[new.request_id] = _State(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in step.cached_requests:
            state = self.states[cached.request_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            assert state.num_computed_tokens == cached.num_computed_tokens, cached
        request_ids, sampled, errors = [], [], {}
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            if request_id in self.errors:
                errors[request_id] = self.errors.pop(request_id)
                continue
            state = self.states[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            assert end <= len(state.token_ids), (request_id, end, len(state.token_ids))
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
                    continue
                forced = self.forced_tokens.get(request_id)
                token = forced.pop(0) if forced else next_token(state.token_ids, self.vocab_size)
                request_ids.append(request_id)
                sampled.append(token)
        return m.ModelRunnerOutput(
            step_id=step.step_id, request_ids=request_ids, sampled_token_ids=sampled, errors=errors
        )
