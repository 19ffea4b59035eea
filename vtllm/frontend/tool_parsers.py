"""Tool calls in generated text → OpenAI ``tool_calls``.

One parser per choice, fed the text as it streams (``push``) and told when it ends
(``finish``). Both the streaming and the non-streaming chat endpoint use the same parser,
so a response reads the same whichever way it was asked for.

Hermes format (Qwen, Hermes, SmolLM2 and most ChatML tool-use templates)::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* Text outside the tags is content; the whitespace right around a tool call is dropped.
* A tag's JSON must be an object with a string ``name``; ``arguments`` (or
  ``parameters``) may be an object (re-encoded as a JSON string) or already a string. A tag
  whose JSON is not that comes back verbatim as content, nothing is lost.
* A call is only emitted once its closing tag arrives (or the output ends), so that an
  invalid one can still turn into content: a streamed call comes as its name, then its
  arguments, never half of either.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedText:
    """What one ``push``/``finish`` made final: content text and complete tool calls."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ParsedText) -> ParsedText:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call_from_json(body: str) -> ToolCall | None:
    """The call a tag's body describes, or None if it is not a valid Hermes call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, (dict, list)):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ToolCall(new_tool_call_id(), obj["name"], text)


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesToolParser:
    """Streaming parser of ``<tool_call>{json}</tool_call>`` blocks.

    ``max_calls`` (1 for ``parallel_tool_calls: false``) keeps the first calls only; the
    later ones are dropped, as the model was asked not to make them."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        self._max_calls = max_calls
        self._buffer = ""  # text not yet emitted nor parsed
        self._inside = False  # between a START and its END
        self._ws_before_tag = ""  # whitespace in front of the open tag
        self._after_call = False  # only whitespace since the last valid call
        self.num_calls = 0

    def push(self, text: str) -> ParsedText:
        self._buffer += text
        out = ParsedText()
        while True:
            if self._inside:
                end_idx = self._buffer.find(self.END)
                if end_idx < 0:
                    return out
                body = self._buffer[:end_idx]
                self._buffer = self._buffer[end_idx + len(self.END) :]
                self._inside = False
                out += self._close_tag(body, closed=True)
                continue
            start_idx = self._buffer.find(self.START)
            if start_idx < 0:
                keep = _partial_prefix_len(self._buffer, self.START)
                out.content += self._emit_outside(len(self._buffer) - keep)
                return out
            out.content += self._emit_outside(start_idx)
            # what remains in front of the tag is whitespace; it goes with the tag
            start_idx = self._buffer.find(self.START)
            self._ws_before_tag = self._buffer[:start_idx]
            self._buffer = self._buffer[start_idx + len(self.START) :]
            self._inside = True

    def finish(self) -> ParsedText:
        """The output ended: an unclosed tag is parsed as if closed (a model may stop on
        ``</tool_call>`` or run out of tokens), held-back text is released."""
        out = ParsedText()
        if self._inside:
            body, self._buffer, self._inside = self._buffer, "", False
            out += self._close_tag(body, closed=False)
        elif self._buffer:
            text, self._buffer = self._buffer, ""
            if not (self._after_call and not text.strip()):
                out.content += text
        return out

    def _emit_outside(self, end: int) -> str:
        """Emit ``buffer[:end]`` except its trailing whitespace, which waits to see whether
        a tool call (drop it) or more text (emit it) follows."""
        text = self._buffer[:end]
        stripped = text.rstrip()
        if not stripped:
            return ""
        self._buffer = self._buffer[len(stripped) :]
        self._after_call = False
        return stripped

    def _close_tag(self, body: str, closed: bool) -> ParsedText:
        call = _tool_call_from_json(body.strip())
        ws, self._ws_before_tag = self._ws_before_tag, ""
        if call is None:
            raw = ws + self.START + body + (self.END if closed else "")
            self._after_call = False
            return ParsedText(content=raw)
        self._after_call = True
        self.num_calls += 1
        if self._max_calls is not None and self.num_calls > self._max_calls:
            return ParsedText()
        return ParsedText(tool_calls=[call])


TOOL_PARSERS = {"hermes": HermesToolParser}


def make_tool_parser(name: str, max_calls: int | None = None) -> HermesToolParser:
    try:
        return TOOL_PARSERS[name](max_calls)
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}"
        ) from None
