"""``--reasoning-parser``: the parser fed every split of its text, and through the HTTP app
(real openai SDK, FakeEngine) with a Qwen3-style template: thinking in reasoning_content
(streamed as deltas too), out of content, tool calls read after the thinking, an output
format enforced only after </think>."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from tests.frontend.conftest import parse_sse, write_model_dir
from tests.frontend.test_tool_parsers import _splits
from vtllm.config import VtllmConfig
from vtllm.frontend.reasoning import ReasoningParser, expects_thinking

CHAT = "/v1/chat/completions"
TEMPLATES = Path(__file__).parent / "chat_templates"

# (parser, prompt text, output, reasoning, content)
CASES = [
    ("qwen3", "", "<think>Paris is in France.</think>\n\nParis.", "Paris is in France.", "Paris."),
    ("qwen3", "", "Paris, no thinking.", "", "Paris, no thinking."),
    ("qwen3", "", "  <think>\nhm <thin> </thin</think>ok", "hm <thin> </thin", "ok"),
    # the prompt opened the thinking (a thinking-only template)
    ("qwen3", "<|im_start|>assistant\n<think>\n", "x < y</think>Yes", "x < y", "Yes"),
    # enable_thinking=false: an empty block closes the prompt, all is content
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", "Just <b>this</b>", "", "Just <b>this</b>"),
    # never closed (ran out of tokens): all reasoning
    ("qwen3", "", "<think>still thinking", "still thinking", ""),
    ("deepseek_r1", "", "Let me see.</think>\nIt is 4.", "Let me see.", "It is 4."),
    ("deepseek_r1", "", "<think>a</think>b", "a", "b"),
    ("deepseek_r1", "", "no end tag", "no end tag", ""),
]


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), CASES)
def test_every_split_reads_the_same(name, prompt, text, reasoning, content) -> None:
    for pieces in _splits(text):
        parser = ReasoningParser(name, prompt)
        got = [parser.push(piece) for piece in pieces] + [parser.finish()]
        assert "".join(r for r, _ in got) == reasoning, pieces
        assert "".join(c for _, c in got) == content, pieces
        # no piece of a tag ever leaks into either stream
        assert not any("think>" in r or "think>" in c for r, c in got), pieces


def test_expects_thinking() -> None:
    assert expects_thinking("deepseek_r1", "")
    assert expects_thinking("qwen3", "<|im_start|>assistant\n")
    assert not expects_thinking("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningParser("nope")


@pytest.fixture
def think_model_dir(tmp_path: Path) -> Path:
    """The test tokenizer with <think>, </think>, <tool_call>, </tool_call> as added tokens
    (as in Qwen3's vocabulary), and a Qwen3-style template."""
    path = write_model_dir(tmp_path / "think", (TEMPLATES / "qwen3_style.jinja").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.save(str(path / "tokenizer.json"))
    return path


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
OUTPUT = (
    "<think>The user wants the weather. <tool_call> is how I call.</think>\n\n"
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


async def _serve(serve, model_dir: Path, text: str, reasoning: str = "qwen3"):
    config = VtllmConfig()
    config.frontend.reasoning_parser = reasoning
    return await serve(text=text, config=config, model_path=model_dir, max_model_len=2048)


async def test_reasoning_with_tool_calls_whole_and_streamed(serve, think_model_dir: Path) -> None:
    # no --tool-call-parser: hermes is detected from the template
    served = await _serve(serve, think_model_dir, OUTPUT)
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)
    completion = await asyncio.to_thread(
        client.chat.completions.create, model="fake-model", messages=MESSAGES, tools=TOOLS
    )
    choice = completion.choices[0]
    message = choice.message.model_dump()
    assert message["reasoning_content"] == "The user wants the weather. <tool_call> is how I call."
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    assert choice.finish_reason == "tool_calls"

    raw = await served.http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS, "stream": True})
    deltas = [json.loads(p)["choices"][0]["delta"] for p in parse_sse(raw.text)[:-1]]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert len(reasoning) > 1  # streamed as it came, not in one piece
    assert "".join(reasoning) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    names = [t["function"].get("name") for d in deltas for t in d.get("tool_calls", [])]
    assert names == ["get_weather", None]


async def test_no_thinking_and_format_after_thinking(serve, think_model_dir: Path) -> None:
    served = await _serve(serve, think_model_dir, '<think>hm</think>{"a": 1}')
    fmt = {"type": "json_object"}
    r = await served.http.post(CHAT, json={"messages": MESSAGES, "response_format": fmt})
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"a": 1}', "reasoning_content": "hm"}
    spec = served.fake.added[-1].sampling_params.structured_output
    end_id = Tokenizer.from_file(str(think_model_dir / "tokenizer.json")).token_to_id("</think>")
    assert spec.start_after_token_id == end_id  # the grammar waits for the thinking to end
    # enable_thinking=false: the template closes the thinking, the format applies at once
    body = {
        "messages": MESSAGES,
        "response_format": fmt,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = await served.http.post(CHAT, json=body)
    assert r.status_code == 200
    assert served.fake.added[-1].sampling_params.structured_output.start_after_token_id is None


async def test_without_reasoning_parser_thinking_is_content(serve, think_model_dir: Path) -> None:
    served = await _serve(serve, think_model_dir, "<think>hm</think>Hi", reasoning=None)
    r = await served.http.post(CHAT, json={"messages": MESSAGES})
    assert r.json()["choices"][0]["message"] == {
        "role": "assistant",
        "content": "<think>hm</think>Hi",
    }
