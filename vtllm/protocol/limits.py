"""Admission rules shared by every frontend and the engine core (one wording, one rule)."""

from __future__ import annotations


def prompt_too_long_message(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    field: str = "max_tokens",
) -> str | None:
    """Why a prompt of ``num_prompt_tokens`` with ``max_tokens`` (None = unset) cannot be
    served within ``max_model_len``, naming the numbers and what to change; None if it can.
    """
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        return (
            f"prompt has {num_prompt_tokens} tokens and {field} is {max_tokens}, together "
            f"{num_prompt_tokens + max_tokens}, but max_model_len is {max_model_len}; "
            f"shorten the prompt, lower {field}, or raise --max-model-len"
        )
    if num_prompt_tokens >= max_model_len:
        return (
            f"prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len} "
            "(room is needed for at least one output token); shorten the prompt or raise "
            "--max-model-len"
        )
    return None
