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

Block tables persist across steps (``block_table.py``): each request owns a row of the
worker's ``BlockTable``, filled once when the request arrives and then grown by the
step's ``new_block_ids``; a step refers to the rows (``StepBatch.table_rows``) and copies
no table. Positions, slot mapping and query offsets are computed from the rows with
numpy, without a loop over requests; the one loop left (over the schedule, to find each
request's row and input tokens) does constant work per request whatever its context.

Async scheduling: the engine core may schedule the position right after a request's known
tokens before it knows the token there, which the step just before sampled. ``build_step``
then takes that request's input from the previous step's sampled ids (``previous_rows``:
request id → its row among them), leaves 0 in ``input_ids`` and records where the device
copy goes (``prev_token_dst`` / ``prev_token_src``); ``model_runner`` fills it on the
device, so no sampled id makes a round trip through the host (under tensor parallelism
rank 0 broadcasts its sampled ids, so every rank holds them)::

    previous step sampled   [b9', c3']                 (rows 0, 1; on the device)
    this step               A prefill a4..a7 | B ? | C ?
    input_ids               a4 a5 a6 a7      0     0
    prev_token_dst          [4, 5]    prev_token_src [0, 1]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vtllm.protocol.messages import PoolingType, SamplingParams, SchedulerOutput
from vtllm.worker.block_table import BlockTable, slot_mapping_of, token_layout


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + every output token the engine has told us about
    num_prompt_tokens: int
    sampling_params: SamplingParams
    table_row: int  # its row of the worker's BlockTable
    num_computed_tokens: int
    generator: torch.Generator | None  # the request's own generator when it has a seed


@dataclass
class StepBatch:
    """One step's work on the host: flat token arrays plus per-request rows.

    Request ``r``'s block table is row ``table_rows[r]`` of ``block_table``: the worker's
    persistent table, not a copy, so it describes this step only (the next
    ``RequestStates.update`` changes it). ``block_tables()`` gathers the rows.
    """

    request_ids: list[str]  # every computed request, step order
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64 KV slot of each token
    query_lens: np.ndarray  # [num_reqs] int64
    seq_lens: np.ndarray  # [num_reqs] int64: computed tokens after this step
    query_start_loc: np.ndarray  # [num_reqs + 1] int32, cumulative query_lens
    table_rows: np.ndarray  # [num_reqs] int64 rows of block_table
    num_blocks: np.ndarray  # [num_reqs] int64 blocks in each request's table
    max_num_blocks: int  # the widest table of the step (0 without requests)
    row_serials: np.ndarray  # [num_reqs] int64 BlockTable.serials of the rows
    block_table: np.ndarray  # [table rows, table width] int32 (0 past each row's blocks)
    sample_rows: list[int]  # indices into request_ids of requests that sample
    logits_indices: np.ndarray  # [num_sampling] flat index of each sampler's last token
    # [num_reqs] bool: the request computes tokens of its prompt (not only decodes)
    prompt_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    errors: dict[str, str] = field(default_factory=dict)  # request id → why skipped
    # [k] int64 flat token indices whose input is the previous step's sampled id, and
    # [k] int64 the row of that id among the previous step's samples (async scheduling)
    prev_token_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prev_token_src: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    @property
    def has_prompt_tokens(self) -> bool:
        """Some request of the step computes tokens of its prompt."""
        return bool(self.prompt_rows.any())

    def subset(self, keep: np.ndarray) -> tuple[StepBatch, np.ndarray]:
        """The step of the requests where ``keep [num_reqs] bool`` holds, as if built
        alone, and the ``[num_tokens of the subset]`` int64 flat indices of its tokens in
        this step. Call after the previous step's ids are fed into ``input_ids``: the
        subset feeds none (its ``prev_token_*`` are empty). Its ``sample_rows`` keep this
        step's order, so ``sample_rows`` of both subsets of a split interleave back."""
        reqs = np.flatnonzero(keep)  # [k] rows kept, in step order
        _, token_reqs, _ = token_layout(self.query_lens, self.seq_lens, self.num_tokens)
        tokens = np.flatnonzero(keep[token_reqs])  # [k tokens]
        query_lens = self.query_lens[reqs]
        query_start_loc, _, _ = token_layout(query_lens, self.seq_lens[reqs], len(tokens))
        new_row = np.cumsum(keep) - 1  # [num_reqs] the kept rows' index in the subset
        sample_rows = [int(new_row[r]) for r in self.sample_rows if keep[r]]
        num_blocks = self.num_blocks[reqs]
        return StepBatch(
            request_ids=[self.request_ids[r] for r in reqs.tolist()],
            input_ids=self.input_ids[tokens],
            positions=self.positions[tokens],
            slot_mapping=self.slot_mapping[tokens],
            query_lens=query_lens,
            seq_lens=self.seq_lens[reqs],
            query_start_loc=query_start_loc,
            table_rows=self.table_rows[reqs],
            num_blocks=num_blocks,
            max_num_blocks=int(num_blocks.max()) if len(reqs) else 0,
            row_serials=self.row_serials[reqs],
            block_table=self.block_table,
            sample_rows=sample_rows,
            logits_indices=last_token_indices(query_start_loc, sample_rows),
            prompt_rows=self.prompt_rows[reqs],
        ), tokens

    def block_tables(self) -> np.ndarray:
        """``[num_reqs, max_num_blocks]`` int32: each request's table, 0-padded (one
        vectorised gather)."""
        return self.block_table[self.table_rows, : self.max_num_blocks]


def last_token_indices(query_start_loc: np.ndarray, sample_rows: list[int]) -> np.ndarray:
    """``[len(sample_rows)]`` int64: the flat index of each sampling request's last token
    (``query_start_loc [num_reqs + 1]``)."""
    return query_start_loc[np.array(sample_rows, dtype=np.int64) + 1] - np.int64(1)


_NO_STATE = "scheduled but the worker holds no state for it"


class RequestStates:
    """Every request the worker currently holds, keyed by request id, and their block
    tables (one ``BlockTable`` row each, freed when the request is dropped)."""

    def __init__(self, make_generator: Callable[[SamplingParams, int], torch.Generator | None]):
        """``make_generator(params, num_output_tokens)`` builds a seeded request's
        generator (already advanced past the outputs it has), or None."""
        self._states: dict[str, RequestState] = {}
        self._make_generator = make_generator
        self.block_table = BlockTable()
        self.pooling_ids: set[str] = set()  # the requests that pool (embeddings)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy); KeyError for an unknown id."""
        return self.block_table.block_ids(self._states[request_id].table_row)

    def update(self, step: SchedulerOutput) -> dict[str, str]:
        """Apply one step's deltas. Returns per-request errors (unknown ids)."""
        errors: dict[str, str] = {}
        for request_id in step.finished_request_ids:
            self.drop(request_id)
        for new in step.new_requests:
            self.drop(new.request_id)  # sent anew (a resume): its old state is void
            num_outputs = len(new.token_ids) - new.num_prompt_tokens
            self._states[new.request_id] = RequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                table_row=self.block_table.add(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=self._make_generator(new.sampling_params, num_outputs),
            )
            if new.sampling_params.pooling != PoolingType.NONE:
                self.pooling_ids.add(new.request_id)
        for cached in step.cached_requests:
            state = self._states.get(cached.request_id)
            if state is None:
                errors[cached.request_id] = "worker holds no state for this request"
                continue
            state.token_ids.extend(cached.new_token_ids)
            if cached.new_block_ids:  # most decode steps append none
                self.block_table.append(state.table_row, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        return errors

    def build_step(
        self,
        step: SchedulerOutput,
        block_size: int,
        previous_rows: dict[str, int] | None = None,
    ) -> StepBatch:
        """Flat inputs for ``step``; a request whose numbers do not add up is left out
        and reported in ``errors``. Advances no state: the engine sends
        ``num_computed_tokens`` with every step. ``previous_rows``: the requests the step
        before sampled, by their row among its sampled ids (see the module doc)."""
        errors: dict[str, str] = {}
        while True:
            batch, token_reqs = self._collect(step, errors, previous_rows or {})
            # block tables that cannot hold the step's tokens: rare, checked in one go,
            # then the step is collected again without them
            short = batch.num_blocks * block_size < batch.seq_lens
            if not short.any():
                break
            for r in np.flatnonzero(short).tolist():
                errors[batch.request_ids[r]] = (
                    f"{batch.num_blocks[r]} blocks of {block_size} cannot hold "
                    f"{batch.seq_lens[r]} tokens"
                )
        batch.slot_mapping = slot_mapping_of(
            batch.block_table, batch.table_rows[token_reqs], batch.positions, block_size
        )
        batch.errors = errors
        return batch

    def _collect(
        self, step: SchedulerOutput, errors: dict[str, str], previous_rows: dict[str, int]
    ) -> tuple[StepBatch, np.ndarray]:
        """The scheduled requests not in ``errors`` (adding those whose token counts do
        not add up), with everything but ``slot_mapping`` filled; and the ``[num_tokens]``
        request index of each flat token."""
        request_ids: list[str] = []
        rows: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        input_ids: list[int] = []
        sample_rows: list[int] = []
        prev_dst: list[int] = []
        prev_src: list[int] = []
        get_state = self._states.get  # the loop below runs once per request per step
        prompt_rows: list[bool] = []
        for request_id, num_scheduled in step.num_scheduled_tokens.items():
            state = get_state(request_id)
            if state is None or request_id in errors:
                errors.setdefault(request_id, _NO_STATE)
                continue
            start = state.num_computed_tokens
            end = start + num_scheduled
            num_tokens = len(state.token_ids)
            # the position after the known tokens: its token is the previous step's sample
            fed = end == num_tokens + 1 and request_id in previous_rows
            if num_scheduled < 1 or (end > num_tokens and not fed):
                errors[request_id] = (
                    f"scheduled {num_scheduled} tokens from {start}, but only "
                    f"{num_tokens} tokens are known"
                )
                continue
            if end >= num_tokens:
                sample_rows.append(len(request_ids))
            request_ids.append(request_id)
            prompt_rows.append(start < state.num_prompt_tokens)
            rows.append(state.table_row)
            query_lens.append(num_scheduled)
            seq_lens.append(end)
            if fed:
                input_ids.extend(state.token_ids[start:])
                prev_dst.append(len(input_ids))
                prev_src.append(previous_rows[request_id])
                input_ids.append(0)  # filled on the device
            elif num_scheduled == 1:
                input_ids.append(state.token_ids[start])
            else:
                input_ids.extend(state.token_ids[start:end])
        query_lens_np = np.array(query_lens, dtype=np.int64)
        seq_lens_np = np.array(seq_lens, dtype=np.int64)
        table_rows = np.array(rows, dtype=np.int64)
        query_start_loc, token_reqs, positions = token_layout(
            query_lens_np, seq_lens_np, len(input_ids)
        )
        num_blocks = self.block_table.num_blocks[table_rows]
        return StepBatch(
            request_ids=request_ids,
            input_ids=np.array(input_ids, dtype=np.int64),
            positions=positions,
            slot_mapping=np.zeros(0, dtype=np.int64),
            query_lens=query_lens_np,
            seq_lens=seq_lens_np,
            query_start_loc=query_start_loc,
            table_rows=table_rows,
            num_blocks=num_blocks,
            max_num_blocks=int(num_blocks.max()) if len(rows) else 0,
            row_serials=self.block_table.serials[table_rows],
            block_table=self.block_table.table,
            sample_rows=sample_rows,
            logits_indices=last_token_indices(query_start_loc, sample_rows),
            prompt_rows=np.array(prompt_rows, dtype=bool),
            prev_token_dst=np.array(prev_dst, dtype=np.int64),
            prev_token_src=np.array(prev_src, dtype=np.int64),
        ), token_reqs

    def drop(self, request_id: str) -> None:
        """Forget the request and free its block-table row (no-op for an unknown id)."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.block_table.free(state.table_row)
            self.pooling_ids.discard(request_id)
