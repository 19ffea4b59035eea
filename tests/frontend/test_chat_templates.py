"""Chat templates written for the tests after the popular families (Qwen3, Llama 3.1,
Mistral) render a whole tool loop as OpenAI clients send it; templates that cannot show
tools are refused with the fix; --chat-template; SmolLM2's shipped replacement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frontend.conftest import CHATML_TEMPLATE, write_model_dir
from vtllm.frontend.chat_template import (
    detect_tool_parser,
    load_chat_template,
    shipped_template,
)
from vtllm.frontend.tokenizer import ChatTemplateError, ModelTokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# the second turn of a tool loop, exactly as the openai SDK sends it back
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def _tokenizer(tmp_path: Path, template: str) -> ModelTokenizer:
    return ModelTokenizer.from_dir(write_model_dir(tmp_path / "m", chat_template=template))


@pytest.mark.parametrize(
    ("name", "call_text", "result_text", "parser"),
    [
        (
            "qwen3_style",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            '<tool_response>\n{"temp_c": 21}\n</tool_response>',
            "hermes",
        ),
        (
            "llama3_style",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            # as Llama 3.1's own template: a string result is tojson'ed (quoted)
            '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp_c\\": 21}"<|eot_id|>',
            "llama3_json",
        ),
        (
            "mistral_style",
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"}]',
            '[TOOL_RESULTS] {"content": "{\\"temp_c\\": 21}", "call_id": "call_1"}[/TOOL_RESULTS]',
            "mistral",
        ),
    ],
)
def test_family_templates_render_a_tool_loop(
    tmp_path: Path, name: str, call_text: str, result_text: str, parser: str
) -> None:
    template = (TEMPLATES / f"{name}.jinja").read_text()
    tok = _tokenizer(tmp_path, template)
    text = tok.render_chat(LOOP, tools=TOOLS)
    # the call's arguments arrive as an object (string arguments would be quoted twice)
    assert call_text in text and result_text in text
    assert '"get_weather"' in text.split(call_text)[0]  # the tools were shown first
    assert detect_tool_parser(template) == parser
    # the caller's messages are not modified
    assert LOOP[1]["content"] is None and isinstance(
        LOOP[1]["tool_calls"][0]["function"]["arguments"], str
    )


def test_template_without_tools_is_refused_with_the_fix(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, CHATML_TEMPLATE)
    assert detect_tool_parser(CHATML_TEMPLATE) is None
    with pytest.raises(ChatTemplateError, match="does not render `tools`.*--chat-template"):
        tok.render_chat(LOOP[:1], tools=TOOLS)
    with pytest.raises(ChatTemplateError, match="does not render assistant `tool_calls`"):
        tok.render_chat(LOOP)
    assert "Weather in Paris?" in tok.render_chat(LOOP[:1])  # no tools: fine


def test_chat_template_flag_file_or_text(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "m", chat_template=CHATML_TEMPLATE)
    qwen = TEMPLATES / "qwen3_style.jinja"
    from_file = ModelTokenizer.from_dir(model, str(qwen))
    from_text = ModelTokenizer.from_dir(model, qwen.read_text())
    assert from_file.chat_template == from_text.chat_template == qwen.read_text()
    assert from_file.chat_template_origin == "--chat-template"
    assert "<tools>" in from_file.render_chat(LOOP, tools=TOOLS)
    with pytest.raises(ValueError, match="--chat-template .*no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template is not a valid Jinja"):
        load_chat_template("{% for %}")


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke\nwith two lines."},
    ],
]


def test_smollm2_gets_the_shipped_hermes_template(smollm2_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(smollm2_dir)
    assert tok.chat_template_origin == "vtllm's smollm2_hermes.jinja"
    assert tok.chat_template == shipped_template("smollm2_hermes.jinja")
    assert detect_tool_parser(tok.chat_template) == "hermes"
    original = json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    own = ModelTokenizer.from_dir(smollm2_dir, original)  # the model's template, as given
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            assert tok.render_chat(messages, add_generation_prompt) == own.render_chat(
                messages, add_generation_prompt
            )
    text = tok.render_chat(LOOP, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
        '{"temp_c": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    ) in text
    # tools make the prompt longer: they reach the model (the issue: 37 tokens either way)
    plain = tok.encode(tok.render_chat(LOOP[:1]), add_special_tokens=False)
    with_tools = tok.encode(tok.render_chat(LOOP[:1], tools=TOOLS), add_special_tokens=False)
    assert len(with_tools) > len(plain) + 50


def test_bad_chat_template_flag_is_a_usage_error(tmp_path: Path, capsys) -> None:
    from vtllm.cli import main

    for value, words in [
        (str(tmp_path / "missing.jinja"), "no such file"),
        ("{% for %}", "not a valid Jinja template"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--chat-template", value])
        assert exc.value.code == 2
        assert words in capsys.readouterr().err
