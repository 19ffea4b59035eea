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
  several tokens, and holds back only a tail that could still grow into a stop string.
"""

from __future__ import annotations

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
    true and nothing more is emitted."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._text = ""
        self._num_emitted = 0
        self.stopped = False
        self.matched: str | None = None

    def push(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        search_start = max(0, len(self._text) - self._max_len + 1)
        self._text += delta
        if not self._stop:
            return self._emit_until(len(self._text))
        hit_idx, hit = self._first_match(search_start)
        if hit is not None:
            self.stopped = True
            self.matched = hit
            return self._emit_until(hit_idx)
        return self._emit_until(len(self._text) - self._held_back_len())

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit_until(len(self._text))

    def _first_match(self, search_start: int) -> tuple[int, str | None]:
        best_idx, best = len(self._text), None
        for s in self._stop:
            idx = self._text.find(s, search_start)
            if 0 <= idx < best_idx:
                best_idx, best = idx, s
        return best_idx, best

    def _held_back_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _emit_until(self, end: int) -> str:
        end = max(end, self._num_emitted)
        out = self._text[self._num_emitted : end]
        self._num_emitted = end
        return out


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
