"""Server-side request defaults, as vLLM applies them: the model's
``generation_config.json`` sampling values (``--generation-config``) for the fields a
request leaves unset, and ``--max-logprobs``.

``RequestDefaults.apply`` works on the request body before the endpoint parses it, so
every endpoint (completions, chat) gets the same rule: a field absent or ``null`` takes
the model's value; a field the client set is kept. Bodies are only decoded when there
is something to apply or check.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from vtllm.frontend.openai_types import OpenAIError

logger = logging.getLogger(__name__)

# generation_config.json key → request field (vLLM's get_diff_sampling_param)
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
MAX_LOGPROBS = 20  # the protocol's own limit (protocol/limits.py)


def load_generation_defaults(model_dir: str, mode: str) -> tuple[dict[str, Any], int | None]:
    """(sampling defaults, max_new_tokens) from ``--generation-config``: ``auto`` reads
    the model's generation_config.json, ``vllm`` reads nothing, anything else is a
    directory holding one. A missing file means no defaults. ValueError on a directory
    that does not exist or a file that is not JSON."""
    if mode == "vllm":
        return {}, None
    directory = Path(model_dir) if mode == "auto" else Path(mode).expanduser()
    if mode != "auto" and not directory.is_dir():
        raise ValueError(f"--generation-config {mode!r} is neither auto, vllm nor a directory")
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}, None
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    defaults = {
        request_key: raw[key]
        for key, request_key in SAMPLING_KEYS.items()
        if isinstance(raw.get(key), (int, float)) and not isinstance(raw.get(key), bool)
    }
    max_new = raw.get("max_new_tokens")
    max_new_tokens = max_new if isinstance(max_new, int) and max_new > 0 else None
    if defaults or max_new_tokens:
        shown = {**defaults, **({"max_tokens": max_new_tokens} if max_new_tokens else {})}
        logger.info(
            "sampling defaults from %s: %s (requests that set a field keep theirs; "
            "--generation-config vllm ignores them)",
            path,
            shown,
        )
    return defaults, max_new_tokens


@dataclass
class RequestDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS

    @property
    def active(self) -> bool:
        return bool(self.sampling) or self.max_logprobs < MAX_LOGPROBS

    def apply(self, body: bytes, chat: bool) -> bytes:
        """The body with the defaults filled in; a 400 naming the field when it asks for
        more logprobs than ``--max-logprobs``. Not a JSON object: returned unchanged
        (the endpoint reports it)."""
        if not self.active:
            return body
        try:
            request = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return body
        if not isinstance(request, dict):
            return body
        self._check_logprobs(request, chat)
        missing = {k: v for k, v in self.sampling.items() if request.get(k) is None}
        if not missing:
            return body
        return msgspec.json.encode({**request, **missing})

    def _check_logprobs(self, request: dict[str, Any], chat: bool) -> None:
        key = "top_logprobs" if chat else "logprobs"
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > self.max_logprobs:
            raise OpenAIError(
                400,
                f"{key} {value} is more than this server allows ({self.max_logprobs}, "
                "--max-logprobs)",
                "invalid_request_error",
                param=key,
            )


class _Params(msgspec.Struct):
    n: int = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


_params_decoder = msgspec.json.Decoder(_Params)


def request_params(body: bytes) -> tuple[int, int | None] | None:
    """(n, max_tokens) of a generation request body for the request_params_* metrics
    (``max_completion_tokens`` wins, as in chat); None when the body does not decode
    (the endpoint answers that with a 400)."""
    try:
        params = _params_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return params.n, params.max_completion_tokens or params.max_tokens
