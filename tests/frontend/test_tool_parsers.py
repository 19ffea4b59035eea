"""The Hermes tool-call parser, fed every way a token stream can split its text."""

from __future__ import annotations

import json

import pytest

from vtllm.frontend.tool_parsers import HermesToolParser, ParsedText

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
TIME = '{"name": "get_time", "arguments": {}}'

# (model output, expected content, expected [(name, arguments as a dict)])
CASES = [
    ("Just text, no tools. ", "Just text, no tools. ", []),
    (
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "°C"})],
    ),
    (
        f"<tool_call>{WEATHER}</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
        "",
        [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})],
    ),
    # invalid JSON inside the tag: the whole tag comes back as content
    ("Hi <tool_call>{not json}</tool_call> bye", "Hi <tool_call>{not json}</tool_call> bye", []),
    # a valid call, then a broken one: the call is kept, the broken tag is content
    (
        f"<tool_call>{TIME}</tool_call>\n<tool_call>[1, 2]</tool_call>",
        "\n<tool_call>[1, 2]</tool_call>",
        [("get_time", {})],
    ),
    # the output ended before the closing tag
    (f"<tool_call>{TIME}", "", [("get_time", {})]),
    ('Oops <tool_call>{"name": ', 'Oops <tool_call>{"name": ', []),
    # things that look like the tag but are not
    ("a <tool> b <tool_cal c < d", "a <tool> b <tool_cal c < d", []),
    # arguments already a JSON string, and "parameters" as the key
    (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "g", "parameters": {"y": [2]}}</tool_call>',
        "",
        [("f", {"x": 1}), ("g", {"y": [2]})],
    ),
    # text after a call is content too
    (f"<tool_call>{TIME}</tool_call>\n\nDone.", "\n\nDone.", [("get_time", {})]),
]


def _feed(parser: HermesToolParser, pieces: list[str]) -> tuple[list[str], ParsedText]:
    contents, total = [], ParsedText()
    for piece in pieces:
        parsed = parser.push(piece)
        contents.append(parsed.content)
        total += parsed
    parsed = parser.finish()
    contents.append(parsed.content)
    total += parsed
    return contents, total


def _calls(parsed: ParsedText) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def _splits(text: str):
    yield [text]
    yield list(text)  # one character per token
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i in range(1, len(text), 3):
        for j in range(i + 1, len(text), 5):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_split_parses_the_same(text: str, content: str, calls: list) -> None:
    for pieces in _splits(text):
        contents, parsed = _feed(HermesToolParser(), pieces)
        assert parsed.content == content, pieces
        assert _calls(parsed) == calls, pieces
        # content pieces never carry the tag of a call that parsed
        if calls and "<tool_call>" not in content:
            assert not any("<tool_call" in c or "tool_call>" in c for c in contents), pieces


def test_tool_call_shape() -> None:
    parser = HermesToolParser()
    parsed = parser.push(f"<tool_call>{WEATHER}</tool_call>")
    (call,) = parsed.tool_calls
    assert call.id.startswith("call_") and len(call.id) > len("call_")
    assert call.to_dict() == {
        "id": call.id,
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "°C"}',
        },
    }
    second = HermesToolParser().push(f"<tool_call>{WEATHER}</tool_call>").tool_calls[0]
    assert second.id != call.id


def test_content_streams_before_the_tag_closes() -> None:
    parser = HermesToolParser()
    assert parser.push("Let me check").content == "Let me check"
    assert parser.push(" the <tool").content == " the"  # "<tool" may start a tag
    assert parser.push("_call>{").content == ""
    parsed = parser.push('"name": "get_time"}</tool_call>')
    assert parsed.content == "" and [c.name for c in parsed.tool_calls] == ["get_time"]


def test_max_calls_keeps_the_first() -> None:
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    _, parsed = _feed(HermesToolParser(max_calls=1), [text])
    assert [c.name for c in parsed.tool_calls] == ["get_weather"] and parsed.content == ""


@pytest.mark.parametrize(
    "body", ['{"arguments": {}}', '{"name": 3}', '{"name": "f", "arguments": 7}']
)
def test_not_a_call_is_content(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    _, parsed = _feed(HermesToolParser(), [text])
    assert parsed.tool_calls == [] and parsed.content == text
