"""A request's output format (OpenAI ``response_format``, vLLM's ``guided_*`` fields and
its ``structured_outputs`` object) as one ``StructuredOutputSpec`` for the engine.

The grammar itself is compiled and enforced by the driver worker (xgrammar imports torch,
which the frontend must not); here each spec is checked as far as it can be without it —
JSON that parses to a schema object, a regex Python can compile, a non-empty list of
strings, a grammar with a ``root`` rule, at most one format per request, a bounded size —
so that the common mistakes are a 400 naming the field before anything is sent.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vtllm.frontend.openai_types import OpenAIError
from vtllm.protocol.limits import structured_output_problem
from vtllm.protocol.messages import StructuredOutputKind, StructuredOutputSpec

_KIND_OF_FIELD = {
    "json": StructuredOutputKind.JSON_SCHEMA,
    "regex": StructuredOutputKind.REGEX,
    "choice": StructuredOutputKind.CHOICE,
    "grammar": StructuredOutputKind.GRAMMAR,
}


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def structured_output_spec(request: Any) -> StructuredOutputSpec | None:
    """The one format ``request`` asks for, or None for free text. Raises OpenAIError(400)
    naming the field when a format is malformed or several are given."""
    found: list[tuple[str, StructuredOutputSpec]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{name}", None)
        if value is not None:
            found.append((f"guided_{name}", _spec(name, value, f"guided_{name}")))
    outputs = getattr(request, "structured_outputs", None)
    for name, value in (outputs or {}).items():
        field = f"structured_outputs.{name}"
        if value is None or value is False:
            continue
        if name == "json_object":
            found.append((field, StructuredOutputSpec(StructuredOutputKind.JSON_OBJECT)))
        elif name in _KIND_OF_FIELD:
            found.append((field, _spec(name, value, field)))
        else:
            raise _bad(
                f"{field} is not supported; use one of json, regex, choice, grammar, json_object",
                field,
            )
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise _bad(f"give one output format, not several ({names})", found[1][0])
    return found[0][1] if found else None


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputSpec | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec(StructuredOutputKind.JSON_OBJECT)
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        if not isinstance(wrapper, dict) or "schema" not in wrapper:
            raise _bad(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                "response_format",
            )
        # strict or not, the schema is enforced: a grammar cannot half-apply it
        return _spec("json", wrapper["schema"], "response_format.json_schema.schema")
    raise _bad(
        f"response_format type {str(kind)[:40]!r} is not supported; use text, json_object "
        "or json_schema",
        "response_format",
    )


def _spec(name: str, value: Any, field: str) -> StructuredOutputSpec:
    kind = _KIND_OF_FIELD[name]
    if kind == StructuredOutputKind.JSON_SCHEMA:
        text = _schema_text(value, field)
    elif kind == StructuredOutputKind.CHOICE:
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise _bad(f"{field} must be a non-empty list of non-empty strings", field)
        text = json.dumps(value, ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value.strip():
            raise _bad(f"{field} must be a non-empty string", field)
        text = value
    problem = structured_output_problem(text, field)
    if problem is not None:
        raise _bad(problem, field)
    if kind == StructuredOutputKind.REGEX:
        try:
            re.compile(text)
        except re.error as exc:
            raise _bad(f"{field} is not a valid regular expression: {exc}", field) from None
    if kind == StructuredOutputKind.GRAMMAR and not re.search(r"(^|\n)\s*root\s*::=", text):
        raise _bad(f"{field} must define the start rule: root ::= ...", field)
    return StructuredOutputSpec(kind, text)


def _schema_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _bad(f"{field} is not valid JSON: {exc}", field) from None
    if not isinstance(value, dict):
        raise _bad(f"{field} must be a JSON schema object, got {type(value).__name__}", field)
    _check_types(value, field)
    return json.dumps(value, ensure_ascii=False)


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _check_types(schema: Any, field: str, depth: int = 0) -> None:
    """Every ``type`` in the schema names a JSON type (the commonest schema typo); values
    that are data rather than schemas (enum, const, default, examples) are skipped."""
    if depth > 64:
        return
    if isinstance(schema, list):
        for item in schema:
            _check_types(item, field, depth + 1)
        return
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    for t in types if isinstance(types, list) else [types]:
        if isinstance(t, str) and t not in _JSON_TYPES:
            raise _bad(
                f"{field} has the type {t[:40]!r}, which is not a JSON schema type "
                f"(one of {', '.join(sorted(_JSON_TYPES))})",
                field,
            )
    for key, value in schema.items():
        if key not in ("enum", "const", "default", "examples"):
            _check_types(value, field, depth + 1)
