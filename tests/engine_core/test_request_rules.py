"""One source of request rules: the HTTP schema and the engine core's guard both come from
``protocol.limits``, so they accept and refuse exactly the same values, and an engine-side
refusal names the field (``RequestOutput.error_param``)."""

from __future__ import annotations

import json

import pytest

from vtllm.engine_core.guards import validate_request
from vtllm.frontend.openai_types import CompletionRequest, OpenAIError, decode_body
from vtllm.frontend.sampling import build_sampling_params, choice_seed
from vtllm.protocol import limits
from vtllm.protocol import messages as m

VOCAB = 100
# fields the HTTP request carries under the same name as SamplingParams
SHARED = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


def _edges(bounds: limits.Range) -> list[tuple[float, bool]]:
    """(value, allowed) pairs at and just past each bound."""
    cases = []
    for bound, inclusive, step in (
        (bounds.ge, True, -1),
        (bounds.gt, False, -1),
        (bounds.le, True, 1),
    ):
        if bound is None:
            continue
        is_int = float(bound).is_integer() and abs(bound) > 2
        outside = bound + step if is_int else bound + step * 0.01
        if inclusive:
            cases.append((bound, True))
        cases.append((outside, False))
    return cases


def _http_accepts(field: str, value: object) -> bool:
    body = json.dumps({"prompt": [1, 2], field: value}).encode()
    try:
        decode_body(body, CompletionRequest)
    except OpenAIError as e:
        assert e.status_code == 400, (field, e.message)
        assert (e.param or "").split("[")[0] == field, (field, e.message)
        return False
    return True


def _engine_refusal(params: m.SamplingParams) -> limits.Refusal | None:
    return validate_request([1, 2], params, max_model_len=64, vocab_size=VOCAB)


@pytest.mark.parametrize("field", SHARED)
def test_http_schema_and_engine_guard_agree_at_every_bound(field: str) -> None:
    for value, allowed in _edges(limits.SAMPLING_RANGES[field]):
        assert _http_accepts(field, value) == allowed, (field, value)
        refusal = _engine_refusal(m.SamplingParams(**{field: value}))
        assert (refusal is None) == allowed, (field, value, refusal)
        if refusal is not None:
            assert refusal.param == field and field in refusal.message


def test_what_the_frontend_builds_the_engine_accepts() -> None:
    body = (
        b'{"prompt": [1], "temperature": 2, "top_p": 1e-9, "top_k": -1, "min_p": 1, '
        b'"seed": 9223372036854775807, "n": 3, "presence_penalty": -2, '
        b'"frequency_penalty": 2, "repetition_penalty": 2, "min_tokens": 5, "logprobs": 20}'
    )
    request = decode_body(body, CompletionRequest)
    for i in range(request.n):  # the seed of each choice stays in int64
        params = build_sampling_params(request, 8, choice_seed(request.seed, i), 20)
        assert _engine_refusal(params) is None, params


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], m.SamplingParams(), "prompt"),
        ([1, VOCAB], m.SamplingParams(), "prompt"),
        ([1], m.SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
        ([1], m.SamplingParams(logit_bias={VOCAB + 1: 1.0}), "logit_bias"),
        ([1], m.SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
        ([1], m.SamplingParams(max_tokens=0), "max_tokens"),
        ([1], m.SamplingParams(logprobs=21), "logprobs"),
        ([1], m.SamplingParams(temperature=float("nan")), "temperature"),
        (list(range(64)), m.SamplingParams(), "prompt"),
        ([1, 2], m.SamplingParams(max_tokens=63), "max_tokens"),
    ],
)
def test_every_refusal_names_its_field(prompt, params, param) -> None:
    refusal = validate_request(prompt, params, max_model_len=64, vocab_size=VOCAB)
    assert refusal is not None and refusal.param == param, refusal


def test_the_engine_core_sends_the_refused_field() -> None:
    from tests.engine_core.test_engine_core import make_core

    core, _ = make_core()
    [(client, output)] = core.add_request(b"c", m.AddRequest("r", [5], m.SamplingParams(top_p=0.0)))
    assert output.finish_reason == m.FinishReason.ERROR
    assert output.error_code == m.ErrorCode.INVALID_REQUEST and output.error_param == "top_p"


def test_unset_max_tokens_is_the_room_left() -> None:
    assert limits.resolve_max_tokens(None, 10, 64) == 54
    assert limits.resolve_max_tokens(7, 10, 64) == 7


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_http_schema_and_engine_guard_agree_on_list_lengths(field: str) -> None:
    limit = limits.LIST_LIMITS[field].max_entries
    for num, allowed in ((limit, True), (limit + 1, False)):
        ids = [i % VOCAB for i in range(num)] if field == "stop_token_ids" else range(num)
        http_value = {str(i): 1.0 for i in ids} if field == "logit_bias" else ids
        engine_value = {i: 1.0 for i in ids} if field == "logit_bias" else ids
        assert _http_accepts(field, http_value) == allowed, (field, num)
        vocab = max(VOCAB, num + 1)
        params = m.SamplingParams(**{field: engine_value})
        refusal = validate_request([1, 2], params, max_model_len=64, vocab_size=vocab)
        assert (refusal is None) == allowed, (field, num, refusal)


def test_stop_strings_are_bounded_in_number_and_length() -> None:
    num, chars = limits.LIST_LIMITS["stop"].max_entries, limits.MAX_STOP_STRING_CHARS
    assert (num, chars) == (64, 1024)  # the documented defaults
    assert _http_accepts("stop", ["x" * chars] * num)
    assert not _http_accepts("stop", ["x"] * (num + 1))
    assert not _http_accepts("stop", ["x" * (chars + 1)])
    assert not _http_accepts("stop", "x" * (chars + 1))
