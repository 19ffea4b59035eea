"""A full tool loop (call → tool result → final answer) through a real `vtllm serve` with the
embedded SmolLM2 and the real `openai` SDK, streamed and not.

The server runs with no tool flags: SmolLM2 gets vtllm's Hermes-style template and the
hermes parser is detected from it. The 135M model rarely calls a tool on its own, so the
auto turn uses a prompt for which its greedy output is a tool call (checked: it repeats
the block); the required and named turns are enforced by structured output whatever the
model would have said.

The module has its own server without prefix caching. Greedy text from this small model
depends on how its prompt was computed: a prompt whose prefix is cached computes only its
last few tokens, and on CPU those go through the int4 decode step (activations rounded to
8 bits) instead of the float32 prompt path, which moves the first tokens' logits by up to
~0.3 nats. On the shared session server what is cached depends on which modules ran
before on the same xdist worker, and these prompts' greedy outputs flipped with it (a
second call started inside the 40-token limit). Without the cache every prompt here takes
the float32 path, whatever the order.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import openai_client, served_model
from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_dir, vt_cache_dir):
    flags = ("--kv-cache-memory", "512MiB", "--no-enable-prefix-caching")
    with ServerProcess(*flags, cache_dir=vt_cache_dir).serving() as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return served_model(client)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city"}},
                "required": ["city"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": f"Repeat exactly: {CALL}"}]
RESULT = '{"temperature_c": 21, "sky": "sunny"}'
# the call takes ~25 tokens; the final answer only has to be some text
CALL_TOKENS, ANSWER_TOKENS = 40, 12


def _loop_messages(tool_calls: list) -> list:
    """The second turn as an agent sends it: the call back (content null), its result."""
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        *[{"role": "tool", "tool_call_id": c["id"], "content": RESULT} for c in tool_calls],
    ]


def test_tool_loop(client, model):
    kwargs = dict(model=model, tools=TOOLS, temperature=0)
    first = client.chat.completions.create(messages=ASK, max_tokens=CALL_TOKENS, **kwargs)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None

    calls = [c.model_dump() for c in choice.message.tool_calls]
    final = client.chat.completions.create(
        messages=_loop_messages(calls), max_tokens=ANSWER_TOKENS, **kwargs
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert answer.message.content
    # the tool's result reached the prompt: the second prompt is longer by at least it
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_tool_loop_streamed(client, model):
    kwargs = dict(model=model, tools=TOOLS, temperature=0)
    with client.chat.completions.stream(messages=ASK, max_tokens=CALL_TOKENS, **kwargs) as stream:
        events = list(stream)
        first = stream.get_final_completion()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the call came as tool-call deltas, never as content text
    assert not any(e.type == "content.delta" and "tool_call" in e.delta for e in events)

    calls = [c.model_dump(exclude={"parsed_arguments"}) for c in choice.message.tool_calls]
    for c in calls:
        c["function"].pop("parsed_arguments", None)
    chunks = list(
        client.chat.completions.create(
            messages=_loop_messages(calls), stream=True, max_tokens=ANSWER_TOKENS, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice_is_enforced(client, model, tool_choice):
    # a question the model would answer in prose: the grammar makes it a call
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    completion = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=CALL_TOKENS,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"] * len(
        choice.message.tool_calls
    )
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments.get("city"), str)
