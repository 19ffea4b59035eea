"""The engine core's bounds against a hostile or careless ZMQ client, driven through
``EngineCore.add_request`` with the fake executor: too long request ids, duplicate ids,
queue floods ("server busy"), NaN/inf in any float field (msgpack carries them), lists
too long. Every refusal names the numbers and what to change; a normal request is served
afterwards."""

from __future__ import annotations

import math

import msgspec
import pytest

from tests.engine_core.test_engine_core import make_core
from vtllm.engine_core.core import EngineCore
from vtllm.protocol import codec, limits
from vtllm.protocol import messages as m


def _add(request_id: str = "r", max_tokens: int = 4, **params) -> m.AddRequest:
    sampling = m.SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return m.AddRequest(request_id, [5, 6, 7], sampling)


def _run(core: EngineCore, max_steps: int = 200) -> dict[str, list[m.RequestOutput]]:
    """Step until idle; every output by request id."""
    outputs: dict[str, list[m.RequestOutput]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return outputs
        for _, out in core.step()[0]:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"still busy after {max_steps} steps")


def _served(core: EngineCore, request_id: str = "normal", client: bytes = b"c") -> None:
    assert core.add_request(client, _add(request_id)) == []
    outputs = _run(core)[request_id]
    assert sum(len(o.new_token_ids) for o in outputs) == 4
    assert outputs[-1].finish_reason == m.FinishReason.LENGTH


def _refusal(outputs) -> m.RequestOutput:
    [(_, output)] = outputs
    assert output.finish_reason == m.FinishReason.ERROR and output.error
    return output


# -- request ids ----------------------------------------------------------------------


def test_a_request_id_longer_than_the_limit_is_refused_with_the_numbers() -> None:
    core, _ = make_core()
    limit = core.config.scheduler.max_request_id_bytes
    assert limit == 256  # the documented default
    output = _refusal(core.add_request(b"c", _add("x" * (limit + 1))))
    assert output.error_code == m.ErrorCode.INVALID_REQUEST
    assert output.error_param == "request_id"
    assert f"{limit + 1} bytes" in output.error and str(limit) in output.error
    assert "--max-request-id-bytes" in output.error
    assert not core.scheduler.requests
    assert core.add_request(b"c", _add("é" * (limit // 2))) == []  # bytes, not chars
    _run(core)
    _served(core)


def test_a_duplicate_id_is_refused_without_touching_the_live_request() -> None:
    core, _ = make_core()
    assert core.add_request(b"c", _add("live", max_tokens=6)) == []
    core.step()  # the live request is running (and has streamed)
    output = _refusal(core.add_request(b"c", _add("live", max_tokens=2)))
    assert output.duplicate_id and output.error_param == "request_id"
    assert output.error_code == m.ErrorCode.INVALID_REQUEST
    assert "goes on unchanged" in output.error
    rest = _run(core)["live"]
    assert all(o.finish_reason in (None, m.FinishReason.LENGTH) for o in rest)
    assert rest[-1].finish_reason == m.FinishReason.LENGTH
    assert not any(o.duplicate_id for o in rest)
    assert core.scheduler.requests == {}


def test_another_clients_live_id_is_an_ordinary_refusal_of_the_sender() -> None:
    core, _ = make_core()
    assert core.add_request(b"a", _add("same")) == []
    output = _refusal(core.add_request(b"b", _add("same")))
    assert not output.duplicate_id  # b has no live request of that id: this is its finish
    assert core.scheduler.requests["same"].client_id == b"a"
    assert _run(core)["same"][-1].finish_reason == m.FinishReason.LENGTH


# -- queue floods ---------------------------------------------------------------------


def test_a_client_past_its_unfinished_limit_is_told_the_server_is_busy() -> None:
    core, _ = make_core()
    core.config.scheduler.max_requests_per_client = 3
    for i in range(3):
        assert core.add_request(b"flood", _add(f"f{i}")) == []
    output = _refusal(core.add_request(b"flood", _add("f3")))
    assert output.error_code == m.ErrorCode.UNAVAILABLE  # HTTP 503
    assert "server busy" in output.error and "3 unfinished" in output.error
    assert "--max-requests-per-client 3" in output.error
    assert core.add_request(b"other", _add("o0")) == []  # another client still gets in
    core.abort(["f0"], b"flood")
    assert core.add_request(b"flood", _add("f4")) == []  # a finish frees a place
    _run(core)
    assert core.num_unfinished(b"flood") == 0
    _served(core, client=b"flood")


def test_a_full_waiting_queue_refuses_new_requests_as_busy() -> None:
    core, _ = make_core(max_num_seqs=2)
    core.config.scheduler.max_waiting_requests = 3
    for i in range(3):
        assert core.add_request(bytes([i]), _add(f"w{i}")) == []
    output = _refusal(core.add_request(b"late", _add("late")))
    assert output.error_code == m.ErrorCode.UNAVAILABLE
    assert "3 requests are already waiting" in output.error
    assert "--max-waiting-requests 3" in output.error
    core.step()  # two start running: room in the queue again
    assert len(core.scheduler.waiting) == 1
    assert core.add_request(b"late", _add("late")) == []
    _run(core)
    _served(core)


def test_a_flood_of_adds_holds_the_engine_to_its_bounds() -> None:
    core, _ = make_core()
    core.config.scheduler.max_waiting_requests = 50
    refused = 0
    for i in range(5000):
        refused += len(core.add_request(b"flood", _add(f"f{i}")))
    assert len(core.scheduler.requests) == 50 and refused == 4950
    _run(core, max_steps=2000)
    _served(core)


# -- numbers: NaN and infinities never pass, whatever carries them ---------------------

FLOAT_FIELDS = [
    f.name for f in msgspec.structs.fields(m.SamplingParams) if f.type in (float, "float")
]


def test_every_float_field_is_covered() -> None:
    assert set(FLOAT_FIELDS) >= {
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    }


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", [*FLOAT_FIELDS, "logit_bias", "arrival_time"])
def test_nan_and_infinity_over_msgpack_are_refused(field: str, value: float) -> None:
    """Encoded and decoded as the engine core's socket does: msgpack keeps NaN."""
    add = _add("r")
    if field == "logit_bias":
        add.sampling_params.logit_bias = {3: value}
    elif field == "arrival_time":
        add.arrival_time = value
    else:
        setattr(add.sampling_params, field, value)
    decoded = codec.client_to_engine_decoder().decode(codec.encode(add))
    core, _ = make_core()
    output = _refusal(core.add_request(b"c", decoded))
    assert output.error_code == m.ErrorCode.INVALID_REQUEST
    assert output.error_param == field, output.error
    assert not core.scheduler.requests


# -- lists -----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_a_list_longer_than_its_limit_is_refused_naming_the_variable(field: str) -> None:
    limit = limits.LIST_LIMITS[field]
    assert limit.max_entries == 1024  # the documented default
    core, _ = make_core()
    ids = range(limit.max_entries + 1)  # ids past the vocabulary too: counted first
    value = {i: 1.0 for i in ids} if field == "logit_bias" else list(ids)
    output = _refusal(core.add_request(b"c", _add("r", **{field: value})))
    assert output.error_param == field
    assert f"{limit.max_entries + 1} entries" in output.error and limit.env in output.error
    _served(core)
