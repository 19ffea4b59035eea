"""Incremental detokenization and stop strings, token by token."""

from __future__ import annotations

import pytest

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
