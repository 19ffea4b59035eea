"""The rules a request must meet, written once for every frontend and the engine core.

``SAMPLING_RANGES`` bounds each numeric ``SamplingParams`` field. The HTTP frontend builds
its request schema from it (``sampling_meta``: a 400 naming the field, and the ranges in
``/openapi.json``); the engine core checks every request against it again
(``sampling_problems``, in ``engine_core.guards.validate_request``), since clients may talk
ZMQ directly. Token ids are checked against the vocabulary by ``token_id_problem`` and the
context by ``prompt_too_long_message``; ``resolve_max_tokens`` is the one place an unset
``max_tokens`` becomes a number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # top-N logprobs per token, at most


@dataclass(frozen=True)
class Range:
    """Bounds of one number; None = unbounded on that side."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
        )

    def describe(self) -> str:
        """``in [0, 2]``, ``in (0, 1]``, ``>= 0``: for messages."""
        low = self.ge if self.ge is not None else self.gt
        if low is not None and self.le is not None and abs(self.le) < 2**53:
            return f"in {'[' if self.ge is not None else '('}{_num(low)}, {_num(self.le)}]"
        if low is not None:
            return f"{'>=' if self.ge is not None else '>'} {_num(low)}"
        return f"<= {_num(self.le)}" if self.le is not None else "a number"

    def meta(self, **kwargs: Any) -> msgspec.Meta:
        """The same bounds as a msgspec constraint (for decoding and JSON schema)."""
        bounds = {
            k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None
        }
        return msgspec.Meta(**bounds, **kwargs)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# SamplingParams field → its range. Off values: top_k 0 or -1, min_p 0, penalties 0 / 1.
SAMPLING_RANGES: dict[str, Range] = {
    "temperature": Range(ge=0.0, le=2.0),  # 0 = greedy
    "top_p": Range(gt=0.0, le=1.0),
    "top_k": Range(ge=-1, le=INT64_MAX),
    "min_p": Range(ge=0.0, le=1.0),
    "seed": Range(ge=INT64_MIN, le=INT64_MAX),
    "max_tokens": Range(ge=1, le=INT64_MAX),
    "min_tokens": Range(ge=0, le=INT64_MAX),
    "presence_penalty": Range(ge=-2.0, le=2.0),
    "frequency_penalty": Range(ge=-2.0, le=2.0),
    "repetition_penalty": Range(gt=0.0, le=2.0),
    "logprobs": Range(ge=0, le=MAX_LOGPROBS),
}
LOGIT_BIAS_RANGE = Range(ge=-100.0, le=100.0)


def sampling_meta(field: str, **kwargs: Any) -> msgspec.Meta:
    """``msgspec.Meta`` of ``SAMPLING_RANGES[field]`` (extra Meta arguments pass through)."""
    return SAMPLING_RANGES[field].meta(**kwargs)


def sampling_problems(params: Any) -> list[tuple[str, str]]:
    """``(field, message)`` for every field of ``params`` (a ``SamplingParams``) outside its
    range, logit-bias values included; empty when all are in range."""
    problems = []
    for field, bounds in SAMPLING_RANGES.items():
        value = getattr(params, field)
        if value is not None and not bounds.contains(value):
            problems.append((field, f"{field} must be {bounds.describe()}, got {value}"))
    bad_bias = [b for b in params.logit_bias.values() if not LOGIT_BIAS_RANGE.contains(b)]
    if bad_bias:
        problems.append(
            (
                "logit_bias",
                f"logit_bias values must be {LOGIT_BIAS_RANGE.describe()}, got {bad_bias[0]}",
            )
        )
    return problems


def token_id_problem(token_ids: Iterable[int], vocab_size: int, field: str) -> str | None:
    """Why ``token_ids`` are not all ids of a ``vocab_size`` vocabulary; None if they are."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            return (
                f"{field} has the token id {token_id}, outside the vocabulary (ids 0 to "
                f"{vocab_size - 1})"
            )
    return None


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot be served: the message, and the request field at fault."""

    message: str
    param: str | None = None


def resolve_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The output limit of a request: ``max_tokens`` if set, else the room the context
    leaves after the prompt (``max_model_len - num_prompt_tokens``)."""
    return max_tokens if max_tokens is not None else max_model_len - num_prompt_tokens


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
