"""Structured outputs through the real engine core and a real worker process (a tiny
random-weight model with a trained tokenizer, xgrammar compiling on the driver): every
grammar compile is made slow with the ``VT_TEST_GRAMMAR_COMPILE_DELAY_S`` hook (as a huge
schema would be), and

- a request without a grammar gets all its tokens while another waits for its compile;
- a schema xgrammar refuses ends as INVALID_REQUEST naming xgrammar's reason;
- a request aborted while its grammar compiles leaves nothing: the engine core forgets it
  and the worker never reports that compile.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from tokenizers import Tokenizer

from tests.worker.test_structured_output import _train_tokenizer
from tests.worker.tiny_models import make_hf_model
from vtllm.config import VtllmConfig
from vtllm.engine_core.core import EngineCore
from vtllm.engine_core.core_proc import start_engine
from vtllm.protocol import messages as m
from vtllm.protocol import transport

pytest.importorskip("xgrammar")

DELAY_S = 1.5
DEADLINE_S = 30.0
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar_engine")
    make_hf_model("llama", path, seed=3)
    _train_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    config = VtllmConfig()
    config.model.model = str(model_dir)
    config.model.max_model_len = 128
    config.cache.kv_cache_memory = 8 * 2**20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dist_address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with pytest.MonkeyPatch.context() as env:  # the spawned worker inherits it
        env.setenv("VT_TEST_GRAMMAR_COMPILE_DELAY_S", str(DELAY_S))
        executor, facts = start_engine(
            config, str(model_dir), transport.ipc_address(model_dir, "workers.sock"), dist_address
        )
    try:
        yield EngineCore(config, facts, executor)
    finally:
        executor.shutdown()


def _add(core: EngineCore, request_id: str, params: m.SamplingParams) -> None:
    assert core.add_request(b"c", m.AddRequest(request_id, [1, 40, 41, 42], params)) == []


def _drive(core: EngineCore, until: set[str], events: list) -> dict[str, list]:
    """Step until every request in ``until`` finished; ``events`` gets (monotonic time,
    output) for every output. Returns each request's outputs."""
    deadline = time.monotonic() + DEADLINE_S
    outputs: dict[str, list] = {}
    while until - {r for r, outs in outputs.items() if outs[-1].finish_reason is not None}:
        assert time.monotonic() < deadline, f"not finished within {DEADLINE_S}s: {outputs}"
        if not core.has_work():
            time.sleep(0.005)
            continue
        for _, output in core.step()[0]:
            events.append((time.monotonic(), output))
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def _json_schema(schema: dict) -> m.StructuredOutputSpec:
    return m.StructuredOutputSpec(m.StructuredOutputKind.JSON_SCHEMA, json.dumps(schema))


def test_a_slow_grammar_does_not_delay_another_requests_tokens(engine, model_dir):
    started = time.monotonic()
    _add(engine, "json", m.SamplingParams(max_tokens=40, structured_output=_json_schema(SCHEMA)))
    _add(engine, "plain", m.SamplingParams(max_tokens=6, ignore_eos=True))
    events: list = []
    outputs = _drive(engine, {"json", "plain"}, events)
    plain_done = max(t for t, o in events if o.request_id == "plain")
    json_first = min(t for t, o in events if o.request_id == "json" and o.new_token_ids)
    # every token of "plain" came while the grammar of "json" was still compiling (when a
    # step waited for the compile, both got their first token from that same step)
    assert json_first - started >= DELAY_S, json_first - started
    assert plain_done < json_first, (plain_done - started, json_first - started)
    assert sum(len(o.new_token_ids) for o in outputs["plain"]) == 6
    # ... and "json" was then generated under its grammar
    token_ids = [t for o in outputs["json"] for t in o.new_token_ids]
    assert outputs["json"][-1].finish_reason == m.FinishReason.STOP, outputs["json"][-1]
    text = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(token_ids[:-1])
    value = json.loads(text)
    assert set(value) == {"n"} and 0 <= value["n"] <= 9


def test_an_uncompilable_schema_ends_as_invalid_request(engine):
    bad = _json_schema({"type": "integer", "minimum": 5, "maximum": 1})
    _add(engine, "bad", m.SamplingParams(max_tokens=4, structured_output=bad))
    (output,) = _drive(engine, {"bad"}, [])["bad"]
    assert output.finish_reason == m.FinishReason.ERROR and output.new_token_ids == []
    assert output.error_code == m.ErrorCode.INVALID_REQUEST
    assert "does not compile" in output.error and "minimum greater than maximum" in output.error


def test_aborting_a_request_waiting_for_its_grammar_leaves_no_state(engine):
    spec = _json_schema({**SCHEMA, "title": "aborted"})  # not in the compile cache yet
    _add(engine, "gone", m.SamplingParams(max_tokens=4, structured_output=spec))
    assert engine.step() == ([], None)  # waits for its grammar; no step runs
    ((_, output),) = engine.abort(["gone"], b"c")
    assert output.finish_reason == m.FinishReason.ABORT
    assert engine.scheduler.requests == {} and not engine.has_work()
    assert engine._awaiting_grammars == {} and engine._grammar_ids == set()
    # the worker forgot it too: its compile ends, and no GrammarReady is ever sent
    time.sleep(DELAY_S + 0.5)
    assert engine.executor.take_grammar_results(wait_s=0.2) == []
