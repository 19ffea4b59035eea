"""Every message round-trips; golden bytes pin the wire format; garbage is refused."""

from __future__ import annotations

import msgspec
import pytest

from vtllm.protocol import codec
from vtllm.protocol import messages as m

PARAMS = m.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=7, max_tokens=12)

CLIENT_TO_ENGINE = [
    m.Hello(protocol_version=m.PROTOCOL_VERSION, client_name="test"),
    m.Hello(m.PROTOCOL_VERSION, "test", session_id="s-1"),
    m.AddRequest("r1", [1, 2, 3], PARAMS, arrival_time=1.5, priority=2, cache_salt="s"),
    m.AbortRequests(["r1", "r2"]),
    m.UtilityRequest(3, "get_stats", [msgspec.Raw(codec.encode_value([1, "a"]))]),
    m.Heartbeat(12.5),
    m.Goodbye(),
]
ENGINE_TO_CLIENT = [
    m.Ready(m.PROTOCOL_VERSION, "smol", 8192, 49152, 100, 16, [2], engine_id="e"),
    m.HandshakeRefused("old client"),
    m.EngineOutputs(
        [
            m.RequestOutput(
                "r1", [5, 6], m.FinishReason.STOP, stop_token_id=2, num_prompt_tokens=3
            ),
            m.RequestOutput("r2", [], m.FinishReason.ERROR, error="too long"),
            m.RequestOutput(
                "r3", [9], new_logprobs=[-0.5], new_top_logprobs=[[(9, -0.5), (4, -1.0)]]
            ),
        ],
        m.SchedulerStats(num_running=1, kv_cache_usage=0.25),
        timestamp=3.0,
    ),
    m.UtilityResponse(3, True, msgspec.Raw(codec.encode_value({"a": 1}))),
    m.UtilityResponse(4, False, error="refused"),
    m.Heartbeat(1.0),
    m.EngineDead("worker died"),
    m.SessionUnknown("engine restarted"),
]
WORKER_TO_ENGINE = [
    m.WorkerReport(0, m.ModelFacts("smol", 49152, 8192, [2], 30, 46080), 1 << 30),
    m.WorkerReady(1),
    m.ModelRunnerOutput(4, ["a", "b"], [7, 8], logprobs=[-0.1, -0.2], errors={"c": "nan"}),
    m.WorkerFailure(0, "CUDA error"),
    m.WorkerHeartbeat(1, "capturing decode graphs", 2.5),
]
ENGINE_TO_WORKER = [
    m.InitKVCache(100, 16),
    m.SchedulerOutput(
        5,
        [m.NewRequestData("a", [1, 2], 2, PARAMS, [1, 2], 0)],
        [m.CachedRequestData("b", [9], [3], 17)],
        {"a": 2, "b": 1},
        ["c"],
    ),
    m.Shutdown(),
]


def _same(a, b) -> bool:
    return codec.encode(a) == codec.encode(b)


@pytest.mark.parametrize(
    ("messages", "decoder"),
    [
        (CLIENT_TO_ENGINE, codec.client_to_engine_decoder),
        (ENGINE_TO_CLIENT, codec.engine_to_client_decoder),
        (WORKER_TO_ENGINE, codec.worker_to_engine_decoder),
        (ENGINE_TO_WORKER, codec.engine_to_worker_decoder),
    ],
)
def test_every_message_round_trips(messages, decoder):
    dec = decoder()
    for message in messages:
        decoded = dec.decode(codec.encode(message))
        assert type(decoded) is type(message)
        assert _same(decoded, message)


def test_golden_bytes_of_add_request():
    message = m.AddRequest("r1", [1, 2], m.SamplingParams(temperature=0.0, max_tokens=5))
    # [tag "add", "r1", [1, 2], params [16 fields], arrival_time, priority, cache_salt]
    assert codec.encode(message).hex() == (
        "97"
        "a3616464"
        "a27231"
        "920102"
        "dc0010"  # array16 of 16
        "cb0000000000000000"
        "cb3ff0000000000000"
        "00"
        "cb0000000000000000"
        "c0"
        "05"
        "00"
        "90"
        "c2"
        "cb0000000000000000"
        "cb0000000000000000"
        "cb3ff0000000000000"
        "c0"
        "80"
        "c0"  # structured_output: None
        "00"  # pooling: NONE
        "cb0000000000000000"
        "00"
        "c0"
    )


def test_golden_bytes_of_engine_outputs():
    message = m.EngineOutputs([m.RequestOutput("a", [7], m.FinishReason.LENGTH)])
    # finish_reason LENGTH travels as the int 1
    assert codec.encode(message).hex() == (
        # [tag, [RequestOutput: 15 fields, duplicate_id false, embedding nil last], stats
        # nil, timestamp]
        "94a76f757470757473919fa161910701c0c00000c0c0c0c0c0c0c2c0c0cb0000000000000000"
    )


def test_golden_bytes_of_session_unknown():
    # [tag "no_session", reason]
    assert codec.encode(m.SessionUnknown("gone")).hex() == "92aa6e6f5f73657373696f6ea4676f6e65"
    decoded = codec.engine_to_client_decoder().decode(
        bytes.fromhex("92aa6e6f5f73657373696f6ea4676f6e65")
    )
    assert decoded == m.SessionUnknown("gone")


def test_golden_bytes_of_hello_and_an_older_client_hello():
    # [tag "hello", version 1, "c", session id "s"]
    assert codec.encode(m.Hello(1, "c", "s")).hex() == "94a568656c6c6f01a163a173"
    # a client from before session ids sends three elements; it still decodes
    older = codec.client_to_engine_decoder().decode(bytes.fromhex("93a568656c6c6f01a163"))
    assert older == m.Hello(1, "c") and older.session_id == ""


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xff\xfe garbage",
        codec.encode(m.EngineOutputs([])),  # right codec, wrong direction
        msgspec.msgpack.encode(["add", "r1", "not a list", {}]),  # wrong types
        msgspec.msgpack.encode(["no-such-kind", 1]),
        codec.encode(m.AddRequest("r", [1], PARAMS))[:-3],  # truncated
    ],
)
def test_garbage_is_a_protocol_error(frame):
    with pytest.raises(codec.ProtocolError):
        codec.client_to_engine_decoder().decode(frame)


def test_oversized_frame_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 16)
    with pytest.raises(codec.ProtocolError, match="exceeds"):
        codec.client_to_engine_decoder().decode(b"\x00" * 17)
