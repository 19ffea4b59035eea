"""What a JSON request body must pass before it is decoded.

``check_body`` refuses (400, OpenAI shape) a body that is not UTF-8 anywhere (an unknown
key or value included: msgspec skips those without looking) or nests arrays and objects
deeper than ``--max-json-depth``. It never recurses, so a body nested 100k deep costs a
few linear passes over its bytes instead of a ``RecursionError``.
"""

from __future__ import annotations

import numpy as np

from vtllm.frontend.openai_types import OpenAIError, bad_request

_QUOTE = ord('"')
_OPENS = (ord("["), ord("{"))
_CLOSES = (ord("]"), ord("}"))
_CHUNK_BYTES = 1 << 20  # bounds the scan's temporaries to a few MiB


def json_depth(body: bytes, at_most: int) -> int:
    """The deepest nesting of arrays/objects in ``body`` (brackets inside strings do not
    count), computed exactly only when it could exceed ``at_most``; otherwise some value
    <= ``at_most``. Linear, no recursion, C speed (bytes methods and numpy, which release
    the GIL on large arrays); malformed JSON gets a number too (the decoder refuses it)."""
    num_opens = body.count(b"[") + body.count(b"{")  # brackets in strings only overcount
    if num_opens <= at_most:
        return num_opens
    # Escapes first, left to right as JSON reads them: then every quote left delimits a
    # string, and the bytes after an odd number of quotes are inside one.
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    chars_all = np.frombuffer(text, dtype=np.uint8)  # [num_bytes]
    quote_parity, depth, deepest = 0, 0, 0
    for start in range(0, len(chars_all), _CHUNK_BYTES):
        chars = chars_all[start : start + _CHUNK_BYTES]  # [chunk]
        # uint8 cumsum wraps mod 256, which keeps the parity
        quotes = np.cumsum(chars == _QUOTE, dtype=np.uint8) + quote_parity  # [chunk]
        outside = (quotes & 1) == 0  # [chunk]
        opens = ((chars == _OPENS[0]) | (chars == _OPENS[1])) & outside
        closes = ((chars == _CLOSES[0]) | (chars == _CLOSES[1])) & outside
        steps = opens.astype(np.int32) - closes  # [chunk], +1 / -1 / 0
        steps = steps[steps != 0]  # [num_brackets_in_chunk]
        if steps.size:
            levels = np.cumsum(steps) + depth
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
        quote_parity = int(quotes[-1]) & 1
    return deepest


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
