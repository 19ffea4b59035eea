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

Llama 3 JSON (``llama3_json``): the output *starts* with ``{"name": ..., "parameters": {...}}``
(``<|python_tag|>`` in front is allowed; several calls are separated by ``;``). Output that
starts with anything else is content.

Mistral (``mistral``): ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``
objects, or (tokenizer v11+) ``[TOOL_CALLS]name[ARGS]{...}`` per call. ``[TOOL_CALLS]`` is a
special token that the detokenizer drops, so an output that *starts* with ``[{`` is read the
same way. Text in front of the first call is content.

Forced calls (``tool_choice`` "required" or a named function, tool_choice.py): the output
is JSON that a grammar forced into shape, parsed once it is complete.
"""

from __future__ import annotations

import json
import re
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


def _tool_calls_from_json(body: str) -> list[ToolCall] | None:
    """The calls a tag's body describes: one object, or a list of them (SmolLM2's own
    format). None if the body is not valid JSON or any item is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if obj == []:
        return []  # "no calls" (SmolLM2's format)
    items = obj if isinstance(obj, list) else [obj]
    calls = [tool_call_from_obj(item) for item in items]
    return None if None in calls else calls  # type: ignore[return-value]


def tool_call_from_obj(obj: object, name: str | None = None) -> ToolCall | None:
    """``{"name": str, "arguments" | "parameters": object or JSON string}`` as a ToolCall
    (or, given ``name``, ``obj`` is the arguments object itself); None if it is not one."""
    if name is not None:
        return ToolCall(new_tool_call_id(), name, json.dumps(obj, ensure_ascii=False))
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


def partial_prefix_len(text: str, tag: str) -> int:
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
                keep = partial_prefix_len(self._buffer, self.START)
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
        calls = _tool_calls_from_json(body.strip())
        ws, self._ws_before_tag = self._ws_before_tag, ""
        if calls is None:
            raw = ws + self.START + body + (self.END if closed else "")
            self._after_call = False
            return ParsedText(content=raw)
        self._after_call = True
        kept = _keep(calls, self.num_calls, self._max_calls)
        self.num_calls += len(calls)
        return ParsedText(tool_calls=kept)


def _keep(calls: list[ToolCall], num_before: int, max_calls: int | None) -> list[ToolCall]:
    """The calls within ``max_calls`` when ``num_before`` were made already."""
    if max_calls is None:
        return calls
    return calls[: max(0, max_calls - num_before)]


class _LeadingJsonToolParser:
    """Calls written as JSON where the output starts, or after a marker: the common core
    of the Llama 3 JSON and Mistral formats.

    Until the output shows whether it starts with a call, the text is held back. A call is
    emitted as soon as its JSON value is complete, so a stream gets each call before the
    output ends. Text that turns out not to be a call is content, as written. Subclasses
    say what starts calls (``MARKERS`` anywhere, ``LEADING`` characters at the very start)
    and may read a call differently (``_calls_at``)."""

    MARKERS: tuple[str, ...] = ()
    LEADING = ""  # characters that start a call at the very beginning of the output
    SEPARATORS = ""  # characters allowed between two calls (besides whitespace)

    def __init__(self, max_calls: int | None = None) -> None:
        self._max_calls = max_calls
        self._buffer = ""
        self._state = "start"  # start -> content | calls; calls -> content on junk
        self._ws_before = ""  # whitespace cut from the content in front of a marker
        self._decoder = json.JSONDecoder()
        self.num_calls = 0

    def push(self, text: str) -> ParsedText:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedText:
        out = self._advance(final=True)
        rest, self._buffer = self._buffer, ""
        if self._state == "calls" and self._skip_len(rest) == len(rest):
            rest = ""  # whitespace, separators or a lone marker after the calls
        out.content += rest  # an unfinished or invalid call: nothing is lost
        return out

    def _advance(self, final: bool) -> ParsedText:
        out = ParsedText()
        while True:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if not stripped:
                    return out
                if not final and any(m.startswith(stripped) for m in self.MARKERS):
                    return out  # may still become a marker
                starts_call = stripped[0] in self.LEADING or any(
                    stripped.startswith(m) for m in self.MARKERS
                )
                self._state = "calls" if starts_call else "content"
            if self._state == "content":
                out.content += self._emit_content(final)
                if self._state == "content":
                    return out
            parsed = self._read_calls(final)
            if parsed is None:
                return out
            out += parsed

    def _emit_content(self, final: bool) -> str:
        """Content up to the next marker (which switches to ``calls``); a tail that may be
        the start of a marker, and trailing whitespace, wait."""
        hits = [self._buffer.find(m) for m in self.MARKERS if m in self._buffer]
        if hits:
            idx = min(hits)
            text, self._buffer = self._buffer[:idx], self._buffer[idx:]
            self._state = "calls"
            content = text.rstrip()
            self._ws_before = text[len(content) :]  # back in front if no call follows
            return content
        if final:
            text, self._buffer = self._buffer, ""
            return text
        keep = max((partial_prefix_len(self._buffer, m) for m in self.MARKERS), default=0)
        # trailing whitespace waits too: it is dropped if a call follows
        text = self._buffer[: len(self._buffer) - keep].rstrip()
        self._buffer = self._buffer[len(text) :]
        return text

    def _skip_len(self, text: str) -> int:
        """Length of the whitespace, separators and markers at the start of ``text``."""
        idx = 0
        while True:
            stripped = text[idx:].lstrip(" \t\r\n" + self.SEPARATORS)
            idx = len(text) - len(stripped)
            marker = next((m for m in self.MARKERS if stripped.startswith(m)), None)
            if marker is None:
                return idx
            idx += len(marker)

    def _read_calls(self, final: bool) -> ParsedText | None:
        """The calls of one JSON value from the buffer, or None when more text is needed."""
        skipped = self._skip_len(self._buffer)
        body = self._buffer[skipped:]
        if not body:
            return None
        calls, used = self._calls_at(body)
        if calls is None:
            if used < 0 and not final:
                return None  # incomplete JSON: wait
            # not a call: the rest of the output is content, as written
            self._state = "content"
            rest, self._buffer = self._ws_before + self._buffer, ""
            self._ws_before = ""
            return ParsedText(content=rest)
        self._buffer = body[used:]
        self._ws_before = ""
        kept = _keep(calls, self.num_calls, self._max_calls)
        self.num_calls += len(calls)
        return ParsedText(tool_calls=kept)

    def _calls_at(self, body: str) -> tuple[list[ToolCall] | None, int]:
        """The calls of the JSON value at the start of ``body`` and its length; (None, -1)
        when the value may be incomplete, (None, 0) when it is not a call."""
        try:
            obj, end = self._decoder.raw_decode(body)
        except json.JSONDecodeError:
            return None, (-1 if _is_prefix_json(body) else 0)
        if obj == []:
            return [], end  # "no calls" (SmolLM2's format)
        items = obj if isinstance(obj, list) else [obj]
        calls = [tool_call_from_obj(item) for item in items]
        return (None, 0) if None in calls else (calls, end)  # type: ignore[return-value]


def _is_prefix_json(text: str) -> bool:
    """Whether ``text`` may be the start of a longer JSON value: its brackets are still
    open (strings taken into account)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                return False
    return depth > 0 or in_string


class Llama3JsonToolParser(_LeadingJsonToolParser):
    """``{"name": ..., "parameters": {...}}`` (``; `` between calls) at the start."""

    MARKERS = ("<|python_tag|>",)
    LEADING = "{"
    SEPARATORS = ";"


class MistralToolParser(_LeadingJsonToolParser):
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``."""

    MARKERS = ("[TOOL_CALLS]",)
    LEADING = "["
    ARGS = "[ARGS]"

    def _calls_at(self, body: str) -> tuple[list[ToolCall] | None, int]:
        if body[0] in "[{":
            return super()._calls_at(body)
        # v11: name[ARGS]{...}
        args_idx = body.find(self.ARGS)
        if args_idx < 0:
            # a function name so far, maybe followed by the start of [ARGS]
            name_so_far = body[: len(body) - partial_prefix_len(body, self.ARGS)]
            plausible = re.fullmatch(r"[A-Za-z0-9_.\-]*", name_so_far) and len(body) < 256
            return None, (-1 if plausible else 0)
        name = body[:args_idx].strip()
        json_start = args_idx + len(self.ARGS)
        try:
            obj, end = self._decoder.raw_decode(body[json_start:])
        except json.JSONDecodeError:
            return None, (
                -1 if _is_prefix_json(body[json_start:]) or not body[json_start:].strip() else 0
            )
        call = tool_call_from_obj(obj, name) if name and isinstance(obj, dict) else None
        return (None, 0) if call is None else ([call], json_start + end)


class ForcedCallsParser:
    """The output of a forced ``tool_choice``: with ``name``, the arguments object of that
    function; without, a JSON array of ``{"name", "parameters"}``. The grammar guarantees
    the shape, so the calls come out when the output ends; an output cut short (max_tokens)
    is content."""

    def __init__(self, name: str | None = None, max_calls: int | None = None) -> None:
        self._name = name
        self._max_calls = max_calls
        self._buffer = ""

    def push(self, text: str) -> ParsedText:
        self._buffer += text
        return ParsedText()

    def finish(self) -> ParsedText:
        text, self._buffer = self._buffer, ""
        try:
            obj = json.loads(text)
        except ValueError:
            return ParsedText(content=text)
        if self._name is not None:
            calls = [tool_call_from_obj(obj, self._name)] if isinstance(obj, dict) else [None]
        else:
            calls = [tool_call_from_obj(item) for item in obj] if isinstance(obj, list) else [None]
        if not calls or None in calls:
            return ParsedText(content=text)
        return ParsedText(tool_calls=_keep(calls, 0, self._max_calls))  # type: ignore[arg-type]


ToolParser = HermesToolParser | Llama3JsonToolParser | MistralToolParser | ForcedCallsParser

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def make_tool_parser(name: str, max_calls: int | None = None) -> ToolParser:
    try:
        parser_class = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}"
        ) from None
    return parser_class(max_calls)
