"""Output formats of a request (response_format, guided_*, structured_outputs) become one
StructuredOutputSpec, or a 400 naming the field; over HTTP the spec reaches the engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vtllm.frontend.openai_types import OpenAIError
from vtllm.frontend.structured_output import structured_output_spec
from vtllm.protocol.limits import MAX_STRUCTURED_OUTPUT_CHARS
from vtllm.protocol.messages import StructuredOutputKind as K

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _request(**fields):
    return SimpleNamespace(**{**dict.fromkeys(FIELDS), "structured_outputs": None, **fields})


@pytest.mark.parametrize(
    ("fields", "kind", "spec"),
    [
        ({}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, K.JSON_OBJECT, ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            K.JSON_SCHEMA,
            SCHEMA,
        ),
        ({"guided_json": SCHEMA}, K.JSON_SCHEMA, SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, K.JSON_SCHEMA, SCHEMA),
        ({"guided_regex": r"\d{3}"}, K.REGEX, r"\d{3}"),
        ({"guided_choice": ["yes", "no"]}, K.CHOICE, ["yes", "no"]),
        ({"guided_grammar": 'root ::= "a"'}, K.GRAMMAR, 'root ::= "a"'),
        ({"structured_outputs": {"json": SCHEMA}}, K.JSON_SCHEMA, SCHEMA),
        ({"structured_outputs": {"choice": ["a"]}}, K.CHOICE, ["a"]),
        ({"structured_outputs": {"json_object": True}}, K.JSON_OBJECT, ""),
    ],
)
def test_each_form_becomes_one_spec(fields, kind, spec):
    result = structured_output_spec(_request(**fields))
    if kind is None:
        assert result is None
        return
    assert result.kind == kind and result.start_after_token_id is None
    if kind in (K.JSON_SCHEMA, K.CHOICE):
        assert json.loads(result.spec) == spec
    else:
        assert result.spec == spec


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
        ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json", "schema object"),
        ({"guided_json": {"properties": {"a": {"type": "nope"}}}}, "guided_json", "'nope'"),
        ({"guided_regex": "(["}, "guided_regex", "not a valid regular expression"),
        ({"guided_regex": ""}, "guided_regex", "non-empty"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 3]}, "guided_choice", "non-empty list"),
        ({"guided_grammar": 'start ::= "a"'}, "guided_grammar", "root ::="),
        ({"structured_outputs": {"xml": "x"}}, "structured_outputs.xml", "not supported"),
        (
            {"guided_regex": "a", "guided_choice": ["b"]},
            "guided_choice",
            "one output format",
        ),
        (
            {"guided_regex": "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)},
            "guided_regex",
            str(MAX_STRUCTURED_OUTPUT_CHARS),
        ),
    ],
)
def test_malformed_formats_are_400_naming_the_field(fields, param, words):
    with pytest.raises(OpenAIError) as caught:
        structured_output_spec(_request(**fields))
    assert caught.value.status_code == 400
    assert caught.value.param == param and words in caught.value.message


def test_enum_values_are_data_not_types():
    schema = {"enum": [{"type": "whatever"}], "default": {"type": "x"}}
    assert structured_output_spec(_request(guided_json=schema)).kind == K.JSON_SCHEMA


async def test_the_spec_reaches_the_engine_and_bad_ones_are_400(serve) -> None:
    served = await serve()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
    }
    r = await served.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    spec = served.fake.added[-1].sampling_params.structured_output
    assert spec.kind == K.JSON_SCHEMA and json.loads(spec.spec) == SCHEMA
    r = await served.http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "guided_choice": ["x", "y"]}
    )
    assert r.status_code == 200, r.text
    assert served.fake.added[-1].sampling_params.structured_output.kind == K.CHOICE
    num_added = len(served.fake.added)
    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {"schema": "[]"}}}
    r = await served.http.post("/v1/chat/completions", json=bad)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    assert len(served.fake.added) == num_added
