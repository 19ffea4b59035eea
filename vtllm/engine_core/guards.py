"""Guards that make a wedged engine unreachable by construction.

1. Start-up: the KV pool must hold one whole sequence of ``max_model_len`` tokens
   (``check_kv_cache_fits``). Then any request that passes 2. can always be scheduled
   once the requests ahead of it finish or are preempted.
2. Admission: a request whose prompt plus output could exceed ``max_model_len``, or that
   is malformed, finishes at once with a clear error (``validate_request``).
3. Both decide from static numbers only — never by trial allocation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vtllm.protocol.limits import (
    LIST_LIMITS,
    Refusal,
    prompt_too_long_message,
    sampling_problems,
    token_id_problem,
)
from vtllm.protocol.messages import SamplingParams

logger = logging.getLogger(__name__)

GiB = 1024**3


class KVCacheTooSmallError(RuntimeError):
    """The user pinned a ``--max-model-len`` that the KV pool cannot hold."""


@dataclass(frozen=True)
class KVFit:
    max_model_len: int
    num_blocks: int  # including the reserved null block


def max_len_that_fits(num_blocks: int, block_size: int) -> int:
    """Longest sequence the pool holds: every block but the reserved null block."""
    return max(0, num_blocks - 1) * block_size


def check_kv_cache_fits(
    *,
    usable_kv_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    model_max_len: int,
    pinned_max_model_len: int | None,
    memory_flag: str = "--kv-cache-memory",
) -> KVFit:
    """Size the pool from the workers' report and fit ``max_model_len`` to it.

    Pinned and too large: raise ``KVCacheTooSmallError`` with the numbers and the flags
    that would help. Unpinned: the model's own limit, lowered to what fits (logged). Not
    even one block beside the reserved one: raise, pinned or not.
    """
    bytes_per_block = kv_bytes_per_token * block_size
    num_blocks = usable_kv_bytes // bytes_per_block
    fits = max_len_that_fits(num_blocks, block_size)
    wanted = pinned_max_model_len if pinned_max_model_len is not None else model_max_len
    if wanted <= fits:
        return KVFit(max_model_len=wanted, num_blocks=num_blocks)

    needed_blocks = -(-wanted // block_size) + 1  # + the reserved null block
    needed_gib = needed_blocks * bytes_per_block / GiB
    available_gib = usable_kv_bytes / GiB
    numbers = (
        f"needs {needed_gib:.3f} GiB of KV cache ({needed_blocks} blocks of {block_size} "
        f"tokens, incl. 1 reserved), but only {available_gib:.3f} GiB ({num_blocks} blocks) "
        f"is available; the largest max_model_len that fits is {fits}"
    )
    if fits < block_size:  # pinned or not: no max_model_len would help
        raise KVCacheTooSmallError(
            f"the KV cache holds only {num_blocks} blocks ({available_gib:.3f} GiB; a block "
            f"of {block_size} tokens takes {bytes_per_block / 1024**2:.3f} MiB, and 1 block "
            f"is reserved), not one usable block; give it more memory ({memory_flag})."
        )
    if pinned_max_model_len is not None:
        raise KVCacheTooSmallError(
            f"--max-model-len {pinned_max_model_len} {numbers}. Lower --max-model-len to "
            f"{fits} or less, or give the KV cache more memory ({memory_flag}, a smaller "
            "--dtype, --kv-cache-dtype fp8 on a GPU, or more --tensor-parallel-size)."
        )
    logger.warning(
        "max_model_len auto-fitted from %d to %d (%s; raise %s to keep %d)",
        wanted,
        fits,
        numbers,
        memory_flag,
        wanted,
    )
    return KVFit(max_model_len=fits, num_blocks=num_blocks)


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int
) -> Refusal | None:
    """Everything that would make a request unservable, as one ``Refusal`` naming the
    first field at fault (None = valid). The rules are ``protocol.limits``, the same the
    HTTP frontend applies; this is for clients that talk ZMQ directly."""
    if not prompt_token_ids:
        return Refusal("prompt is empty; send at least one token", "prompt")
    problem = token_id_problem(prompt_token_ids, vocab_size, "prompt")
    if problem is not None:
        return Refusal(problem, "prompt")
    problems = sampling_problems(params)
    if problems and problems[0][0] in LIST_LIMITS:  # too long a list: not walked further
        return Refusal(problems[0][1], problems[0][0])
    for field, token_ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
    ):
        problem = token_id_problem(token_ids, vocab_size, field)
        if problem is not None:
            problems.append((field, problem))
    if problems:
        return Refusal("; ".join(message for _, message in problems), problems[0][0])
    num_prompt_tokens = len(prompt_token_ids)
    message = prompt_too_long_message(num_prompt_tokens, params.max_tokens, max_model_len)
    if message is not None:
        return Refusal(message, "prompt" if num_prompt_tokens >= max_model_len else "max_tokens")
    return None
