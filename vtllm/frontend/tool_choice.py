"""``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request → a ToolPlan:
which parser reads the output, and, for a forced choice, the JSON schema the output must
follow.

* ``tool_choice`` absent: ``"auto"`` with tools, ``"none"`` without (OpenAI).
* ``"auto"``: the model may call tools; the ``--tool-call-parser`` (or the format detected
  from the chat template) reads its calls.
* ``"none"``: the tools are still rendered (as OpenAI does); the output is content.
* ``"required"`` / a named function: *enforced* as vLLM does, with structured output: the
  model must write a JSON array of ``{"name", "parameters"}`` (one of the tools each) /
  the named function's arguments object, read back by ``ForcedCallsParser``. These need no
  tool-call parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vtllm.frontend.openai_types import ChatCompletionRequest, bad_request
from vtllm.frontend.tool_parsers import ForcedCallsParser, ToolParser, make_tool_parser


@dataclass
class ToolPlan:
    """What to do with tool calls in this request's output."""

    parser_name: str | None = None  # None: no parsing (unless forced), the text is content
    max_calls: int | None = None  # 1 with parallel_tool_calls=false
    forced_name: str | None = None  # tool_choice names this function
    forced_schema: dict[str, Any] | None = None  # JSON schema of a forced output

    @property
    def forced(self) -> bool:
        return self.forced_schema is not None

    def new_parser(self) -> ToolParser | None:
        if self.forced:
            return ForcedCallsParser(self.forced_name, self.max_calls)
        if self.parser_name is None:
            return None
        return make_tool_parser(self.parser_name, self.max_calls)

    def forced_schema_json(self) -> str | None:
        return None if self.forced_schema is None else json.dumps(self.forced_schema)


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name → function of every well-formed tool. Raises OpenAIError(400) for a tool that
    is not ``{"type": "function", "function": {"name": str, ...}}``."""
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise bad_request(
                'each tool must be {"type": "function", "function": {"name": ..., '
                '"parameters": {...}}}',
                f"tools[{i}]",
            )
        functions[function["name"]] = function
    return functions


def _parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


def required_calls_schema(
    functions: dict[str, dict[str, Any]], max_calls: int | None
) -> dict[str, Any]:
    """The schema of a ``tool_choice: "required"`` output: a non-empty array of calls, each
    one of the tools with its own parameters (vLLM's shape)."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": _parameters_schema(function),
                    },
                    "required": ["name", "parameters"],
                }
                for name, function in functions.items()
            ]
        },
    }
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def plan_tools(
    request: ChatCompletionRequest, tool_call_parser: str | None, can_enforce: bool
) -> ToolPlan:
    """Check ``tools``/``tool_choice`` and decide how the output is read. ``can_enforce``:
    the engine takes a structured-output schema. Raises OpenAIError(400)."""
    tools = request.tools or []
    functions = _functions(tools)
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    max_calls = 1 if request.parallel_tool_calls is False else None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                'a named tool_choice must be {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in functions:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools "
                f"({', '.join(functions) or 'none given'})",
                "tool_choice",
            )
        if not can_enforce:
            # parsed like "auto", not enforced (no structured output in this engine)
            return _auto_plan(tools, tool_call_parser, max_calls)
        return ToolPlan(None, 1, name, _parameters_schema(functions[name]))
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs tools", "tools")
        if not can_enforce:
            raise bad_request(
                "tool_choice 'required' needs structured output, which this engine does "
                "not offer; use 'auto' or name the function",
                "tool_choice",
            )
        return ToolPlan(None, max_calls, None, required_calls_schema(functions, max_calls))
    if choice == "none":
        return ToolPlan()
    if choice != "auto":
        raise bad_request(
            f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}",
            "tool_choice",
        )
    return _auto_plan(tools, tool_call_parser, max_calls)


def _auto_plan(
    tools: list[dict[str, Any]], tool_call_parser: str | None, max_calls: int | None
) -> ToolPlan:
    if not tools:
        raise bad_request("tool_choice asks for tool calls but no tools were given", "tools")
    if tool_call_parser is None:
        raise bad_request(
            "this server cannot read tool calls: the chat template's tool format is not one "
            "it knows; start it with --tool-call-parser hermes|llama3_json|mistral (vLLM's "
            "--enable-auto-tool-choice is accepted too), or send tool_choice 'none' to get "
            "the model's raw text",
            "tools",
        )
    return ToolPlan(tool_call_parser, max_calls)
