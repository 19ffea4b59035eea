"""The Llama 3 JSON, Mistral and forced-call parsers, fed every way a token stream can
split their text; and the Hermes parser's list bodies (SmolLM2's own format)."""

from __future__ import annotations

import json

import pytest

from tests.frontend.test_tool_parsers import _calls, _feed, _splits
from vtllm.frontend.tool_parsers import (
    ForcedCallsParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    make_tool_parser,
)

WEATHER = {"city": "Paris", "unit": "°C"}

LLAMA3_CASES = [
    ("The capital is Paris.", "The capital is Paris.", []),
    (
        '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, "}"]}}',
        "",
        [("a", {}), ("b", {"x": [1, "}"]})],
    ),
    # JSON that is not a call, and a brace later in the text, are content
    ('{"answer": 42}', '{"answer": 42}', []),
    ("{ not json at all", "{ not json at all", []),
    ("Use {name} here", "Use {name} here", []),
    # a call, then text: the text is content
    ('{"name": "a", "parameters": {}}\nDone', "\nDone", [("a", {})]),
    # trailing whitespace after the last call is dropped
    ('  {"name": "a", "parameters": {}}\n\n', "", [("a", {})]),
]

MISTRAL_CASES = [
    ("Plain answer [1].", "Plain answer [1].", []),
    (
        'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "t", "arguments": {}}]',
        "Let me check.",
        [("get_weather", WEATHER), ("t", {})],
    ),
    # the [TOOL_CALLS] special token dropped by the detokenizer
    ('[{"name": "t", "arguments": {"a": "]"}}]', "", [("t", {"a": "]"})]),
    # tokenizer v11+: name[ARGS]{...} per call
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]t[ARGS]{}',
        "",
        [("get_weather", {"city": "Paris"}), ("t", {})],
    ),
    ("Sure. \n[TOOL_CALLS][]", "Sure.", []),
    ("Sure. [TOOL_CALLS]t[ARGS]{} ", "Sure.", [("t", {})]),
    ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("[Note: none]", "[Note: none]", []),
    ("Hm. \n[TOOL_CALLS]not a call!", "Hm. \n[TOOL_CALLS]not a call!", []),
    ("[TOOL_CALLS]not a call!", "[TOOL_CALLS]not a call!", []),
]


def _check_every_split(make, text, content, calls) -> None:
    for pieces in _splits(text):
        contents, parsed = _feed(make(), pieces)
        assert parsed.content == content, pieces
        assert _calls(parsed) == calls, pieces


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_CASES)
def test_llama3_json_every_split(text: str, content: str, calls: list) -> None:
    _check_every_split(Llama3JsonToolParser, text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL_CASES)
def test_mistral_every_split(text: str, content: str, calls: list) -> None:
    _check_every_split(MistralToolParser, text, content, calls)


def test_hermes_list_body_is_several_calls() -> None:
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>'
    _check_every_split(HermesToolParser, text, "", [("a", {}), ("b", {"x": 1})])
    _, parsed = _feed(HermesToolParser(max_calls=1), [text])
    assert _calls(parsed) == [("a", {})]


def test_leading_json_call_streams_before_the_output_ends() -> None:
    parser = Llama3JsonToolParser()
    assert parser.push('{"name": "a", "parameters": {"x"').tool_calls == []
    parsed = parser.push(': 1}}; {"name"')
    assert _calls(parsed) == [("a", {"x": 1})] and parsed.content == ""
    parser = MistralToolParser()
    assert parser.push("Sure. [TOOL").content == "Sure."
    parsed = parser.push('_CALLS][{"name": "t", "arguments": {}}]')
    assert _calls(parsed) == [("t", {})]


def test_max_calls_applies_to_every_format() -> None:
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'
    _, parsed = _feed(Llama3JsonToolParser(max_calls=1), [text])
    assert _calls(parsed) == [("a", {})] and parsed.content == ""
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    _, parsed = _feed(MistralToolParser(max_calls=1), [text])
    assert _calls(parsed) == [("a", {})]


def test_forced_calls() -> None:
    _, parsed = _feed(ForcedCallsParser("get_weather"), list('{"city": "Paris"}'))
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})] and parsed.content == ""
    required = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    _, parsed = _feed(ForcedCallsParser(), [required])
    assert _calls(parsed) == [("a", {"x": 1}), ("b", {})]
    _, parsed = _feed(ForcedCallsParser(max_calls=1), [required])
    assert _calls(parsed) == [("a", {"x": 1})]
    # cut short by max_tokens: the text is content
    _, parsed = _feed(ForcedCallsParser("f"), ['{"city": "Pa'])
    assert parsed.tool_calls == [] and parsed.content == '{"city": "Pa'


def test_unknown_parser_names_the_choices() -> None:
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral"):
        make_tool_parser("nope")
