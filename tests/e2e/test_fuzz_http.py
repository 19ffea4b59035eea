"""Schema-driven HTTP fuzzing of the OpenAI endpoints with schemathesis.

Requests are generated from the server's own ``/openapi.json``: positive cases (valid for the
schema) and negative cases (invalid for it) for ``POST /v1/completions`` and
``POST /v1/chat/completions``. Every response must be a non-5xx that conforms to the documented
status codes, content types and JSON schemas, every request has a timeout (an event stream must
end with ``data: [DONE]`` within it), invalid requests must be rejected with a 4xx, and the
server must be healthy afterwards.

Hostile payloads ride on generated valid bodies: JSON nested far deeper than
``--max-json-depth`` or invalid UTF-8, put in a documented field, an unknown field or a key;
each must be a 400 in OpenAI shape, and a normal request must succeed promptly afterwards
on the same kept-alive session.

Bounded for CI: a fixed number of derandomized examples per operation and mode (no example
database), and the expensive knobs (``max_tokens``, ``n``, prompt batches) are capped inside
their valid ranges, so a run takes well under two minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import jsonschema_rs
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import ServerError
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.slow

OPERATIONS = ["/v1/completions", "/v1/chat/completions"]
MAX_MODEL_LEN = 256
REQUEST_TIMEOUT_S = 30.0
# examples per (operation, generation mode)
MAX_EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 40}
# caps inside the valid ranges, so that valid requests stay cheap
MAX_TOKENS_CAP = 8
N_CAP = 3
PROMPT_BATCH_CAP = 3

# valid requests run first (hypothesis' explicit phase), so every run reaches generation and
# checks full 200 responses (JSON and event streams) against the schema
SEEDS = {
    "/v1/completions": [
        {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        {"prompt": ["Once upon", [504, 3158]], "n": 2, "logprobs": 2, "echo": True, "seed": 7},
        {"prompt": "One, two,", "stream": True, "stream_options": {"include_usage": True}},
    ],
    "/v1/chat/completions": [
        {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, "temperature": 0},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
            ],
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "stop": ["."],
        },
        {
            "messages": [{"role": "user", "content": "Count: one, two,"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
        },
    ],
}


@pytest.fixture(scope="module")
def server(smollm2_dir, vt_cache_dir):
    with ServerProcess(
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--default-max-tokens",
        "4",
        cache_dir=vt_cache_dir,
    ).serving() as srv:
        yield srv


@pytest.fixture(scope="module")
def schema(server):
    config = schemathesis.Config.from_dict(
        {
            "base-url": server.url,
            "request-timeout": REQUEST_TIMEOUT_S,
            "request-retries": 0,
            # N_CAP choices x MAX_TOKENS_CAP tokens, plus role, usage and [DONE] events
            "max-stream-events": 1000,
        }
    )
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config, timeout=10)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integral_floats_to_ints(value):
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_to_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral_floats_to_ints(item) for key, item in value.items()}
    return value


def cheap(case, positive: bool):
    """Cap the cost of a generated request without leaving the valid range of any field (so a
    positive case stays valid and a negative case keeps its invalid part)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if positive:
        # JSON Schema's "integer" admits 1.0, which the server's strict decoder answers with a
        # 400 (see the report); send such numbers as 1 so valid cases get past decoding
        body = _integral_floats_to_ints(body)
        case.body = body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        # larger values exceed max_model_len and are rejected up front (cheap): keep those
        if _int(value) and MAX_TOKENS_CAP < value <= MAX_MODEL_LEN:
            body[key] = MAX_TOKENS_CAP
    for key in ("n", "best_of"):
        if _int(body.get(key)) and N_CAP < body[key] <= 128:
            body[key] = N_CAP
    messages = body.get("messages")
    if positive and isinstance(messages, list):
        # most generated messages have no content, which the chat template refuses (a 400,
        # checked by the negative cases too); give them some so more cases reach the engine
        for message in messages:
            if isinstance(message, dict) and message.get("content") is None:
                message["content"] = "Hello"
    prompt = body.get("prompt")
    # a batch of prompts (strings or token lists); negative cases keep theirs whole (whatever
    # is invalid about them may sit in a later item)
    if positive and isinstance(prompt, list) and prompt and not _int(prompt[0]):
        body["prompt"] = prompt[:PROMPT_BATCH_CAP]
    return case


def _content_type(response) -> str:
    value = response.headers.get("content-type", [""])
    return (value[0] if isinstance(value, list) else value) or ""


def json_response_conformance(ctx, response, case):
    """schemathesis' response schema check, for JSON bodies. (For ``text/event-stream`` the
    server documents ``schema: {type: string}`` under OpenAPI 3.1, which schemathesis reads as
    the schema of each event and so always fails; ``event_stream_conformance`` checks the
    events against the documented chunk schemas instead.)"""
    if _content_type(response).startswith("text/event-stream"):
        return None
    return response_schema_conformance(ctx, response, case)


# what one ``data:`` event of a 200 stream is, per the response descriptions
STREAM_EVENT_SCHEMAS = {
    "/v1/completions": "CompletionResponse",
    "/v1/chat/completions": "ChatCompletionChunk",
}


def event_stream_conformance(ctx, response, case):
    """A 200 event stream ends with ``data: [DONE]`` within the request timeout (no hang), and
    every other event is a documented chunk (or an error object)."""
    if response.status_code != 200 or not _content_type(response).startswith("text/event-stream"):
        return None
    assert not response.stream_cut_short, (
        f"event stream did not finish within {REQUEST_TIMEOUT_S}s:\n{response.text[-2000:]}"
    )
    events = [
        line[len("data:") :].strip()
        for line in response.text.splitlines()
        if line.startswith("data:")
    ]
    assert events and events[-1] == "[DONE]", f"stream without [DONE]:\n{response.text[-2000:]}"
    components = case.operation.schema.raw_schema["components"]
    chunk_name = STREAM_EVENT_SCHEMAS[case.operation.path]
    chunk = _validator(components, chunk_name)
    error = _validator(components, "ErrorResponse")
    for event in events[:-1]:
        value = json.loads(event)
        problems = [] if error.is_valid(value) else [e.message for e in chunk.iter_errors(value)]
        assert not problems, f"stream event violates {chunk_name}: {problems}\n{event}"
    return None


def _validator(components: dict, name: str):
    return jsonschema_rs.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": components}
    )


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    json_response_conformance,
    event_stream_conformance,
]


def fuzz(
    schema,
    path: str,
    mode: GenerationMode,
    *,
    max_examples: int,
    checks: list[Callable],
    base_url: str | None = None,
    seeds: Sequence[dict] = (),
) -> tuple[int, dict[int, int]]:
    """Run ``max_examples`` generated cases of ``POST path``; returns (cases, status counts)."""
    operation = schema[path]["POST"]
    positive = mode == GenerationMode.POSITIVE
    session = requests.Session()
    statuses: dict[int, int] = {}
    ran = 0

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode).map(lambda c: cheap(c, positive)))
    def run(case):
        nonlocal ran
        ran += 1
        response = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=checks)

    for body in seeds:
        run = example(case=operation.Case(body=body))(run)
    try:
        run()
    finally:
        session.close()
    return ran, statuses


def assert_healthy(server: ServerProcess) -> None:
    assert server.process.poll() is None, f"server exited:\n{server.tail()}"
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200, server.tail()
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 4, reply.text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", OPERATIONS)
def test_fuzz(server, schema, path, mode):
    checks = list(CHECKS)
    if mode == GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)
    started = time.monotonic()
    seeds = SEEDS[path] if mode == GenerationMode.POSITIVE else []
    ran, statuses = fuzz(
        schema, path, mode, max_examples=MAX_EXAMPLES[mode], checks=checks, seeds=seeds
    )
    print(
        f"POST {path} [{mode.value}]: {ran} cases in {time.monotonic() - started:.1f}s, "
        f"statuses {dict(sorted(statuses.items()))}"
    )
    assert ran >= MAX_EXAMPLES[mode] // 2, (ran, statuses)
    if mode == GenerationMode.POSITIVE:
        assert statuses.get(200, 0) > 0, statuses  # the fuzzing reached generation
    assert_healthy(server)


HOSTILE_EXAMPLES = 25
PLACEHOLDER = "__hostile__"
INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80"]


def _deep(kind: str, depth: int) -> bytes:
    if kind == "arrays":
        return b"[" * depth + b"]" * depth
    if kind == "objects":
        return b'{"a": ' * depth + b"1" + b"}" * depth
    return b'[{"a": ' * (depth // 2) + b"1" + b"}]" * (depth // 2)  # mixed


@st.composite
def hostile_bodies(draw, operation) -> tuple[bytes, str]:
    """A generated valid body with a hostile part spliced in: (bytes, what and where)."""
    case = draw(operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    body = case.body if isinstance(case.body, dict) else {}
    kind = draw(st.sampled_from(["arrays", "objects", "mixed", "utf8 value", "utf8 key"]))
    if kind == "utf8 key":
        key = draw(st.text("abc", max_size=3)) + PLACEHOLDER
        text = json.dumps({**body, key: 1}).encode()
        bad = draw(st.sampled_from(INVALID_UTF8))
        return text.replace(PLACEHOLDER.encode(), bad), f"{kind} {bad!r}"
    key = draw(st.sampled_from([*sorted(body), "x_unknown"]))
    if kind == "utf8 value":
        bad = draw(st.sampled_from(INVALID_UTF8))
        payload = (
            b'"' + draw(st.binary(max_size=4)).replace(b'"', b"").replace(b"\\", b"") + bad + b'"'
        )
    else:
        payload = _deep(kind, draw(st.sampled_from([66, 1_000, 100_000])))
    text = json.dumps({**body, key: PLACEHOLDER}).encode()
    return text.replace(f'"{PLACEHOLDER}"'.encode(), payload), f"{kind} in {key!r}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", OPERATIONS)
def test_hostile_payloads_are_400(server, schema, path):
    operation = schema[path]["POST"]
    session = requests.Session()
    seen: set[str] = set()

    @settings(
        max_examples=HOSTILE_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(hostile=hostile_bodies(operation))
    def run(hostile):
        body, where = hostile
        seen.add(where.split(" in ")[0].split(" b")[0])
        reply = session.post(
            f"{server.url}{path}",
            data=body,
            headers={"content-type": "application/json"},
            timeout=REQUEST_TIMEOUT_S,
        )
        assert reply.status_code == 400, (where, reply.status_code, reply.text[:300])
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}, reply.text

    try:
        started = time.monotonic()
        run()
        print(
            f"POST {path}: {HOSTILE_EXAMPLES} hostile bodies in {time.monotonic() - started:.1f}s"
        )
        started = time.monotonic()
        ok = session.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200 and time.monotonic() - started < 10, ok.text
    finally:
        session.close()
    assert len(seen) >= 4, seen  # the cases were varied
    assert server.process.poll() is None, server.tail()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200, server.tail()


def test_healthy_after_fuzzing(server):
    assert_healthy(server)


class _Always500(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"error": {"message": "boom", "type": "internal_error"}}'
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_harness_detects_server_errors(schema):
    """The same harness, pointed at an endpoint that always answers 500, fails."""
    fake = ThreadingHTTPServer(("127.0.0.1", 0), _Always500)
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(FailureGroup) as failure:
            fuzz(
                schema,
                "/v1/completions",
                GenerationMode.POSITIVE,
                max_examples=5,
                checks=[not_a_server_error],
                base_url=f"http://127.0.0.1:{fake.server_address[1]}",
            )
    finally:
        fake.shutdown()
        fake.server_close()
    assert [type(e) for e in failure.value.exceptions] == [ServerError], failure.value
