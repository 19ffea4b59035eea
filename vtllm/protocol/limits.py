"""The rules a request must meet, written once for every frontend and the engine core.

``SAMPLING_RANGES`` bounds each numeric ``SamplingParams`` field. The HTTP frontend builds
its request schema from it (``sampling_meta``: a 400 naming the field, and the ranges in
``/openapi.json``); the engine core checks every request against it again
(``sampling_problems``, in ``engine_core.guards.validate_request``), since clients may talk
ZMQ directly. Token ids are checked against the vocabulary by ``token_id_problem`` and the
context by ``prompt_too_long_message``; ``resolve_max_tokens`` is the one place an unset
``max_tokens`` becomes a number.

``MAX_STRUCTURED_OUTPUT_CHARS`` bounds a structured-output spec (``structured_output_problem``,
checked by the frontend and, through ``sampling_problems``, by the engine core).

``LIST_LIMITS`` bounds how many entries a request's lists hold (stop strings, stop token
ids, logit-bias entries) and ``MAX_STOP_STRING_CHARS`` how long one stop string is; the
HTTP schema takes them through ``list_meta`` / ``STOP_STRING_META``, the engine core
through ``sampling_problems``. They cap per-request work that would otherwise grow with
what one client sends. Each default can be changed by an environment variable
(``docs/ENVIRONMENT.md``), read once at import.

Temperatures below ``GREEDY_TEMPERATURE`` are greedy (``effective_temperature``, the one
place that decides it; the sampler applies it): dividing logits by such a temperature
overflows float32 and would draw garbage, as vLLM also avoids.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from vtllm import envs

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
# Temperatures below this are greedy (as in vLLM): logits / 1e-38 overflow float32.
GREEDY_TEMPERATURE = 1e-5


def effective_temperature(temperature: float) -> float:
    """The temperature the sampler uses: 0.0 (greedy) below ``GREEDY_TEMPERATURE``."""
    return 0.0 if temperature < GREEDY_TEMPERATURE else temperature


@dataclass(frozen=True)
class ListLimit:
    """Most entries of one request list, and the variable that changes it."""

    max_entries: int
    env: str


# Request list → its bound (SamplingParams field names; "stop" is the HTTP stop strings,
# which the frontend matches itself and never sends to the engine core).
LIST_LIMITS: dict[str, ListLimit] = {
    "stop": ListLimit(envs.VT_MAX_STOP_STRINGS, "VT_MAX_STOP_STRINGS"),
    "stop_token_ids": ListLimit(envs.VT_MAX_STOP_TOKEN_IDS, "VT_MAX_STOP_TOKEN_IDS"),
    "logit_bias": ListLimit(envs.VT_MAX_LOGIT_BIAS_ENTRIES, "VT_MAX_LOGIT_BIAS_ENTRIES"),
}
MAX_STOP_STRING_CHARS: int = envs.VT_MAX_STOP_STRING_CHARS
STOP_STRING_META = msgspec.Meta(
    max_length=MAX_STOP_STRING_CHARS,
    description=f"At most {MAX_STOP_STRING_CHARS} characters (VT_MAX_STOP_STRING_CHARS).",
)


# The longest structured-output spec (JSON schema, regex, choice list or EBNF grammar), in
# characters: compiling a grammar costs time and memory that grow with its size.
MAX_STRUCTURED_OUTPUT_CHARS = 65536


def structured_output_problem(spec: str, field: str = "structured_output") -> str | None:
    """Why a structured-output ``spec`` string is too long; None if it is not."""
    if len(spec) <= MAX_STRUCTURED_OUTPUT_CHARS:
        return None
    return (
        f"{field} has {len(spec)} characters, more than the {MAX_STRUCTURED_OUTPUT_CHARS} "
        "allowed for a schema, regex, choice list or grammar; send a smaller one"
    )


def list_meta(field: str) -> msgspec.Meta:
    """``msgspec.Meta`` bounding the length of the request list ``field``."""
    limit = LIST_LIMITS[field]
    return msgspec.Meta(
        max_length=limit.max_entries,
        description=f"At most {limit.max_entries} entries ({limit.env}).",
    )


def list_problem(field: str, num_entries: int) -> str | None:
    """Why ``num_entries`` entries are too many for ``field``; None if they are not."""
    limit = LIST_LIMITS[field]
    if num_entries <= limit.max_entries:
        return None
    return (
        f"{field} has {num_entries} entries, more than the {limit.max_entries} allowed; "
        f"send fewer (the server's limit is {limit.env})"
    )


def sampling_meta(field: str, **kwargs: Any) -> msgspec.Meta:
    """``msgspec.Meta`` of ``SAMPLING_RANGES[field]`` (extra Meta arguments pass through)."""
    return SAMPLING_RANGES[field].meta(**kwargs)


def sampling_problems(params: Any) -> list[tuple[str, str]]:
    """``(field, message)`` for every field of ``params`` (a ``SamplingParams``) outside its
    range (NaN and infinities never are), logit-bias values included, and every list of
    ``params`` longer than ``LIST_LIMITS`` allows; empty when all are in range."""
    problems = []
    for field in ("stop_token_ids", "logit_bias"):
        problem = list_problem(field, len(getattr(params, field)))
        if problem is not None:
            return [(field, problem)]  # before walking a list that may be huge
    structured = getattr(params, "structured_output", None)
    if structured is not None:
        problem = structured_output_problem(structured.spec)
        if problem is not None:
            problems.append(("structured_output", problem))
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


def request_id_problem(request_id: str, max_bytes: int) -> str | None:
    """Why ``request_id`` is too long (it is echoed in every output of its request);
    None if it is not."""
    num_bytes = len(request_id.encode("utf-8", "surrogatepass"))
    if num_bytes <= max_bytes:
        return None
    return (
        f"request id has {num_bytes} bytes, more than the {max_bytes} allowed (it is echoed "
        "in every output); send a shorter id (the engine core's --max-request-id-bytes)"
    )


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
