"""The structured-output spec on the wire and its size bound."""

from vtllm.protocol import codec, limits
from vtllm.protocol import messages as m


def test_spec_round_trips_inside_sampling_params():
    spec = m.StructuredOutputSpec(m.StructuredOutputKind.JSON_SCHEMA, '{"type": "object"}', 7)
    message = m.AddRequest("r", [1], m.SamplingParams(structured_output=spec))
    decoded = codec.client_to_engine_decoder().decode(codec.encode(message))
    assert decoded.sampling_params.structured_output == spec
    assert decoded.sampling_params.structured_output.kind is m.StructuredOutputKind.JSON_SCHEMA


def test_oversized_spec_is_a_problem_naming_the_numbers():
    limit = limits.MAX_STRUCTURED_OUTPUT_CHARS
    ok = m.SamplingParams(
        structured_output=m.StructuredOutputSpec(m.StructuredOutputKind.REGEX, "a" * limit)
    )
    assert limits.sampling_problems(ok) == []
    big = m.SamplingParams(
        structured_output=m.StructuredOutputSpec(m.StructuredOutputKind.REGEX, "a" * (limit + 1))
    )
    [(field, message)] = limits.sampling_problems(big)
    assert field == "structured_output"
    assert str(limit + 1) in message and str(limit) in message
