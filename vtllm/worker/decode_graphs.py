"""CUDA/HIP graphs for decode-only steps (every request computes one token).

A decode step of a small model is hundreds of tiny kernel launches, and Python issuing
them costs more than the GPU running them. A graph records the launches of one forward
once and replays them with one call. A graph fixes every shape and every pointer, so:

* a batch of ``n`` decodes is padded up to the next capture size (``capture_sizes``:
  1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, ending at ``max_num_seqs``);
* inputs live in persistent buffers: each step writes its arrays into a (pinned) host
  staging buffer, one host→device copy moves them, and the graph of the padded size runs;
* padding rows decode token 0 at position 0 with slot ``-1`` (``reshape_and_cache``
  skips it) over one key of the cache: finite values whose output is dropped;
* the attention kernel's split-KV count is fixed per graph, since a replay cannot look at
  sequence lengths: a size whose longest admitted sequence wants a split gets two graphs,
  one split for that length and one unsplit, and ``run`` replays the unsplit one while
  the batch's longest sequence is short enough not to want a split (at batch 1 and ~100
  keys, a split costs a reduce kernel a layer and saves nothing).

Prefill and mixed steps, and decode batches that do not fit (more requests than the
largest graph, a block table wider than the buffer), run eagerly.

Packed int32 buffer (``B`` = largest capture size, ``W`` = blocks per sequence), the same
layout on the host and on the device::

    input_ids [B] | positions [B] | slot_mapping [B] | query_start_loc [B + 1]
    | seq_lens [B] | block_tables [B, W]

Without graphs (``use_graphs=False``, e.g. on CPU) the same padded static-buffer path runs
the forward directly; tests use it to check the padding against unpadded eager steps.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vtllm.log import ProgressLog
from vtllm.worker.attention import AttentionMetadata, KernelInputs
from vtllm.worker.input_batch import StepBatch
from vtllm.worker.platform import Platform

logger = logging.getLogger(__name__)

# (input_ids, positions, kv_caches, metadata) -> hidden [num_tokens, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ..., 256, 272, ...,
    always ending at ``max_num_seqs`` so that every decode batch has one."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    size = 16
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    sizes.append(max_num_seqs)
    return sizes


def padded_size(sizes: Sequence[int], num_reqs: int) -> int | None:
    """The smallest capture size that holds ``num_reqs`` (sorted ``sizes``), or None."""
    index = bisect.bisect_left(sizes, num_reqs)
    return sizes[index] if index < len(sizes) else None


class DecodeInputs:
    """Persistent input buffers of the decode graphs (packed int32, see the module doc)."""

    def __init__(
        self, max_batch: int, blocks_per_seq: int, block_size: int, platform: Platform
    ) -> None:
        self.max_batch = max_batch
        self.blocks_per_seq = blocks_per_seq
        self.block_size = block_size
        b, w = max_batch, blocks_per_seq
        sizes = {
            "input_ids": b,
            "positions": b,
            "slot_mapping": b,
            "query_start_loc": b + 1,
            "seq_lens": b,
            "block_tables": b * w,
        }
        self._offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in sizes.items():
            self._offsets[name] = (start, start + size)
            start += size
        self._tables_start = self._offsets["block_tables"][0]
        self.host = torch.zeros(start, dtype=torch.int32, pin_memory=platform.pin_memory)
        self.device_buffer = torch.zeros(start, dtype=torch.int32, device=platform.device)
        host_np = self.host.numpy()
        self._host_views = {  # numpy views of the pinned buffer, one per field
            name: host_np[start:end] for name, (start, end) in self._offsets.items()
        }
        self._host_views["block_tables"] = self._host_views["block_tables"].reshape(b, w)
        # padding rows of every size: one query token each, one key in the null block
        host = self.host_view
        host("query_start_loc")[:] = np.arange(b + 1)
        host("seq_lens")[:] = 1
        host("slot_mapping")[:] = -1
        self.device_buffer.copy_(self.host)
        # what host table row i holds: the BlockTable row's (serial, num_blocks) it was
        # copied from (-1: nothing yet), so that a step rewrites only rows that changed
        self._staged_serials = np.full(b, -1, dtype=np.int64)
        self._staged_blocks = np.zeros(b, dtype=np.int64)
        self._num_staged = 0  # rows >= this one hold padding
        self.platform = platform
        self._copied: Any = None  # event after the last copy out of ``host`` (None: done)

    def host_view(self, name: str) -> np.ndarray:
        return self._host_views[name]

    def device_view(self, name: str) -> torch.Tensor:
        start, end = self._offsets[name]
        view = self.device_buffer[start:end]
        if name == "block_tables":
            return view.view(self.max_batch, self.blocks_per_seq)
        return view

    def fits(self, batch: StepBatch) -> bool:
        """A decode-only batch no larger than the buffers, every table within ``W``."""
        return (
            0 < batch.num_reqs <= self.max_batch
            and batch.num_tokens == batch.num_reqs
            and batch.max_num_blocks <= self.blocks_per_seq
        )

    def stage(self, batch: StepBatch) -> None:
        """Write a fitting decode batch into rows ``0 .. n - 1``, reset row ``n ..`` to
        padding, and copy the used part to the device (asynchronously from pinned
        memory). The host buffer is written again only once that copy is done (an event
        after it): with async scheduling the next step is staged while this one may not
        have started on the device. The wait is for the head of the step before's work.

        Every write is one vectorised numpy copy, and of the tables only the rows that
        differ from what the buffer holds (a new request in that place, or a new block)
        are gathered from the worker's persistent block table: in a run of decode steps,
        about one row in ``block_size``. No loop over requests."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host buffer
        n = batch.num_reqs
        host = self._host_views
        host["input_ids"][:n] = batch.input_ids
        host["positions"][:n] = batch.positions
        host["seq_lens"][:n] = batch.seq_lens
        host["slot_mapping"][:n] = batch.slot_mapping
        if n < self._num_staged:  # rows the last step used become padding again
            end = self._num_staged
            host["input_ids"][n:end] = 0
            host["positions"][n:end] = 0
            host["seq_lens"][n:end] = 1
            host["slot_mapping"][n:end] = -1
        self._num_staged = n
        # columns past a row's blocks keep what an earlier step left there: the kernel
        # reads no key past seq_len. Table rows >= n are not copied: a padding row reads
        # one key of whatever block its stale row names (finite values; output dropped)
        width = batch.max_num_blocks
        stale = self._staged_serials[:n] != batch.row_serials
        stale |= self._staged_blocks[:n] != batch.num_blocks
        changed = np.flatnonzero(stale)
        if len(changed) == n:
            host["block_tables"][:n, :width] = batch.block_table[batch.table_rows, :width]
        elif len(changed):
            rows = batch.table_rows[changed]
            host["block_tables"][changed, :width] = batch.block_table[rows, :width]
        self._staged_serials[:n] = batch.row_serials
        self._staged_blocks[:n] = batch.num_blocks
        end = self._tables_start + n * self.blocks_per_seq
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)
        self._copied = self.platform.record_event()

    def metadata(self, size: int, num_kv_splits: int) -> AttentionMetadata:
        """Attention metadata over the first ``size`` rows (views of the device buffer)."""
        kernel_inputs = KernelInputs(
            query_start_loc=self.device_view("query_start_loc")[: size + 1],
            seq_lens=self.device_view("seq_lens")[:size],
            block_tables=self.device_view("block_tables")[:size],
            max_seq_len=None,
            num_kv_splits=num_kv_splits,
        )
        return AttentionMetadata(
            slot_mapping=self.device_view("slot_mapping")[:size],
            groups=[],
            backend="triton",
            kernel_inputs=kernel_inputs,
        )


class DecodeGraphs:
    """One graph per capture size over shared persistent inputs; ``run`` replays."""

    def __init__(
        self,
        forward: Forward,
        kv_caches: list,
        platform: Platform,
        sizes: Sequence[int],
        blocks_per_seq: int,
        block_size: int,
        split_rule: Callable[[int, int], int],
        use_graphs: bool,
    ) -> None:
        """``split_rule(padded_size, max_seq_len)`` gives the attention split count for a
        size and the longest sequence of a batch; ``use_graphs=False`` runs the padded
        path eagerly (CPU, tests)."""
        if use_graphs and not platform.supports_graphs:
            raise RuntimeError(f"{platform.kind.value} has no device graphs")
        self.forward = forward
        self.kv_caches = kv_caches
        self.platform = platform
        self.sizes = sorted(sizes)
        self.inputs = DecodeInputs(self.sizes[-1], blocks_per_seq, block_size, platform)
        self.split_rule = split_rule
        self.longest = blocks_per_seq * block_size  # the longest sequence the buffers admit
        self.use_graphs = use_graphs
        self._graphs: dict[tuple[int, int], object] = {}  # (size, kv splits) -> graph
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._pool = platform.new_graph_pool() if use_graphs else None

    def capture(self) -> None:
        """Capture every size, largest first (later ones reuse its pool memory), with a
        progress log. A no-op without graphs."""
        if not self.use_graphs:
            return
        keys = [
            (size, splits) for size in reversed(self.sizes) for splits in self.split_counts(size)
        ]
        progress = ProgressLog(logger, "capturing decode graphs", len(keys))
        for size, splits in keys:
            # warm-up outside the graph: Triton compiles and autotunes here, not in capture
            self._forward_padded(size, splits)
            self.platform.synchronize()
            with self.platform.capture_graph(self._pool) as graph:
                hidden = self._forward_padded(size, splits)
            self._graphs[size, splits] = graph
            self._outputs[size, splits] = hidden
            progress.advance(f"batch {size}" + (f", {splits} KV splits" if splits > 1 else ""))
        self.platform.synchronize()

    @property
    def num_graphs(self) -> int:
        """Graphs captured (a size may have two: ``split_counts``); 0 without graphs."""
        return len(self._graphs)

    def split_counts(self, size: int) -> list[int]:
        """The attention split counts that get a graph at ``size``: the one for the
        longest admitted sequence, and 1 where that is more."""
        return sorted({self.split_rule(size, self.longest), 1}, reverse=True)

    def split_count(self, size: int, max_seq_len: int) -> int:
        """The captured split count a batch of ``size`` whose longest sequence has
        ``max_seq_len`` tokens runs with: 1 where the rule wants no split for it, else the
        longest admitted sequence's."""
        if self.split_rule(size, max_seq_len) == 1:
            return 1
        return self.split_rule(size, self.longest)

    def _forward_padded(self, size: int, splits: int) -> torch.Tensor:
        """The forward over the first ``size`` rows of the persistent inputs."""
        metadata = self.inputs.metadata(size, splits)
        ids = self.inputs.device_view("input_ids")[:size]
        positions = self.inputs.device_view("positions")[:size]
        return self.forward(ids, positions, self.kv_caches, metadata)  # [size, hidden]

    def can_run(self, batch: StepBatch) -> bool:
        return self.inputs.fits(batch)

    def run(
        self, batch: StepBatch, feed: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a batch ``can_run`` accepted (a view into the
        graph's output: use it before the next ``run``). ``feed(input_ids)`` may change
        the staged ``[n]`` int32 device input ids before the forward (async scheduling
        puts the previous step's sampled ids there)."""
        n = batch.num_reqs
        size = padded_size(self.sizes, n)
        assert size is not None, n
        self.inputs.stage(batch)
        if feed is not None:
            feed(self.inputs.device_view("input_ids")[:n])
        splits = self.split_count(size, int(batch.seq_lens.max()))
        if not self.use_graphs:
            return self._forward_padded(size, splits)[:n]
        self._graphs[size, splits].replay()
        return self._outputs[size, splits][:n]
