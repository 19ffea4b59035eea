"""Hostile requests against a real `vtllm engine-core` (SmolLM2 on CPU, ipc:// in a private
directory): NaN over msgpack, a tiny temperature, a too long request id, a re-used live
request id and a flood of adds. Each is refused or made harmless with a reason, and a
normal request is served promptly afterwards. One engine core for the module (small
limits: 2 running, 4 waiting, 6 per client, ids of 64 bytes)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vtllm.protocol import messages as m
from vtllm.protocol.client import EngineCoreClient

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3, 88, 17]
LIMITS = {
    "--max-num-seqs": "2",
    "--max-waiting-requests": "4",
    "--max-requests-per-client": "6",
    "--max-request-id-bytes": "64",
}


def _greedy(max_tokens: int, **kw) -> m.SamplingParams:
    return m.SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw}, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def client(smollm2_dir, vt_cache_dir) -> Iterator[EngineCoreClient]:
    runtime = Path(tempfile.mkdtemp(prefix="vtllm-abuse-"))
    address = f"ipc://{runtime}/engine.sock"
    log = runtime / "engine.log"
    env = {**os.environ, "VT_CACHE_DIR": str(vt_cache_dir), "PYTHONUNBUFFERED": "1"}
    args = [arg for pair in LIMITS.items() for arg in pair]
    command = [sys.executable, "-m", "vtllm.cli", "engine-core", "--engine-address", address]
    command += ["--kv-cache-memory", "64MiB", "--max-model-len", "256", *args]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while "engine core ready at" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        with EngineCoreClient(address, "abuse-test", timeout_s=30) as engine_client:
            yield engine_client
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        print(log.read_text()[-4000:])


def _finish(client: EngineCoreClient, request_id: str) -> list[m.RequestOutput]:
    outputs = list(client.stream(request_id, timeout_s=30))
    assert outputs and outputs[-1].finish_reason is not None
    return outputs


def _tokens(outputs: list[m.RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def _served_promptly(client: EngineCoreClient, request_id: str) -> list[int]:
    start = time.monotonic()
    client.add_request(request_id, PROMPT, _greedy(4))
    outputs = _finish(client, request_id)
    assert outputs[-1].finish_reason == m.FinishReason.LENGTH, outputs[-1].error
    assert len(_tokens(outputs)) == 4
    assert time.monotonic() - start < 10
    return _tokens(outputs)


@pytest.mark.parametrize("field", ["presence_penalty", "temperature", "top_p"])
def test_nan_over_msgpack_is_refused_naming_the_field(client, field) -> None:
    client.add_request(f"nan-{field}", PROMPT, _greedy(4, **{field: math.nan}))
    [output] = _finish(client, f"nan-{field}")
    assert output.finish_reason == m.FinishReason.ERROR
    assert output.error_code == m.ErrorCode.INVALID_REQUEST and output.error_param == field
    _served_promptly(client, f"after-nan-{field}")


def test_a_tiny_temperature_is_greedy_not_garbage(client) -> None:
    greedy = _served_promptly(client, "greedy")
    client.add_request("tiny", PROMPT, m.SamplingParams(temperature=1e-38, max_tokens=4))
    tiny = _tokens(_finish(client, "tiny"))
    assert tiny == greedy and tiny != [0] * 4


def test_a_long_request_id_is_refused(client) -> None:
    request_id = "x" * 100_000
    client.add_request(request_id, PROMPT, _greedy(4))
    [output] = _finish(client, request_id)
    assert output.error_param == "request_id"
    assert "100000 bytes" in output.error and "--max-request-id-bytes" in output.error
    _served_promptly(client, "after-long-id")


def test_a_reused_live_id_leaves_the_live_request_alone(client) -> None:
    client.add_request("live", PROMPT, _greedy(24))
    with pytest.raises(ValueError, match="already in flight"):
        client.add_request("live", PROMPT, _greedy(2))  # the client refuses it itself
    # a client without that check: the engine refuses the add, not the live request
    client._send(m.AddRequest("live", PROMPT, _greedy(2)))
    outputs = _finish(client, "live")
    assert outputs[-1].finish_reason == m.FinishReason.LENGTH
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert len(_tokens(outputs)) == 24


def test_a_flood_of_adds_is_refused_as_busy_and_the_engine_recovers(client) -> None:
    ids = [f"flood-{i}" for i in range(40)]
    for request_id in ids:
        client.add_request(request_id, PROMPT, _greedy(16))
    finals = {request_id: _finish(client, request_id)[-1] for request_id in ids}
    served = [r for r, o in finals.items() if o.finish_reason == m.FinishReason.LENGTH]
    refused = [o for o in finals.values() if o.finish_reason == m.FinishReason.ERROR]
    assert len(served) + len(refused) == len(ids)
    assert 1 <= len(served) <= 10  # 6 per client, 4 waiting: a flood queues no further
    for output in refused:
        assert output.error_code == m.ErrorCode.UNAVAILABLE  # HTTP 503
        assert "server busy" in output.error and "--max-" in output.error
    stats = client.utility("get_stats")
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0
    _served_promptly(client, "after-flood")
