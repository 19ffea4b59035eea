"""Per-request state the worker keeps between steps, and the step's batch built from it.

``RequestStates.update`` applies a ``SchedulerOutput``'s deltas exactly as
``protocol/messages.py`` documents them; ``build_step`` turns the scheduled work into
flat host arrays. Step order of requests is the order of ``num_scheduled_tokens``
(msgpack keeps map order, so every rank sees the same order)::

    request:      A (prefill chunk, 4 tokens)   B (decode)   C (decode)
    input_ids:    a4 a5 a6 a7                   b9           c3
    positions:    4  5  6  7                    9            3
    query_lens:   4                             1            1
    seq_lens:     8                             10           4
    samples:      only if 8 == len(A's tokens)  yes          yes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vtllm.protocol.messages import SamplingParams, SchedulerOutput


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + every output token the engine has told us about
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None  # the request's own generator when it has a seed


@dataclass
class StepBatch:
    """One step's work on the host: flat token arrays plus per-request rows."""

    request_ids: list[str]  # every computed request, step order
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    query_lens: list[int]  # per request
    seq_lens: list[int]  # per request: computed tokens after this step
    block_tables: list[list[int]]  # per request
    sample_rows: list[int]  # indices into request_ids of requests that sample
    logits_indices: np.ndarray  # [num_sampling] flat index of each sampler's last token
    errors: dict[str, str] = field(default_factory=dict)  # request id → why skipped

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class RequestStates:
    """Every request the worker currently holds, keyed by request id."""

    def __init__(self, make_generator: Callable[[SamplingParams, int], torch.Generator | None]):
        """``make_generator(params, num_output_tokens)`` builds a seeded request's
        generator (already advanced past the outputs it has), or None."""
        self._states: dict[str, RequestState] = {}
        self._make_generator = make_generator

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def update(self, step: SchedulerOutput) -> dict[str, str]:
        """Apply one step's deltas. Returns per-request errors (unknown ids)."""
        errors: dict[str, str] = {}
        for request_id in step.finished_request_ids:
            self._states.pop(request_id, None)
        for new in step.new_requests:
            num_outputs = len(new.token_ids) - new.num_prompt_tokens
            self._states[new.request_id] = RequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=self._make_generator(new.sampling_params, num_outputs),
            )
        for cached in step.cached_requests:
            state = self._states.get(cached.request_id)
            if state is None:
                errors[cached.request_id] = "worker holds no state for this request"
                continue
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        return errors

    def build_step(self, step: SchedulerOutput, block_size: int) -> StepBatch:
        """Flat inputs for ``step``; a request whose numbers do not add up is left out
        and reported in ``errors``. Advances no state: the engine sends
        ``num_computed_tokens`` with every step."""
        request_ids: list[str] = []
        input_chunks: list[list[int]] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        errors: dict[str, str] = {}
        for request_id, num_scheduled in step.num_scheduled_tokens.items():
            state = self._states.get(request_id)
            problem = _check(state, num_scheduled, block_size)
            if problem is not None:
                errors[request_id] = problem
                continue
            assert state is not None
            start = state.num_computed_tokens
            end = start + num_scheduled
            if end == len(state.token_ids):
                sample_rows.append(len(request_ids))
            request_ids.append(request_id)
            input_chunks.append(state.token_ids[start:end])
            query_lens.append(num_scheduled)
            seq_lens.append(end)
            block_tables.append(state.block_ids)
        input_ids = np.fromiter(
            (t for chunk in input_chunks for t in chunk), dtype=np.int64, count=sum(query_lens)
        )
        positions = np.concatenate(
            [np.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
            or [np.zeros(0, dtype=np.int64)]
        ).astype(np.int64)
        last_token = np.cumsum(query_lens, dtype=np.int64) - 1
        return StepBatch(
            request_ids=request_ids,
            input_ids=input_ids,
            positions=positions,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables,
            sample_rows=sample_rows,
            logits_indices=last_token[sample_rows] if sample_rows else np.zeros(0, np.int64),
            errors=errors,
        )

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)


def _check(state: RequestState | None, num_scheduled: int, block_size: int) -> str | None:
    if state is None:
        return "scheduled but the worker holds no state for it"
    end = state.num_computed_tokens + num_scheduled
    if num_scheduled < 1 or end > len(state.token_ids):
        return (
            f"scheduled {num_scheduled} tokens from {state.num_computed_tokens}, but only "
            f"{len(state.token_ids)} tokens are known"
        )
    if len(state.block_ids) * block_size < end:
        return f"{len(state.block_ids)} blocks of {block_size} cannot hold {end} tokens"
    return None
