"""A request's life inside the engine core: tokens, progress, status, block hashes."""

from __future__ import annotations

import enum
import hashlib
import time
from array import array

from vtllm.protocol.messages import FinishReason, SamplingParams

BlockHash = bytes


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status.is_finished`` is one comparison."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: str | None) -> BlockHash:
    """Chain hash of one full block: parent hash + its token ids + extra keys (cache salt)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(b"\1salt:" + extra.encode())
    return h.digest()


class Request:
    """Mutable per-request state owned by the scheduler.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (or is being written by
    the step just scheduled). ``block_hashes[i]`` is the chain hash of tokens
    ``[i * block_size, (i + 1) * block_size)`` and exists for every full block of known
    tokens (prompt and outputs).
    """

    def __init__(
        self,
        request_id: str,
        client_id: bytes,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        block_size: int,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[BlockHash] = []
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not yet
        self.num_preemptions = 0
        self.received_time = time.monotonic()  # engine clock
        self.first_scheduled_time: float | None = None
        self.stop_token_id: int | None = None
        self.error: str | None = None
        # How many of all_token_ids the workers hold; None = they hold no state for it.
        self.num_tokens_sent_to_workers: int | None = None
        # Structured output: True from admission until the driver worker reports its
        # grammar compiled; the scheduler leaves it waiting (in its place) until then.
        self.awaiting_grammar = False
        # Tokens scheduled steps owe this request that are not in ``all_token_ids`` yet
        # (sampled by a step still in flight); async scheduling computes the next position
        # from them before they are known (the worker feeds the sampled id on the device).
        self.num_output_placeholders = 0
        self._extend_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those that steps in flight will sample."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        num_full_blocks = len(self.all_token_ids) // self.block_size
        while len(self.block_hashes) < num_full_blocks:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            # The salt enters the first block; the chain carries it to every later one.
            self.block_hashes.append(
                hash_block(parent, tokens, self.cache_salt if i == 0 else None)
            )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
