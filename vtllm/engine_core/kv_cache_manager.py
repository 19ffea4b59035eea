"""Per-request KV block tables on top of the ``BlockPool``, with prefix caching.

Invariant: a block's hash becomes matchable only in ``allocate_slots``, for the full
blocks covered by tokens that the same step schedules for computation. Workers write a
step's KV in every layer before any attention of that layer reads it, and steps run in
order, so every published hash names KV that a forward pass has written (or writes before
anyone reads it). Nothing else — no probe, no failed admission — publishes a hash.
"""

from __future__ import annotations

from dataclasses import dataclass

from vtllm.engine_core.block_pool import BlockPool, KVCacheBlock
from vtllm.engine_core.request import Request


@dataclass
class PrefixCacheStats:
    """Token counts since the last ``take_stats``."""

    queries: int = 0
    hits: int = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # full blocks already published
        self.stats = PrefixCacheStats()

    # -- prefix lookups --------------------------------------------------------------

    def _longest_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        if not self.enable_caching:
            return []
        # Leave at least one token to compute: the last prompt token's logits are needed.
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_matched_prefix_tokens(self, request: Request) -> int:
        """Pure read: how many leading tokens of ``request`` are cached now.

        No stats, no allocation, no hash published; safe to call any number of times
        (the ``lpm`` policy and probes use it).
        """
        return len(self._longest_cached_prefix(request)) * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Admission-path lookup: the cached prefix blocks and their token count.

        Records nothing: a request that waits for blocks may look up many times; only
        ``record_admission`` counts, once it got its blocks.
        """
        blocks = self._longest_cached_prefix(request)
        return blocks, len(blocks) * self.block_size

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission in the prefix-cache stats: all of the request's tokens are
        queried, ``num_hit_tokens`` of them hit. Resumption after preemption is a new
        admission (its recompute can hit its own freed blocks)."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_reserved_tokens: int = 0,
    ) -> list[int] | None:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens to compute this step
        (after its ``num_computed_tokens`` and any ``new_computed_blocks`` prefix hit),
        plus room for ``num_reserved_tokens`` beyond them (allocated, not published).

        Returns the ids of blocks appended to its table, or None — with nothing changed —
        when the pool cannot supply them now.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens + num_reserved_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(new_computed_blocks))
        # A prefix hit on a free block takes it out of the free queue too.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)

        if self.enable_caching:
            num_published = self.num_cached_blocks.get(request.request_id, 0)
            if not num_published:
                num_published = len(new_computed_blocks)
            # Blocks full once this step's tokens are computed, and whose hashes exist.
            num_full = min(
                (num_computed + num_new_tokens) // self.block_size, len(request.block_hashes)
            )
            for i in range(num_published, num_full):
                self.pool.cache_block(blocks[i], request.block_hashes[i])
            self.num_cached_blocks[request.request_id] = max(num_published, num_full)
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Return every block of ``request`` (tail first, so a shared prefix lives longest)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    # -- state -----------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> str | None:
        return self.pool.reset_prefix_cache()

    def take_stats(self) -> PrefixCacheStats:
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats
