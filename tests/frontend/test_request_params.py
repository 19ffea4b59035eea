"""Request bodies → typed structs → SamplingParams: validation, max_tokens, admission."""

from __future__ import annotations

import pytest

from vtllm.frontend.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    decode_body,
)
from vtllm.frontend.sampling import (
    build_sampling_params,
    check_prompt_fits,
    choice_seed,
    resolve_max_tokens,
)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 3}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}', "n"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            "messages[0].content[0].type",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": "yes"}}',
            "stream_options.include_usage",
        ),
        (b'{"messages": "hi"}', "messages"),
    ],
)
def test_wrong_field_is_400_naming_it(body: bytes, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        decode_body(body, ChatCompletionRequest)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert param in info.value.message


def test_malformed_json_is_400() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_body(b'{"messages": [', ChatCompletionRequest)
    assert info.value.status_code == 400 and "JSON" in info.value.message


def test_unknown_fields_ignored_and_parts_joined() -> None:
    request = decode_body(
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "store": true, "metadata": {"x": 1}}',
        ChatCompletionRequest,
    )
    assert request.messages[0].to_template_dict() == {"role": "user", "content": "a\nb"}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ('"hi"', ["hi"]),
        ('["a", "b"]', ["a", "b"]),
        ("[1, 2, 3]", [[1, 2, 3]]),
        ("[[1, 2], [3]]", [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt: str, expected: list) -> None:
    request = decode_body(f'{{"prompt": {prompt}}}'.encode(), CompletionRequest)
    assert request.prompts() == expected


def test_mixed_prompt_list_is_400() -> None:
    request = decode_body(b'{"prompt": ["a", 1]}', CompletionRequest)
    with pytest.raises(OpenAIError) as info:
        request.prompts()
    assert info.value.param == "prompt"


@pytest.mark.parametrize("requested", [None, 0, -1])
def test_unset_max_tokens_leaves_it_to_the_engine(requested: int | None) -> None:
    assert resolve_max_tokens(requested, None, 10, 8192) is None


def test_unset_max_tokens_yields_to_serving_default() -> None:
    assert resolve_max_tokens(-1, 256, 10, 8192) == 256
    assert resolve_max_tokens(None, 256, 8000, 8192) == 192  # capped to the room left
    assert resolve_max_tokens(500, 256, 10, 8192) == 500  # explicit wins


def test_max_tokens_body_values_decode_to_unset() -> None:
    for body in (b"{}", b'{"max_tokens": null}', b'{"max_tokens": 0}', b'{"max_tokens": -1}'):
        request = decode_body(body, ChatCompletionRequest)
        assert resolve_max_tokens(request.requested_max_tokens(), None, 5, 100) is None
    request = decode_body(b'{"max_tokens": 7, "max_completion_tokens": 9}', ChatCompletionRequest)
    assert request.requested_max_tokens() == 9


def test_admission_guard_names_the_numbers() -> None:
    with pytest.raises(OpenAIError) as info:
        check_prompt_fits(9000, 500, 8192)
    assert info.value.status_code == 400
    assert info.value.message == (
        "prompt has 9000 tokens and max_tokens is 500, together 9500, but max_model_len is 8192; shorten the "
        "prompt, lower max_tokens, or raise --max-model-len"
    )
    with pytest.raises(OpenAIError, match="prompt has 8192 tokens, but max_model_len is 8192"):
        check_prompt_fits(8192, None, 8192)
    check_prompt_fits(8191, None, 8192)
    check_prompt_fits(8000, 192, 8192)
    with pytest.raises(OpenAIError, match="empty"):
        check_prompt_fits(0, None, 8192)


def test_sampling_params_mapping() -> None:
    request = decode_body(
        b'{"temperature": 0, "top_k": -1, "stop_token_ids": [7], "seed": 5, "min_tokens": 2}',
        ChatCompletionRequest,
    )
    params = build_sampling_params(request, None, choice_seed(request.seed, 1))
    assert params.temperature == 0.0 and params.top_k == 0
    assert params.stop_token_ids == [7]  # EOS is the engine core's to decide, not added here
    assert params.seed == 6 and params.min_tokens == 2 and params.max_tokens is None
    ignoring = decode_body(b'{"ignore_eos": true}', ChatCompletionRequest)
    assert build_sampling_params(ignoring, 3, None).ignore_eos
