"""One chat choice's generated text → OpenAI message pieces.

The text goes through the reasoning parser first (``<think>`` → ``reasoning_content``),
then the tool-call parser sees only the answer after the thinking. The streaming and the
non-streaming endpoint feed the same ``ChoiceOutput``, so a response reads the same
whichever way it was asked for:

* streamed: ``deltas`` gives the chunk ``delta`` objects: ``{"reasoning_content": ...}``,
  ``{"content": ...}``, and per tool call two: its index, id, type and name (arguments
  ``""``), then its arguments (the OpenAI SDKs accumulate them into ``tool_calls``);
* whole: ``message`` gives the assistant message (``content`` null when the model only
  called tools; ``reasoning_content`` present when a reasoning parser is on).

``finish_reason`` "stop" becomes "tool_calls" when the choice called tools.
"""

from __future__ import annotations

from typing import Any

from vtllm.frontend.reasoning import ReasoningParser
from vtllm.frontend.tool_choice import ToolPlan
from vtllm.frontend.tool_parsers import ParsedText


class ChoiceOutput:
    def __init__(
        self, tool_plan: ToolPlan, reasoning_parser: str | None = None, prompt_text: str = ""
    ) -> None:
        self._tools = tool_plan.new_parser()
        self._reasoning = (
            ReasoningParser(reasoning_parser, prompt_text) if reasoning_parser else None
        )
        self.num_tool_calls = 0

    def _split(self, text: str, final: bool) -> tuple[str, ParsedText]:
        """The reasoning and the parsed answer that ``text`` (and the end) made final."""
        reasoning, answer = "", text
        if self._reasoning is not None:
            reasoning, answer = self._reasoning.push(text)
            if final:
                more_reasoning, more_answer = self._reasoning.finish()
                reasoning, answer = reasoning + more_reasoning, answer + more_answer
        if self._tools is None:
            return reasoning, ParsedText(content=answer)
        parsed = self._tools.push(answer)
        if final:
            parsed += self._tools.finish()
        return reasoning, parsed

    def _finish_reason(self, finish_reason: str | None) -> str | None:
        if finish_reason == "stop" and self.num_tool_calls:
            return "tool_calls"
        return finish_reason

    def deltas(
        self, text: str, finish_reason: str | None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The ``delta`` objects for the next ``text`` of the stream (possibly none), and
        the finish_reason to send (``finish_reason`` set: the choice ended)."""
        reasoning, parsed = self._split(text, finish_reason is not None)
        out: list[dict[str, Any]] = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if parsed.content:
            out.append({"content": parsed.content})
        for call in parsed.tool_calls:
            index = self.num_tool_calls
            self.num_tool_calls += 1
            header = {
                "index": index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            arguments = {"index": index, "function": {"arguments": call.arguments}}
            out += [{"tool_calls": [header]}, {"tool_calls": [arguments]}]
        return out, self._finish_reason(finish_reason)

    def message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """The assistant message of a whole choice, and its finish_reason."""
        reasoning, parsed = self._split(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if self._reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if parsed.tool_calls:
            self.num_tool_calls = len(parsed.tool_calls)
            message["content"] = parsed.content or None
            message["tool_calls"] = [call.to_dict() for call in parsed.tool_calls]
        return message, self._finish_reason(finish_reason) or finish_reason
