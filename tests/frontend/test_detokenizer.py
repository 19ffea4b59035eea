"""Incremental detokenization and stop strings, token by token."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtllm.frontend.detokenizer import IncrementalDetokenizer, OutputText, StopStringMatcher
from vtllm.frontend.tokenizer import ModelTokenizer

MIXED = "Hello world! 你好世界 🙂🎉 the end. Ünïcödé 日本"


def test_incremental_decode_equals_full_decode_without_replacement_chars(
    tokenizer: ModelTokenizer,
) -> None:
    prompt = tokenizer.encode("The quick", add_special_tokens=False)
    ids = tokenizer.encode(MIXED, add_special_tokens=False)
    # precondition: some characters really are split across tokens
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer.decode, prompt)
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == MIXED


def test_incremental_decode_skips_special_tokens(tokenizer: ModelTokenizer) -> None:
    im_end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Hello", add_special_tokens=False)
    ids = [*ids, im_end, *tokenizer.encode(" world", add_special_tokens=False)]
    detok = IncrementalDetokenizer(tokenizer.decode)
    assert "".join(detok.push([i]) for i in ids) == "Hello world"


def _stream(tokenizer: ModelTokenizer, text: str, stop: list[str]) -> tuple[list[str], OutputText]:
    out = OutputText(tokenizer.decode, [], stop)
    deltas = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        deltas.append(out.push([token_id]))
        if out.stopped_by_string:
            break
    else:
        deltas.append(out.finish())
    return deltas, out


@pytest.mark.parametrize("stop", ["world! 你", "op he", "🎉"])
def test_stop_string_across_token_boundaries(tokenizer: ModelTokenizer, stop: str) -> None:
    text = "Hello world! 你好 stop here 🙂🎉 tail"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # precondition: the stop string is not a single token
    assert not any(stop == tokenizer.decode([i]) for i in ids)
    expected = text[: text.index(stop)]
    deltas, out = _stream(tokenizer, text, [stop, "never"])
    assert out.stopped_by_string
    assert "".join(deltas) == expected
    # non-streaming: everything at once gives the same text
    whole = OutputText(tokenizer.decode, [], [stop])
    assert whole.push(ids) + whole.finish() == expected


def test_stop_matcher_holds_back_only_possible_prefixes() -> None:
    matcher = StopStringMatcher(["abc", "xyz"])
    assert matcher.push("hello a") == "hello "  # "a" may start "abc"
    assert matcher.push("bd") == "abd"  # "abd" cannot grow into a stop string
    assert matcher.push("ab") == ""
    assert matcher.push("c and more") == ""
    assert matcher.stopped and matcher.matched == "abc"
    assert matcher.flush() == ""


def test_stop_matcher_flushes_held_text_at_the_end() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.push("the EN") == "the "
    assert matcher.flush() == "EN"


def test_earliest_stop_string_wins() -> None:
    matcher = StopStringMatcher(["cd", "bcdef"])
    assert matcher.push("abcdefg") == "a"
    assert matcher.matched == "bcdef"


def test_stop_token_text_is_not_shown(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    out = OutputText(tokenizer.decode, [], [])
    assert out.push(ids, stop_token_id=ids[-1]) + out.finish() == "Hello"


class _NaiveStopMatcher:
    """The reference: keeps the whole text and searches all of it on every push."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.text = ""
        self.num_emitted = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        search_start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        hits = [(self.text.find(s, search_start), i) for i, s in enumerate(self.stop)]
        hits = [(idx, i) for idx, i in hits if idx >= 0]
        if hits:
            self.stopped = True
            return self._emit(min(hits)[0])
        held = max(
            (k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])),
            default=0,
        )
        return self._emit(len(self.text) - held)

    def flush(self) -> str:
        return "" if self.stopped else self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        end = max(end, self.num_emitted)
        out, self.num_emitted = self.text[self.num_emitted : end], end
        return out


@settings(max_examples=300, deadline=None)
@given(
    stop=st.lists(st.text("abc", min_size=1, max_size=5), max_size=4),
    pieces=st.lists(st.text("abcd", max_size=6), max_size=12),
)
def test_stop_matcher_agrees_with_searching_the_whole_text(stop, pieces) -> None:
    matcher, naive = StopStringMatcher(stop), _NaiveStopMatcher(stop)
    for piece in pieces:
        assert matcher.push(piece) == naive.push(piece), (stop, pieces)
        assert matcher.stopped == naive.stopped
    assert matcher.flush() == naive.flush()


def _scan(num_chars: int, stop: list[str]) -> StopStringMatcher:
    rng = random.Random(0)
    matcher = StopStringMatcher(stop)
    text = "".join(rng.choice("abcdefgh ") for _ in range(num_chars))
    for i in range(0, num_chars, 3):  # about one token's worth of text per push
        matcher.push(text[i : i + 3])
    assert not matcher.stopped
    return matcher


def test_stop_matching_work_is_linear_in_the_output() -> None:
    """Many long stop strings: each push searches only its new text plus the longest
    stop string's length, so the characters scanned grow with the output, not its square
    (2,000 stop strings of 1,000 characters once made a request 3x slower)."""
    rng = random.Random(1)
    stop = ["".join(rng.choice("abcdefgh") for _ in range(100)) + "z" for _ in range(200)]
    short, long = _scan(3_000, stop), _scan(12_000, stop)
    num_pushes = 12_000 // 3
    assert long.num_chars_scanned <= num_pushes * (3 + 100)  # window: delta + longest - 1
    assert long.num_chars_scanned <= 4.1 * short.num_chars_scanned
