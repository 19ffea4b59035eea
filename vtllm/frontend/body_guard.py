"""What a JSON request body must pass before it is decoded.

``check_body`` refuses (400, OpenAI shape) a body that is not UTF-8 anywhere (an unknown
key or value included: msgspec skips those without looking) or nests arrays and objects
deeper than ``--max-json-depth``. It never recurses, so a body nested 100k deep costs a
few linear passes over its bytes instead of a ``RecursionError``.
"""

from __future__ import annotations

import re

import numpy as np

from vtllm.frontend.openai_types import OpenAIError, bad_request

# A JSON string: quote, runs of plain characters or escapes, quote (no backtracking).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACES_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_ALL_BUT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes, at_most: int) -> int:
    """The deepest nesting of arrays/objects in ``body`` (strings skipped), computed
    exactly only when it could exceed ``at_most``; otherwise a value <= ``at_most``.
    Brackets of malformed JSON count as they come (the decoder refuses it anyway)."""
    structure = _JSON_STRING.sub(b"", body).translate(_BRACES_AS_BRACKETS, _ALL_BUT_BRACKETS)
    num_opens = structure.count(b"[")
    if num_opens <= at_most:
        return num_opens
    # depth after each bracket: running sum of +1 (open) / -1 (close); C speed, no recursion
    steps = np.frombuffer(structure, dtype=np.uint8) == ord("[")  # [num_brackets]
    depth = np.cumsum(steps.astype(np.int64) * 2 - 1)  # [num_brackets]
    return int(depth.max())


def check_body(body: bytes, max_depth: int) -> None:
    """Raise OpenAIError(400) unless ``body`` is UTF-8 and nests at most ``max_depth``."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"request body is not valid UTF-8 (byte {e.start} of {len(body)}); JSON must "
            "be UTF-8 encoded"
        ) from None
    depth = json_depth(body, max_depth)
    if depth > max_depth:
        raise OpenAIError(
            400,
            f"request body nests JSON {depth} levels deep; at most {max_depth} are accepted "
            "(flatten it or raise --max-json-depth)",
            code="json_too_deep",
        )
