"""Token ids → text, one request at a time, as the tokens arrive.

Two small pure pieces, combined by ``OutputText``:

* ``IncrementalDetokenizer``: emits only text that can no longer change. A character
  whose UTF-8 bytes are split across tokens decodes to U+FFFD until its last byte
  arrives, so text ending in U+FFFD is held back (the prefix/read offsets of vLLM and the
  HF text streamer)::

      tokens:   ... p p p p r r r n
                    ^prefix  ^read   (n = new token)
      delta = decode(tokens[prefix:]) minus decode(tokens[prefix:read])

* ``StopStringMatcher``: cuts the output at the first stop string, even one spread over
  several tokens, and holds back only a tail that could still grow into a stop string;
  its work per push does not grow with the output (linear in the output overall).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

# Prompt tokens to decode in front of the first output token, so that tokenizers which
# drop a leading space at the start of a decode (SentencePiece) space the first word right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Per-request detokenizer. ``decode`` must skip special tokens if they are to be
    skipped; ``push`` returns the text that became final with the new tokens."""

    def __init__(self, decode: DecodeFn, prompt_token_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def push(self, new_token_ids: Sequence[int]) -> str:
        out = []
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            out.append(self._step())
        return "".join(out)

    def _step(self) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            return full_text[len(prefix_text) :]
        return ""


class StopStringMatcher:
    """Cuts generated text at the first of ``stop`` (the stop string itself is dropped).

    ``push(delta)`` returns the text that is safe to emit now; ``flush()`` returns what was
    held back, once the request ended for another reason. After a match, ``stopped`` is
    true and nothing more is emitted. When several stop strings occur in the text a push
    brings, the one that starts first wins (on a tie, the first in ``stop``).

    The work of a push is bounded by the stop strings, never by the output so far: only
    the new text plus the ``longest - 1`` characters before it are searched (a stop
    string that ended earlier was found then), and only that tail is kept::

        text:   ...emitted........|held|new delta|
                        window =  |  tail   |new delta|     tail = last (longest - 1)

    The held-back part (the longest end of the text that is a proper prefix of a stop
    string) is found by binary search among the sorted stop strings.
    ``num_chars_scanned`` counts the characters every push searched.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._sorted = sorted(set(self._stop))
        self._first_chars = {s[0] for s in self._stop}
        self._keep = max((len(s) for s in self._stop), default=1) - 1
        self._tail = ""  # the last ``_keep`` characters of the text so far
        self._num_held = 0  # characters at the end of ``_tail`` not emitted yet
        self.stopped = False
        self.matched: str | None = None
        self.num_chars_scanned = 0

    def push(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        if not self._stop:
            return delta
        window = self._tail + delta
        self.num_chars_scanned += len(window)
        start = len(self._tail) - self._num_held  # the first character not emitted
        hit_idx, hit = self._first_match(window)
        if hit is not None:
            self.stopped = True
            self.matched = hit
            self._tail, self._num_held = "", 0
            return window[start : max(start, hit_idx)]
        num_held = self._held_back_len(window)
        out = window[start : max(start, len(window) - num_held)]
        self._tail = window[max(0, len(window) - self._keep) :]
        self._num_held = num_held
        return out

    def flush(self) -> str:
        if self.stopped or not self._num_held:
            return ""
        out = self._tail[len(self._tail) - self._num_held :]
        self._num_held = 0
        return out

    def _first_match(self, window: str) -> tuple[int, str | None]:
        best_idx, best = len(window), None
        for s in self._stop:
            idx = window.find(s)
            if 0 <= idx < best_idx:
                best_idx, best = idx, s
        return best_idx, best

    def _held_back_len(self, window: str) -> int:
        """Length of the longest end of ``window`` (at most ``longest - 1`` characters)
        that is a proper prefix of a stop string; ``window`` holds no whole one."""
        for idx in range(max(0, len(window) - self._keep), len(window)):
            if window[idx] not in self._first_chars:
                continue
            suffix = window[idx:]
            # stop strings that start with ``suffix`` sort right at or after it
            i = bisect.bisect_left(self._sorted, suffix)
            if i < len(self._sorted) and self._sorted[i].startswith(suffix):
                return len(window) - idx
        return 0


class OutputText:
    """The text side of one request: detokenize, then cut stop strings.

    ``push(new_token_ids, stop_token_id)`` returns the next text delta; a stop token's own
    text is never shown (it ended the request). ``finish()`` returns held-back text."""

    def __init__(
        self, decode: DecodeFn, prompt_token_ids: Sequence[int], stop: Sequence[str]
    ) -> None:
        self._detok = IncrementalDetokenizer(decode, prompt_token_ids)
        self._stop = StopStringMatcher(stop)

    @property
    def stopped_by_string(self) -> bool:
        return self._stop.stopped

    def push(self, new_token_ids: Sequence[int], stop_token_id: int | None = None) -> str:
        ids = list(new_token_ids)
        if stop_token_id is not None and ids and ids[-1] == stop_token_id:
            ids.pop()
        return self._stop.push(self._detok.push(ids))

    def finish(self) -> str:
        return self._stop.flush()
