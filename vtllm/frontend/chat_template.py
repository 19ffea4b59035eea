"""Which chat template a model uses, what it can render, and the messages it is given.

* ``--chat-template FILE_OR_STRING`` replaces the model's own template
  (``load_chat_template``).
* A model template known to ignore tools gets a shipped replacement that renders them and
  is byte-identical without them (``shipped_replacement``): SmolLM2's ChatML template →
  ``chat_templates/smollm2_hermes.jinja``.
* ``template_messages`` turns OpenAI messages into what Hugging Face templates expect: an
  assistant turn with ``tool_calls`` and ``content: null`` gets ``""`` (templates
  concatenate it), and each call's ``arguments`` JSON string becomes an object (Llama 3
  templates ``tojson`` it; Qwen's accept both), as vLLM and transformers users pass them.
* ``TemplateFeatures`` says whether a template reads ``tools`` / ``tool_calls`` at all, so
  a request whose tools would silently vanish is refused instead (a 400 naming the flag).
* ``detect_tool_parser`` names the tool-call format a template teaches the model.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox

SHIPPED_DIR = Path(__file__).parent / "chat_templates"

# sha256 of a model template that ignores tools → the shipped file that renders them
_REPLACEMENTS = {
    # SmolLM2-135M-Instruct (the embedded GGUF's tokenizer.chat_template)
    "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788": "smollm2_hermes.jinja",
}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def shipped_template(name: str) -> str:
    return (SHIPPED_DIR / name).read_text(encoding="utf-8")


def shipped_replacement(template: str) -> tuple[str, str] | None:
    """``(file name, template)`` of the shipped template that replaces ``template``, or
    None when it is not a known tool-less template."""
    name = _REPLACEMENTS.get(_sha256(template))
    return None if name is None else (name, shipped_template(name))


def load_chat_template(value: str) -> str:
    """``--chat-template``: the path of a Jinja file, or the template itself. Raises
    ValueError naming the flag when it is neither."""
    path = Path(value).expanduser()
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path:
        if not path.is_file():
            raise ValueError(
                f"--chat-template {value!r}: no such file (give a Jinja file, or the "
                "template text itself, which contains '{{' or '{%')"
            )
        value = path.read_text(encoding="utf-8")
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(value)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from None
    return value


@dataclass(frozen=True)
class TemplateFeatures:
    """What a template reads (from its source, not by rendering)."""

    renders_tools: bool  # reads the ``tools`` variable
    renders_tool_calls: bool  # reads messages' ``tool_calls``

    @classmethod
    def of(cls, template: str) -> TemplateFeatures:
        try:
            ast = jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
            variables = jinja2.meta.find_undeclared_variables(ast)
        except jinja2.exceptions.TemplateSyntaxError:
            variables = set()
        return cls("tools" in variables, "tool_calls" in template)


# (marker in the template, parser): the format the template teaches the model
_FORMATS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": ', "llama3_json"),
)


def detect_tool_parser(template: str | None) -> str | None:
    """The ``--tool-call-parser`` a template's tool format calls for, if it is a known one
    and the template renders tools at all."""
    if not template or not TemplateFeatures.of(template).renders_tools:
        return None
    return next((parser for marker, parser in _FORMATS if marker in template), None)


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments  # not JSON: the template gets the string as sent
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates expect them (see the module docstring).
    The input is not modified."""
    out = []
    for message in messages:
        tool_calls = message.get("tool_calls")
        if not tool_calls:
            out.append(message)
            continue
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        calls = copy.deepcopy(tool_calls)
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and "arguments" in function:
                function["arguments"] = _arguments_object(function["arguments"])
        message["tool_calls"] = calls
        out.append(message)
    return out
