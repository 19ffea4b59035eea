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
# +1 for a bracket or brace that opens, -1 for one that closes, 0 for any other byte
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CHUNK_BYTES = 1 << 20  # bounds the scan's temporaries to a few MiB


def json_nesting_over(body: bytes, max_depth: int) -> int | None:
    """None when ``body`` nests arrays/objects at most ``max_depth`` deep (brackets inside
    strings do not count); otherwise a depth above ``max_depth`` that it reaches (the scan
    stops in the first 1 MiB chunk that goes past the limit). Linear, no recursion, C speed
    (bytes methods and numpy, which releases the GIL); malformed JSON is scanned as it comes
    (the decoder refuses it afterwards)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return None  # brackets in strings only overcount: nothing to scan
    # Escapes first, left to right as JSON reads them: then every quote left delimits a
    # string, and the bytes after an odd number of quotes are inside one.
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in body else body
    chars_all = np.frombuffer(text, dtype=np.uint8)  # [num_bytes]
    quote_parity, depth = 0, 0
    for start in range(0, len(chars_all), _CHUNK_BYTES):
        chars = chars_all[start : start + _CHUNK_BYTES]  # [chunk]
        # uint8 cumsum wraps mod 256, which keeps the parity
        quotes = np.cumsum(chars == _QUOTE, dtype=np.uint8) + quote_parity  # [chunk]
        steps = _STEP[chars] * ((quotes & 1) == 0)  # [chunk]: +1 / -1 outside strings, else 0
        steps = steps[steps != 0]  # [num_brackets_in_chunk]
        if steps.size:
            levels = np.cumsum(steps, dtype=np.int64) + depth  # [num_brackets_in_chunk]
            deepest = int(levels.max())
            if deepest > max_depth:
                return deepest
            depth = int(levels[-1])
        quote_parity = int(quotes[-1]) & 1
    return None


def check_body(body: bytes, max_depth: int) -> None:
    """Raise OpenAIError(400) unless ``body`` is UTF-8 and nests at most ``max_depth``."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"request body is not valid UTF-8 (byte {e.start} of {len(body)}); JSON must "
            "be UTF-8 encoded"
        ) from None
    depth = json_nesting_over(body, max_depth)
    if depth is not None:
        raise OpenAIError(
            400,
            f"request body nests JSON deeper than {max_depth} levels ({depth} seen); flatten "
            "it or raise --max-json-depth",
            code="json_too_deep",
        )
