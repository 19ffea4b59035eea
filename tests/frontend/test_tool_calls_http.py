"""Hermes tool calls through the HTTP app, read back with the real ``openai`` SDK."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from tests.frontend.conftest import CHATML_TEMPLATE, parse_sse, write_model_dir
from vtllm.config import VtllmConfig
from vtllm.frontend.tokenizer import ModelTokenizer
from vtllm.protocol.messages import StructuredOutputKind

CHAT = "/v1/chat/completions"
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}"
    "{% endif %}" + CHATML_TEMPLATE
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and the time?"}]
OUTPUT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
EXPECTED_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.fixture
def tools_model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tools-model", chat_template=TOOLS_TEMPLATE)


def _config(parser: str | None = "hermes") -> VtllmConfig:
    config = VtllmConfig()
    config.frontend.tool_call_parser = parser
    return config


async def _serve(serve, model_dir: Path, text: str = OUTPUT, parser: str | None = "hermes"):
    return await serve(text=text, config=_config(parser), model_path=model_dir, max_model_len=2048)


def _calls(tool_calls) -> list[tuple[str, object]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


async def test_sync_sdk_gets_tool_calls(serve, tools_model_dir: Path) -> None:
    served = await _serve(serve, tools_model_dir)
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)
    completion = await asyncio.to_thread(
        client.chat.completions.create, model="fake-model", messages=MESSAGES, tools=TOOLS
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert _calls(choice.message.tool_calls) == EXPECTED_CALLS
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c.type == "function" for c in choice.message.tool_calls)
    # the tools reached the chat template
    prompt = ModelTokenizer.from_dir(tools_model_dir).decode(
        served.fake.added[-1].prompt_token_ids, skip_special_tokens=False
    )
    assert '"name": "get_weather"' in prompt


async def test_streaming_sdk_accumulates_tool_calls(serve, tools_model_dir: Path) -> None:
    served = await _serve(serve, tools_model_dir)
    client = openai.AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)
    async with client.chat.completions.stream(
        model="fake-model", messages=MESSAGES, tools=TOOLS
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert _calls(choice.message.tool_calls) == EXPECTED_CALLS

    # the raw chunks: name first (with id and type), then the arguments; no tag as content
    raw = await served.http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS, "stream": True})
    chunks = [json.loads(p) for p in parse_sse(raw.text)[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me look." and "tool_call" not in content
    tool_deltas = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [(t["index"], "id" in t, t["function"].get("name")) for t in tool_deltas] == [
        (0, True, "get_weather"),
        (0, False, None),
        (1, True, "get_time"),
        (1, False, None),
    ]
    assert tool_deltas[0]["function"]["arguments"] == ""
    assert json.loads(tool_deltas[1]["function"]["arguments"]) == {"city": "Paris"}
    finish = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finish[-1] == "tool_calls" and set(finish[:-1]) == {None}


async def test_tool_choice_none_returns_raw_text(serve, tools_model_dir: Path) -> None:
    served = await _serve(serve, tools_model_dir)
    r = await served.http.post(
        CHAT, json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    )
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": OUTPUT}
    assert choice["finish_reason"] == "stop"
    # tools are still shown to the model (OpenAI semantics)
    prompt = ModelTokenizer.from_dir(tools_model_dir).decode(
        served.fake.added[-1].prompt_token_ids, skip_special_tokens=False
    )
    assert "get_weather" in prompt


async def test_named_tool_choice_is_enforced_by_a_schema(serve, tools_model_dir: Path) -> None:
    # the fake engine plays a model that followed the schema: the arguments object
    served = await _serve(serve, tools_model_dir, text='{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named}
    r = await served.http.post(CHAT, json=body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"]
    ] == [("get_weather", {"city": "Paris"})]
    spec = served.fake.added[-1].sampling_params.structured_output
    assert spec.kind == StructuredOutputKind.JSON_SCHEMA
    assert json.loads(spec.spec) == TOOLS[0]["function"]["parameters"]
    # streamed: the call arrives as the two deltas
    raw = await served.http.post(CHAT, json={**body, "stream": True})
    chunks = [json.loads(p) for p in parse_sse(raw.text)[:-1]]
    tool_deltas = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [t["function"].get("name") for t in tool_deltas] == ["get_weather", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_required_tool_choice_is_enforced_by_a_schema(serve, tools_model_dir: Path) -> None:
    output = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    served = await _serve(serve, tools_model_dir, text=output, parser=None)
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    r = await served.http.post(CHAT, json=body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"]
    ]
    assert calls == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    schema = json.loads(served.fake.added[-1].sampling_params.structured_output.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    # parallel_tool_calls: false → at most one item in the schema
    r = await served.http.post(CHAT, json={**body, "parallel_tool_calls": False})
    assert json.loads(served.fake.added[-1].sampling_params.structured_output.spec)["maxItems"] == 1
    # a forced choice and a response_format cannot both fix the output
    r = await served.http.post(CHAT, json={**body, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


async def test_invalid_tool_json_is_content(serve, tools_model_dir: Path) -> None:
    text = "Sure. <tool_call>{broken</tool_call>"
    served = await _serve(serve, tools_model_dir, text=text)
    r = await served.http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS})
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "stop"
    raw = await served.http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS, "stream": True})
    chunks = [json.loads(p) for p in parse_sse(raw.text)[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == text and all("tool_calls" not in c["choices"][0]["delta"] for c in chunks)


async def test_tool_choice_refusals(serve, tools_model_dir: Path) -> None:
    served = await _serve(serve, tools_model_dir)
    cases = [
        ({"tool_choice": "required"}, "tools", "needs tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "each tool must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "auto"}, "tools", "no tools were given"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ]
    for extra, param, words in cases:
        r = await served.http.post(CHAT, json={"messages": MESSAGES, **extra})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert served.fake.added == []


async def test_tools_without_parser_is_400(serve, tools_model_dir: Path) -> None:
    served = await _serve(serve, tools_model_dir, parser=None)
    r = await served.http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 400 and "--tool-call-parser hermes" in r.json()["error"]["message"]
    r = await served.http.post(
        CHAT, json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == OUTPUT


async def test_second_turn_of_a_tool_loop(serve, tmp_path: Path) -> None:
    """The SDK sends the call back (content null, arguments a JSON string) with the tool's
    result: the Qwen3-style template renders both; the parser is detected from it."""
    template = (Path(__file__).parent / "chat_templates" / "qwen3_style.jinja").read_text()
    model_dir = write_model_dir(tmp_path / "qwen-style", chat_template=template)
    served = await _serve(serve, model_dir, parser=None)
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)
    first = await asyncio.to_thread(
        client.chat.completions.create, model="fake-model", messages=MESSAGES, tools=TOOLS
    )
    assistant = first.choices[0].message
    assert _calls(assistant.tool_calls) == EXPECTED_CALLS
    messages = [
        *MESSAGES,
        assistant.model_dump(exclude_none=True),
        *[
            {"role": "tool", "tool_call_id": call.id, "content": f"result of {call.function.name}"}
            for call in assistant.tool_calls
        ],
    ]
    second = await asyncio.to_thread(
        client.chat.completions.create, model="fake-model", messages=messages, tools=TOOLS
    )
    assert second.choices[0].finish_reason == "tool_calls"
    prompt = ModelTokenizer.from_dir(model_dir).decode(
        served.fake.added[-1].prompt_token_ids, skip_special_tokens=False
    )
    assert (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>"
    ) in prompt
    assert (
        "<|im_start|>user\n<tool_response>\nresult of get_weather\n</tool_response>\n"
        "<tool_response>\nresult of get_time\n</tool_response><|im_end|>"
    ) in prompt


async def test_template_without_tools_is_a_400_naming_the_flag(serve, model_dir: Path) -> None:
    served = await _serve(serve, model_dir)  # conftest's ChatML template ignores tools
    r = await served.http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tools"
    assert "does not render `tools`" in error["message"] and "--chat-template" in error["message"]
