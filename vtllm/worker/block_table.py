"""Every live request's block table as one row of a persistent int32 array.

The engine sends a request's whole block table once (``NewRequestData.block_ids``) and
then only the blocks appended to it (``CachedRequestData.new_block_ids``). ``BlockTable``
keeps the tables in the same form, so a step costs what changed, not the total context::

    row   num_blocks   table (width grows by doubling; 0 past num_blocks)
     0        3        7 2 9 0 0 0 0 0
     1        0        0 0 0 0 0 0 0 0      <- free (its request finished), reused next
     2        5        4 1 8 3 6 0 0 0

The step's flat arrays are computed from it by the vectorised helpers below (no loop
over requests), see ``token_layout`` and ``slot_mapping_of``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTable:
    """Block ids of live requests, one row each (pure: no torch, no device).

    Contract: ``table[row, :num_blocks[row]]`` are the row's block ids in order, and every
    entry past ``num_blocks[row]`` (and every entry of a free row) is 0, so that any
    ``table[rows, :w]`` is a 0-padded table of valid block ids. A row only grows between
    ``add`` and ``free``, and each ``add`` gives it a new ``serials[row]``: equal
    ``(serials[row], num_blocks[row])`` at two times mean equal contents. ``table`` may be
    reallocated by ``add`` and ``append``: views taken earlier stay consistent with the
    state they were taken from, not with later changes.
    """

    def __init__(self, num_rows: int = 16, width: int = 16) -> None:
        self.table = np.zeros((max(num_rows, 1), max(width, 1)), dtype=np.int32)
        self.num_blocks = np.zeros(max(num_rows, 1), dtype=np.int64)  # [capacity]
        # [capacity] a number no other ``add`` gave: (serial, num_blocks) names a row's
        # content, so a copy of it elsewhere can tell whether it is still current
        self.serials = np.zeros(max(num_rows, 1), dtype=np.int64)
        self._next_serial = 1
        self._free_rows = list(range(len(self.num_blocks) - 1, -1, -1))  # pop() gives 0 first

    @property
    def num_live_rows(self) -> int:
        return len(self.num_blocks) - len(self._free_rows)

    def add(self, block_ids: Sequence[int]) -> int:
        """Take a free row (growing the array when none is left) holding ``block_ids``;
        returns the row."""
        if not self._free_rows:
            old = len(self.num_blocks)
            self.table = _grown(self.table, 2 * old, self.table.shape[1])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(old, np.int64)])
            self.serials = np.concatenate([self.serials, np.zeros(old, np.int64)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.serials[row] = self._next_serial
        self._next_serial += 1
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: Sequence[int]) -> None:
        """Append ``block_ids`` to ``row``'s table (widening the array by doubling)."""
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            width = self.table.shape[1]
            while width < end:
                width *= 2
            self.table = _grown(self.table, self.table.shape[0], width)
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def free(self, row: int) -> None:
        """Return ``row`` (its entries zeroed) for a later ``add``."""
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def block_ids(self, row: int) -> list[int]:
        """``row``'s block ids (a copy)."""
        return self.table[row, : self.num_blocks[row]].tolist()


def _grown(table: np.ndarray, num_rows: int, width: int) -> np.ndarray:
    grown = np.zeros((num_rows, width), dtype=table.dtype)
    grown[: table.shape[0], : table.shape[1]] = table
    return grown


def token_layout(
    query_lens: np.ndarray,  # [num_reqs] int64
    seq_lens: np.ndarray,  # [num_reqs] int64
    num_tokens: int | None = None,  # sum of query_lens, when the caller knows it
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each request's tokens lie in the flat step order, without a Python loop.

    Request ``r`` computes positions ``seq_lens[r] - query_lens[r] .. seq_lens[r] - 1``
    as flat tokens ``query_start_loc[r] .. query_start_loc[r + 1] - 1``::

        query_lens  [3, 1]      seq_lens [10, 2]
        query_start_loc [0, 3, 4]
        token_req   [0, 0, 0, 1]
        positions   [7, 8, 9, 1]

    Returns ``(query_start_loc [num_reqs + 1] int32, token_req [num_tokens] int64,
    positions [num_tokens] int64)``.
    """
    num_reqs = len(query_lens)
    if num_tokens is None:
        num_tokens = int(query_lens.sum())
    if num_tokens == num_reqs:  # decode only: one token per request, its last position
        arange = np.arange(num_reqs + 1, dtype=np.int64)
        return arange.astype(np.int32), arange[:-1], seq_lens - 1
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    token_req = np.repeat(np.arange(num_reqs, dtype=np.int64), query_lens)
    # position = first position of its request + offset inside the request's chunk
    first = (seq_lens - query_lens - query_start_loc[:-1])[token_req]
    return query_start_loc, token_req, np.arange(num_tokens, dtype=np.int64) + first


def slot_mapping_of(
    table: np.ndarray,  # [rows, width] int32 block ids
    token_rows: np.ndarray,  # [num_tokens] the table row of each token
    positions: np.ndarray,  # [num_tokens] int64
    block_size: int,
) -> np.ndarray:
    """``[num_tokens]`` int64 KV slot of each token: ``block * block_size + offset``
    (``attention.py`` draws the layout). The rows must cover the positions."""
    blocks = table[token_rows, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size
