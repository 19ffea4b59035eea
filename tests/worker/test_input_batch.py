"""The worker's persistent batch state against a plain rebuild from lists.

``RequestStates`` keeps block tables as rows of one persistent array grown by deltas
(``block_table.py``) and computes positions and slots with numpy; the reference here is
the obvious one: each request's whole token list and block list, as the engine knows
them, walked token by token. Random workloads (hypothesis) cover new requests, prefill
chunks, decodes, blocks allocated ahead, finishing, preemption with resume, and the error
cases (unknown ids, too many tokens, too few blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtllm.protocol.messages import (
    CachedRequestData,
    NewRequestData,
    PoolingType,
    SamplingParams,
    SchedulerOutput,
)
from vtllm.worker.attention import KERNEL_TABLE_WIDTH_MULTIPLE, attention_metadata
from vtllm.worker.block_table import BlockTable, token_layout
from vtllm.worker.decode_graphs import DecodeInputs
from vtllm.worker.input_batch import RequestStates, StepBatch
from vtllm.worker.platform import cpu_platform

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)
POOLING = SamplingParams(temperature=0.0, pooling=PoolingType.LAST)


def test_block_table_rows_grow_and_are_reused_zeroed():
    table = BlockTable(num_rows=2, width=2)
    a = table.add([7, 2, 9])  # wider than 2: the array doubles to 4 columns
    b = table.add([5])
    c = table.add([])  # a third row: the array doubles to 4 rows
    assert (a, b, c) == (0, 1, 2) and table.table.shape == (4, 4)
    table.append(b, [6, 8, 1, 3])  # 5 blocks: 8 columns
    assert table.table.shape == (4, 8)
    assert table.block_ids(a) == [7, 2, 9] and table.block_ids(b) == [5, 6, 8, 1, 3]
    table.free(b)
    assert not table.table[b].any() and table.num_live_rows == 2
    assert table.add([4]) == b  # the freed row is taken again, holding only the new ids
    assert table.table[b].tolist() == [4, 0, 0, 0, 0, 0, 0, 0]


def test_token_layout_of_a_mixed_step():
    query_start_loc, token_req, positions = token_layout(np.array([3, 1, 2]), np.array([10, 2, 2]))
    assert query_start_loc.tolist() == [0, 3, 4, 6]
    assert token_req.tolist() == [0, 0, 0, 1, 2, 2]
    assert positions.tolist() == [7, 8, 9, 1, 0, 1]


@dataclass
class SimRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams = GREEDY
    num_computed_tokens: int = 0
    num_tokens_sent: int = 0
    sent: bool = False


class Engine:
    """The engine's side: whole lists per request, and the deltas it sends."""

    def __init__(self) -> None:
        self.requests: dict[str, SimRequest] = {}
        self.free_blocks = list(range(1, 4000))
        self.finished: list[str] = []
        self.next_id = 0
        self.pooling: set[str] = set()  # every request created with a pooling param
        self.step_id = 0

    def end(self, request_id: str) -> None:
        self.free_blocks.extend(self.requests.pop(request_id).block_ids)
        self.finished.append(request_id)

    def preempt(self, request_id: str) -> None:
        request = self.requests[request_id]
        self.free_blocks.extend(request.block_ids)
        self.finished.append(request_id)
        request.block_ids, request.num_computed_tokens, request.sent = [], 0, False


def expected_step(engine: Engine, schedule: dict[str, int], known: set[str]) -> dict:
    """What a plain rebuild from the engine's lists gives: per computed request, its
    tokens, positions and slots walked one by one; and which requests fail."""
    out: dict = {"ids": [], "input_ids": [], "positions": [], "slots": [], "tables": []}
    out.update(query_lens=[], seq_lens=[], samples=[], errors=set(), prompt=[])
    for request_id, num in schedule.items():
        request = engine.requests.get(request_id)
        if request_id not in known or request is None:
            out["errors"].add(request_id)
            continue
        start, end = request.num_computed_tokens, request.num_computed_tokens + num
        if num < 1 or end > len(request.token_ids) or len(request.block_ids) * BLOCK_SIZE < end:
            out["errors"].add(request_id)
            continue
        if end == len(request.token_ids):
            out["samples"].append(len(out["ids"]))
        out["ids"].append(request_id)
        out["prompt"].append(start < request.num_prompt_tokens)
        out["query_lens"].append(num)
        out["seq_lens"].append(end)
        out["tables"].append(list(request.block_ids))
        for position in range(start, end):
            out["input_ids"].append(request.token_ids[position])
            out["positions"].append(position)
            block = request.block_ids[position // BLOCK_SIZE]
            out["slots"].append(block * BLOCK_SIZE + position % BLOCK_SIZE)
    return out


def assert_batch_matches(batch: StepBatch, want: dict) -> None:
    assert batch.request_ids == want["ids"]
    assert set(batch.errors) == want["errors"]
    assert batch.input_ids.tolist() == want["input_ids"]
    assert batch.positions.tolist() == want["positions"]
    assert batch.slot_mapping.tolist() == want["slots"]
    assert batch.query_lens.tolist() == want["query_lens"]
    assert batch.seq_lens.tolist() == want["seq_lens"]
    assert batch.sample_rows == want["samples"]
    assert batch.prompt_rows.tolist() == want["prompt"]
    ends = np.cumsum(want["query_lens"], dtype=np.int64)
    assert batch.logits_indices.tolist() == [int(ends[r]) - 1 for r in want["samples"]]
    assert batch.query_start_loc.tolist() == [0, *ends.tolist()]
    width = max((len(t) for t in want["tables"]), default=0)
    padded = [t + [0] * (width - len(t)) for t in want["tables"]]
    assert batch.block_tables().shape == (len(padded), width)
    assert batch.block_tables().tolist() == padded


def assert_metadata_matches(batch: StepBatch, want: dict) -> None:
    """Both backends' metadata built from the persistent arrays agree with the lists."""
    if not batch.num_reqs:
        return
    cpu = torch.device("cpu")
    args = (batch.query_lens, batch.seq_lens, batch.query_start_loc, batch.block_tables())
    kernel = attention_metadata(*args, batch.slot_mapping, BLOCK_SIZE, cpu, "triton")
    inputs = kernel.kernel_inputs
    assert kernel.slot_mapping.tolist() == want["slots"]
    assert inputs.seq_lens.tolist() == want["seq_lens"]
    assert inputs.query_start_loc.tolist() == batch.query_start_loc.tolist()
    assert inputs.max_seq_len == max(want["seq_lens"])
    # the kernels' tables: a width that is a multiple of 16 (one specialisation of the
    # row stride, however long the step's sequences), 0-padded past each request's blocks
    width = inputs.block_tables.shape[1]
    assert width % KERNEL_TABLE_WIDTH_MULTIPLE == 0 and width >= batch.max_num_blocks
    for r, table in enumerate(want["tables"]):
        assert inputs.block_tables[r, : len(table)].tolist() == table
        assert not inputs.block_tables[r, batch.max_num_blocks :].any()
    reference = attention_metadata(*args, batch.slot_mapping, BLOCK_SIZE, cpu, "torch")
    starts = batch.query_start_loc.tolist()
    for group in reference.groups:
        for i in range(group.num_reqs):
            r = starts.index(group.token_starts[i])  # which request this row is
            q_len, seq_len = want["query_lens"][r], want["seq_lens"][r]
            assert (group.query_lens[i], group.seq_lens[i]) == (q_len, seq_len)
            needed = -(-seq_len // BLOCK_SIZE)
            assert group.block_tables[i, :needed].tolist() == want["tables"][r][:needed]
    grouped = sorted(t for g in reference.groups for t in g.token_idx.tolist())
    assert grouped == list(range(batch.num_tokens))


def assert_staged_matches(inputs: DecodeInputs, batch: StepBatch, want: dict) -> None:
    """A decode-only batch staged into the graphs' host buffer: rows 0..n-1 hold it,
    the rest are padding."""
    if not (batch.num_reqs and inputs.fits(batch)):
        return
    inputs.stage(batch)
    n = batch.num_reqs
    view = inputs.host_view
    assert view("input_ids")[:n].tolist() == want["input_ids"]
    assert view("positions")[:n].tolist() == want["positions"]
    assert view("seq_lens")[:n].tolist() == want["seq_lens"]
    assert view("slot_mapping")[:n].tolist() == want["slots"]
    assert (view("slot_mapping")[n:] == -1).all() and (view("seq_lens")[n:] == 1).all()
    for r, table in enumerate(want["tables"]):
        assert view("block_tables")[r, : len(table)].tolist() == table
    # the CPU "device" copy is done at once: the rows the graph reads match the host
    assert torch.equal(
        inputs.device_view("block_tables")[:n], torch.from_numpy(view("block_tables")[:n])
    )
    assert torch.equal(inputs.device_view("slot_mapping"), torch.from_numpy(view("slot_mapping")))


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(
            ["add", "add", "step", "step", "decode", "decode", "end", "preempt", "fault"]
        ),
        st.integers(0, 2**16),
    ),
    min_size=10,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=OPERATIONS)
def test_persistent_state_matches_a_rebuild_from_lists(operations):
    states = RequestStates(lambda params, num_outputs: None)
    twin = RequestStates(lambda params, num_outputs: None)  # another rank, same deltas
    staging = DecodeInputs(
        max_batch=8, blocks_per_seq=16, block_size=BLOCK_SIZE, platform=cpu_platform()
    )
    engine = Engine()
    for op, seed in operations:
        rng = np.random.default_rng(seed)
        live = sorted(engine.requests)
        if op == "add":
            request_id = f"r{engine.next_id}"
            engine.next_id += 1
            prompt = rng.integers(0, 1000, size=int(rng.integers(1, 30))).tolist()
            params = POOLING if rng.random() < 0.3 else GREEDY
            engine.requests[request_id] = SimRequest(prompt, len(prompt), [], params)
            if params is POOLING:
                engine.pooling.add(request_id)
        elif op in ("end", "preempt") and live:
            victim = live[int(rng.integers(len(live)))]
            if op == "end":
                engine.end(victim)
            else:
                engine.preempt(victim)
        elif op in ("step", "decode", "fault"):
            fault = rng.integers(4) if op == "fault" else None
            step, known = send_step(engine, rng, fault, decode_only=op == "decode")
            want = expected_step(engine, step.num_scheduled_tokens, known)
            errors = states.update(step)
            twin.update(step)
            batch = states.build_step(step, BLOCK_SIZE)
            twin_batch = twin.build_step(step, BLOCK_SIZE)
            assert_batch_matches(batch, want)
            assert np.array_equal(twin_batch.slot_mapping, batch.slot_mapping)
            assert_metadata_matches(batch, want)
            assert_staged_matches(staging, batch, want)
            assert_subset_matches(engine, step, batch, known, rng)
            errors.update(batch.errors)
            finish_step(engine, states, twin, step, batch, errors, rng)
        # every request sent and still live holds the engine's blocks on the worker
        for request_id, request in engine.requests.items():
            if request.sent:
                assert states.block_ids(request_id) == request.block_ids
        assert states.block_table.num_live_rows == len(states)
        assert states.pooling_ids == {r for r in engine.pooling if r in states}


def assert_subset_matches(engine, step, batch, known, rng) -> None:
    """A random part of the step (``StepBatch.subset``) is the step of that part alone,
    and its tokens are the step's at the indices it returns."""
    keep = rng.random(batch.num_reqs) < 0.5
    part, tokens = batch.subset(keep)
    kept = {batch.request_ids[r] for r in np.flatnonzero(keep).tolist()}
    schedule = {r: n for r, n in step.num_scheduled_tokens.items() if r in kept}
    assert_batch_matches(part, expected_step(engine, schedule, known))
    assert np.array_equal(part.input_ids, batch.input_ids[tokens])
    assert np.array_equal(part.slot_mapping, batch.slot_mapping[tokens])


def send_step(
    engine: Engine, rng: np.random.Generator, fault, decode_only: bool = False
) -> tuple[SchedulerOutput, set]:
    """Schedule some requests (chunks, decodes, blocks ahead; ``decode_only``: only the
    requests that decode), with ``fault`` 0..3 one kind of malformed step. Returns the
    step and the ids the worker will know."""
    new, cached, schedule = [], [], {}
    for request_id in sorted(engine.requests):
        request = engine.requests[request_id]
        remaining = len(request.token_ids) - request.num_computed_tokens
        if remaining < 1 or (decode_only and remaining > 1) or rng.random() < 0.2:
            continue
        num = remaining if rng.random() < 0.5 else int(rng.integers(1, remaining + 1))
        end = request.num_computed_tokens + num
        needed = -(-end // BLOCK_SIZE) + int(rng.integers(0, 3)) - len(request.block_ids)
        new_blocks = [engine.free_blocks.pop() for _ in range(max(0, needed))]
        request.block_ids.extend(new_blocks)
        schedule[request_id] = num
        if not request.sent:
            new.append(
                NewRequestData(
                    request_id,
                    list(request.token_ids),
                    request.num_prompt_tokens,
                    request.params,
                    list(request.block_ids),
                    request.num_computed_tokens,
                )
            )
            request.sent = True
        else:
            new_tokens = request.token_ids[request.num_tokens_sent :]
            cached.append(
                CachedRequestData(request_id, new_tokens, new_blocks, request.num_computed_tokens)
            )
        request.num_tokens_sent = len(request.token_ids)
    known = {r.request_id for r in new} | {r.request_id for r in cached}
    if fault == 0:  # a request the worker never heard of, scheduled and sent as cached
        cached.append(CachedRequestData("ghost", [1], [3], 0))
        schedule["ghost"] = 1
    elif fault == 1 and schedule:  # more tokens than the request has
        schedule[next(iter(schedule))] += 1000
    elif fault == 2 and schedule:  # the engine "forgets" to send one block
        for item in cached:
            if item.new_block_ids:
                item.new_block_ids = item.new_block_ids[:-1]
                engine.requests[item.request_id].block_ids.pop()
                break
    step = SchedulerOutput(engine.step_id, new, cached, schedule, engine.finished)
    engine.finished = []
    engine.step_id += 1
    return step, known


def finish_step(engine, states, twin, step, batch, errors, rng) -> None:
    """What the runner and the engine do after the forward: failed requests end on both
    sides, the others advance and the samplers get a token."""
    for request_id in errors:
        states.drop(request_id)
        twin.drop(request_id)
        if request_id in engine.requests:
            engine.end(request_id)
    for request_id in batch.request_ids:
        engine.requests[request_id].num_computed_tokens += step.num_scheduled_tokens[request_id]
    for row in batch.sample_rows:
        engine.requests[batch.request_ids[row]].token_ids.append(int(rng.integers(0, 1000)))


def test_resumed_request_gets_a_fresh_row():
    states = RequestStates(lambda params, num_outputs: None)
    first = NewRequestData("a", [1, 2, 3], 3, GREEDY, [5], 0)
    states.update(SchedulerOutput(0, [first], [], {"a": 3}))
    states.update(SchedulerOutput(1, [], [CachedRequestData("a", [9], [6], 3)], {"a": 1}))
    assert states.block_ids("a") == [5, 6]
    # preempted (dropped) and resumed in one step: only the resent table remains
    resumed = NewRequestData("a", [1, 2, 3, 9, 4], 3, GREEDY, [8, 2], 0)
    states.update(SchedulerOutput(2, [resumed], [], {"a": 5}, finished_request_ids=["a"]))
    assert states.block_ids("a") == [8, 2] and states.block_table.num_live_rows == 1
    batch = states.build_step(SchedulerOutput(2, [], [], {"a": 5}), BLOCK_SIZE)
    assert batch.slot_mapping.tolist() == [32, 33, 34, 35, 8]
    # sent anew without being dropped first: the old row is freed all the same
    states.update(SchedulerOutput(3, [NewRequestData("a", [1], 1, GREEDY, [4], 0)], [], {}))
    assert states.block_ids("a") == [4] and states.block_table.num_live_rows == 1


@pytest.mark.parametrize("num_reqs", [1, 7])
def test_decode_step_tables_are_gathered_not_rebuilt(num_reqs):
    """The step refers to the persistent rows; only ``block_tables()`` copies them."""
    states = RequestStates(lambda params, num_outputs: None)
    new = [
        NewRequestData(f"r{i}", [1] * 9, 9, GREEDY, [3 * i + 1, 3 * i + 2, 3 * i + 3], 8)
        for i in range(num_reqs)
    ]
    step = SchedulerOutput(0, new, [], {f"r{i}": 1 for i in range(num_reqs)})
    states.update(step)
    batch = states.build_step(step, BLOCK_SIZE)
    assert batch.block_table is states.block_table.table
    assert batch.block_tables().tolist() == [
        [3 * i + 1, 3 * i + 2, 3 * i + 3] for i in range(num_reqs)
    ]
    assert batch.slot_mapping.tolist() == [(3 * i + 3) * BLOCK_SIZE for i in range(num_reqs)]


def test_staging_rewrites_only_rows_that_changed():
    """The decode-graph buffer keeps table rows between steps: a row is rewritten when a
    request gains a block or another request takes its place, even one reusing the
    finished request's block-table row with as many blocks."""
    states = RequestStates(lambda params, num_outputs: None)
    staging = DecodeInputs(max_batch=2, blocks_per_seq=4, block_size=4, platform=cpu_platform())

    def stage(step: SchedulerOutput) -> StepBatch:
        states.update(step)
        batch = states.build_step(step, BLOCK_SIZE)
        staging.stage(batch)
        return batch

    a = NewRequestData("a", [1] * 8, 8, GREEDY, [7, 8], 7)
    c = NewRequestData("c", [1] * 5, 5, GREEDY, [5, 6], 4)
    stage(SchedulerOutput(0, [a, c], [], {"a": 1, "c": 1}))
    stage(SchedulerOutput(1, [], [CachedRequestData("a", [2], [4], 8)], {"a": 1, "c": 1}))
    assert staging.host_view("block_tables")[:2, :3].tolist() == [[7, 8, 4], [5, 6, 0]]
    b = NewRequestData("b", [2] * 5, 5, GREEDY, [3, 9], 4)  # a's row, as many blocks as c
    batch = stage(SchedulerOutput(2, [b], [], {"c": 1, "b": 1}, finished_request_ids=["a"]))
    assert batch.table_rows.tolist() == [1, 0]  # c keeps its row, b takes a's
    assert staging.host_view("block_tables")[:2, :2].tolist() == [[5, 6], [3, 9]]
    assert staging.host_view("slot_mapping")[:2].tolist() == [6 * 4, 9 * 4]


@pytest.mark.gpu
def test_staging_into_pinned_memory_reaches_the_device():
    """On a GPU the staged rows travel by an asynchronous copy from pinned memory: after
    a run of decode steps (blocks appended, a request replaced, the batch shrinking and
    growing) the device buffer holds what a rebuild from lists gives."""
    from vtllm.worker.platform import detect_platform

    platform = detect_platform(0)
    states = RequestStates(lambda params, num_outputs: None)
    staging = DecodeInputs(max_batch=8, blocks_per_seq=16, block_size=BLOCK_SIZE, platform=platform)
    tables = {f"r{i}": [10 * i + 1, 10 * i + 2] for i in range(6)}
    fresh_blocks = iter(range(100, 200))
    lengths = dict.fromkeys(tables, 6)
    new = [NewRequestData(r, [1] * 6, 6, GREEDY, t, 5) for r, t in tables.items()]
    step = SchedulerOutput(0, new, [], dict.fromkeys(tables, 1))
    for step_id in range(1, 12):
        states.update(step)
        batch = states.build_step(step, BLOCK_SIZE)
        staging.stage(batch)
        platform.synchronize()
        n = batch.num_reqs
        device_tables = staging.device_view("block_tables")[:n].cpu()
        for r, request_id in enumerate(batch.request_ids):
            assert device_tables[r, : len(tables[request_id])].tolist() == tables[request_id]
        expected_slots = [
            tables[rid][(lengths[rid] - 1) // BLOCK_SIZE] * BLOCK_SIZE
            + (lengths[rid] - 1) % BLOCK_SIZE
            for rid in batch.request_ids
        ]
        assert staging.device_view("slot_mapping")[:n].tolist() == expected_slots
        finished = ["r1"] if step_id == 4 else []
        new = [NewRequestData("r9", [2] * 3, 3, GREEDY, [99], 2)] if step_id == 6 else []
        for request_id in finished:
            del tables[request_id], lengths[request_id]
        cached = []
        for request_id in tables:
            lengths[request_id] += 1
            grown = [next(fresh_blocks)] if lengths[request_id] % BLOCK_SIZE == 1 else []
            tables[request_id] = tables[request_id] + grown
            cached.append(CachedRequestData(request_id, [7], grown, lengths[request_id] - 1))
        for item in new:
            tables[item.request_id], lengths[item.request_id] = list(item.block_ids), 3
        step = SchedulerOutput(step_id, new, cached, dict.fromkeys(tables, 1), finished)
