"""Pure request → ``SamplingParams`` pieces: max_tokens resolution and the admission guard.

``max_tokens`` (or ``max_completion_tokens``) absent, null, 0 or negative means "unset":
the serving default (``--default-max-tokens``) if configured, else None so the engine
core resolves it to ``max_model_len - prompt tokens``. There is no hidden small constant.

Every rule here is the protocol's (``protocol/limits.py``), applied early so that a bad
request is a 400 before it reaches the engine core, which checks the same rules again.
Who decides what, once: the engine core decides EOS (its model's eos ids, unless
``ignore_eos``) and ``max_tokens``'s unset value (``limits.resolve_max_tokens``); the
frontend decides stop strings (``detokenizer.StopStringMatcher``: the engine never sees
text).
"""

from __future__ import annotations

from collections.abc import Sequence

from vtllm.frontend.openai_types import OpenAIError, _SamplingFields, bad_request
from vtllm.protocol import limits
from vtllm.protocol.limits import prompt_too_long_message
from vtllm.protocol.messages import SamplingParams


def explicit_max_tokens(requested: int | None) -> int | None:
    """The user's limit if it is a real one (> 0), else None (unset)."""
    return requested if requested is not None and requested > 0 else None


def check_prompt_fits(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    field: str = "max_tokens",
    prompt_field: str = "prompt",
) -> None:
    """Admission guard. Raises OpenAIError(400) naming the prompt tokens, the requested
    output tokens and max_model_len when the prompt leaves no room for output, or when
    prompt + an explicit ``max_tokens`` exceeds ``max_model_len``."""
    if num_prompt_tokens == 0:
        raise bad_request("prompt is empty (0 tokens); send at least one token", prompt_field)
    message = prompt_too_long_message(num_prompt_tokens, max_tokens, max_model_len, field)
    if message is not None:
        param = prompt_field if num_prompt_tokens >= max_model_len else field
        raise OpenAIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def check_prompt_chars(
    num_chars: int, max_chars_per_token: int, max_model_len: int, field: str = "prompt"
) -> None:
    """Refuse, before tokenizing it, a prompt that cannot fit: no token stands for more
    than ``max_chars_per_token`` characters, so ``num_chars`` characters need at least
    ``num_chars / max_chars_per_token`` tokens. Raises OpenAIError(400) naming the numbers."""
    max_chars = max_model_len * max_chars_per_token
    if num_chars > max_chars:
        raise OpenAIError(
            400,
            f"{field} has {num_chars} characters; no token of this model stands for more than "
            f"{max_chars_per_token}, so it needs at least {-(-num_chars // max_chars_per_token)} "
            f"tokens, but max_model_len is {max_model_len} (at most {max_chars} characters); "
            "shorten the prompt or raise --max-model-len",
            "invalid_request_error",
            field,
            "context_length_exceeded",
        )


def resolve_max_tokens(
    requested: int | None,
    default_max_tokens: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
) -> int | None:
    """The ``SamplingParams.max_tokens`` to send: the explicit value, else the serving
    default capped to the room left in the context, else None (engine decides)."""
    explicit = explicit_max_tokens(requested)
    if explicit is not None:
        return explicit
    if default_max_tokens is not None and default_max_tokens > 0:
        room = limits.resolve_max_tokens(None, num_prompt_tokens, max_model_len)
        return max(1, min(default_max_tokens, room))
    return None


def build_sampling_params(
    request: _SamplingFields,
    max_tokens: int | None,
    seed: int | None,
    logprobs: int | None = None,
    logit_bias: dict[int, float] | None = None,
) -> SamplingParams:
    """``SamplingParams`` for one engine request: the request's own values, "off" where it
    left them out. EOS is not added here: the engine core decides it."""
    stop_token_ids = list(request.stop_token_ids or [])
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    return SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=top_k,
        min_p=request.min_p or 0.0,
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=request.ignore_eos,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        logprobs=logprobs,
        logit_bias=logit_bias or {},
    )


def parse_logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """``{"50256": -100}`` → ``{50256: -100.0}``; a key that is not a token id of this
    vocabulary is a 400 naming ``logit_bias``."""
    if not raw:
        return {}
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"logit_bias token id {token_id} is out of range; the vocabulary has "
                f"{vocab_size} tokens",
                "logit_bias",
            )
        bias[token_id] = float(value)
    return bias


def choice_seed(seed: int | None, choice_idx: int) -> int | None:
    """n > 1: each choice gets seed + i (wrapping within int64, the protocol's seed range),
    so choices differ yet stay reproducible."""
    if seed is None:
        return None
    return (seed + choice_idx - limits.INT64_MIN) % 2**64 + limits.INT64_MIN


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str = "prompt") -> None:
    problem = limits.token_id_problem(token_ids, vocab_size, field)
    if problem is not None:
        raise bad_request(problem, field)
