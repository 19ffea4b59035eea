"""Structured outputs through ``ModelRunner.execute``: a random-weight model under a
grammar still writes output that parses and validates, in every sampling mode; the packed
bitmask masks exactly the tokens it should; reasoning (start-after token), preemption and
bad specs."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vtllm.protocol.messages import SamplingParams, StructuredOutputKind, StructuredOutputSpec
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.sampler import apply_token_bitmask

from .tiny_models import VOCAB_SIZE, EngineSim, make_hf_model

pytest.importorskip("xgrammar")

EOS = [2, 3]
CORPUS = [
    '{"name": "alpha", "count": 12, "ok": true, "tags": ["x", "y"]}',
    '{"a": {"b": [1, 2, 3]}, "c": false, "d": null, "e": -4.5}',
    'abc-123 yes no maybe 0123456789 {}[],:" true false null',
] * 20


def _train_tokenizer() -> Tokenizer:
    """A byte-level BPE of exactly the tiny models' 512 ids; ids 2 and 3 are their EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<|end|>", "<think>", "</think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured")
    make_hf_model("llama", path, seed=3)
    _train_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _runner(model_dir) -> tuple[ModelRunner, EngineSim]:
    runner = ModelRunner.from_model_dir(model_dir, torch.device("cpu"), torch.float32, seed=1)
    runner.init_kv_cache(num_blocks=512, block_size=8)
    return runner, EngineSim(runner.execute, num_blocks=512, block_size=8, seed=1)


@pytest.fixture(scope="module")
def shared_runner(model_dir):
    return _runner(model_dir)


def _generate(sim: EngineSim, requests: dict[str, SamplingParams], max_tokens: int = 160):
    """Run ``requests`` together to EOS (or ``max_tokens``); their outputs and errors."""
    prompt = [1, 40, 41, 42]
    for request_id, params in requests.items():
        sim.add(request_id, prompt, params)
    outputs = {r: [] for r in requests}
    errors: dict[str, str] = {}
    schedule = {r: len(prompt) for r in requests}
    while schedule:
        result = sim.step(schedule)
        errors.update(result.errors)
        for request_id in result.errors:
            schedule.pop(request_id, None)
            sim.finish(request_id)
        for request_id, token_id in zip(result.request_ids, result.sampled_token_ids, strict=True):
            if request_id in errors:
                continue
            outputs[request_id].append(token_id)
            if token_id in EOS or len(outputs[request_id]) >= max_tokens:
                schedule.pop(request_id)
                sim.finish(request_id)
            else:
                schedule[request_id] = 1
    return outputs, errors


MODES = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=1.0),
    "top_k_top_p": dict(temperature=0.8, top_k=20, top_p=0.9),
    "penalties_logprobs": dict(
        temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3
    ),
    "bias_min_p": dict(temperature=1.5, min_p=0.05, logit_bias={2: 100.0, 3: 50.0}),
}


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects of bounded scalars, enums, short strings and short arrays (every value
    finite, so a model that picks tokens at random still reaches the end)."""

    def scalar() -> dict:
        choice = rng.randrange(4)
        if choice == 0:
            low = rng.randint(-50, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        if choice == 1:
            return {"type": "boolean"}
        if choice == 2:
            return {"enum": rng.sample(["red", "green", "blue", "a b", 'q"t'], rng.randint(1, 3))}
        return {"type": "string", "maxLength": rng.randint(1, 6)}

    properties = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.randrange(4 if depth < 1 else 3)
        if kind == 2:
            properties[f"k{i}"] = {
                "type": "array",
                "items": scalar(),
                "maxItems": rng.randint(0, 3),
            }
        elif kind == 3:
            properties[f"k{i}"] = _random_schema(rng, depth + 1)
        else:
            properties[f"k{i}"] = scalar()
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _valid(value, schema: dict) -> bool:
    """An independent check of the subset ``_random_schema`` writes."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok and schema["minimum"] <= value <= schema["maximum"]
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema["maxItems"]
            and all(_valid(v, schema["items"]) for v in value)
        )
    return (
        isinstance(value, dict)
        and set(value) == set(schema["properties"])
        and all(_valid(value[k], s) for k, s in schema["properties"].items())
    )


def _text(tokenizer, token_ids: list[int]) -> str:
    assert token_ids and token_ids[-1] in EOS, f"did not end with EOS: {token_ids}"
    return tokenizer.decode(token_ids[:-1], skip_special_tokens=False)


def _spec(kind: StructuredOutputKind, spec: str = "", start: int | None = None):
    return StructuredOutputSpec(kind, spec, start)


@pytest.mark.parametrize("seed", range(4))
def test_random_schemas_give_valid_json_in_every_sampling_mode(shared_runner, tokenizer, seed):
    _, sim = shared_runner
    rng = random.Random(seed)
    schemas = {mode: _random_schema(rng) for mode in MODES}
    requests = {
        f"{seed}-{mode}": SamplingParams(
            **kwargs,
            seed=seed if mode == "random" else None,
            structured_output=_spec(StructuredOutputKind.JSON_SCHEMA, json.dumps(schemas[mode])),
        )
        for mode, kwargs in MODES.items()
    }
    outputs, errors = _generate(sim, requests)
    assert errors == {}
    for mode in MODES:
        text = _text(tokenizer, outputs[f"{seed}-{mode}"])
        # strict=False: xgrammar's JSON strings admit raw control characters other than
        # CR/LF (as in vLLM), which Python's strict parser refuses
        assert _valid(json.loads(text, strict=False), schemas[mode]), (mode, text)


def test_without_a_grammar_the_random_model_writes_no_json(shared_runner, tokenizer):
    """The control: the same model and modes, unconstrained, produce no valid JSON."""
    _, sim = shared_runner
    outputs, _ = _generate(sim, {f"free-{m}": SamplingParams(**k) for m, k in MODES.items()}, 40)
    for token_ids in outputs.values():
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_json_object_regex_choice_and_ebnf(shared_runner, tokenizer):
    _, sim = shared_runner
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    requests = {
        "object": SamplingParams(
            temperature=1.0,
            max_tokens=60,
            structured_output=_spec(StructuredOutputKind.JSON_OBJECT),
        ),
        "regex": SamplingParams(
            temperature=1.0,
            structured_output=_spec(StructuredOutputKind.REGEX, r"[a-c]{2,4}-[0-9]{3}"),
        ),
        "choice": SamplingParams(
            temperature=1.0,
            structured_output=_spec(
                StructuredOutputKind.CHOICE, json.dumps(["yes", "no", 'say "hi"'])
            ),
        ),
        "ebnf": SamplingParams(
            temperature=1.0, structured_output=_spec(StructuredOutputKind.GRAMMAR, grammar)
        ),
    }
    outputs, errors = _generate(sim, requests, max_tokens=400)
    assert errors == {}
    assert isinstance(json.loads(_text(tokenizer, outputs["object"]), strict=False), dict)
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", _text(tokenizer, outputs["regex"]))
    assert _text(tokenizer, outputs["choice"]) in ("yes", "no", 'say "hi"')
    assert re.fullmatch(r"\(([1-9][0-9]?)(\+[1-9][0-9]?)*\)", _text(tokenizer, outputs["ebnf"]))


def test_grammar_applies_only_after_the_start_token(shared_runner, tokenizer):
    """A reasoning model thinks freely; the answer after ``</think>`` follows the regex."""
    _, sim = shared_runner
    end_think = tokenizer.token_to_id("</think>")
    bias = {end_think: 4.0}  # so the random model ends its thinking within a few tokens
    params = SamplingParams(
        temperature=1.0,
        seed=5,
        logit_bias=bias,
        structured_output=_spec(StructuredOutputKind.REGEX, "[xyz]{3}", start=end_think),
    )
    outputs, errors = _generate(sim, {"think": params}, max_tokens=200)
    assert errors == {}
    token_ids = outputs["think"]
    cut = token_ids.index(end_think)
    assert re.fullmatch("[xyz]{3}", _text(tokenizer, token_ids[cut + 1 :]))


def test_preempted_request_resumes_under_the_same_grammar(model_dir, tokenizer):
    """Dropped mid-answer and re-sent with its outputs (recompute), the request's fresh
    matcher replays them and the output still matches."""
    runner, sim = _runner(model_dir)
    pattern = r"[a-z]{5,12}\.[0-9]{4}"
    params = SamplingParams(
        temperature=1.0, seed=2, structured_output=_spec(StructuredOutputKind.REGEX, pattern)
    )
    sim.add("p", [1, 40], params)
    sim.step({"p": 2})
    for _ in range(3):
        sim.step({"p": 1})
    request = sim.requests["p"]
    sim.finished.append("p")  # preempted: the worker forgets it ...
    request.sent, request.num_computed_tokens, request.block_ids = False, 0, []
    sim.step({"p": len(request.token_ids)})  # ... and gets it back in full
    assert runner.structured is not None and len(runner.structured) == 1
    while request.token_ids[-1] not in EOS and len(request.token_ids) < 60:
        sim.step({"p": 1})
    assert re.fullmatch(pattern, _text(tokenizer, request.token_ids[2:]))


def test_invalid_spec_fails_only_its_request(shared_runner):
    _, sim = shared_runner
    requests = {
        "bad": SamplingParams(
            structured_output=_spec(StructuredOutputKind.JSON_SCHEMA, '{"type": "nope"}')
        ),
        "good": SamplingParams(max_tokens=3),
    }
    invalid: list[str] = []
    execute = sim.execute

    def recording(step):
        output = execute(step)
        invalid.extend(output.invalid_request_ids)
        return output

    sim.execute = recording
    try:
        outputs, errors = _generate(sim, requests, max_tokens=3)
    finally:
        sim.execute = execute
    assert list(errors) == ["bad"]
    assert "invalid json_schema" in errors["bad"] and "nope" in errors["bad"]
    assert invalid == ["bad"]  # the request's own fault: INVALID_REQUEST (HTTP 400)
    assert len(outputs["good"]) == 3


def test_a_format_no_token_can_continue_fails_as_the_requests_fault(smollm2_dir):
    """SmolLM2's byte-level vocabulary has no token for the bytes 0xF1/0xF2, so a regex
    for U+A21E9 reaches a state no token continues (found by the HTTP fuzzer: the empty
    mask let the sampler draw token 0, which the grammar refused → a 500). That row fails
    with a message naming the cause; the other rows keep their masks."""
    from vtllm.worker.grammar import GrammarCompilerService, StructuredOutputs

    service = GrammarCompilerService(smollm2_dir, 49152, [2])
    try:
        grammars = StructuredOutputs(service)
        grammars.add("dead-end", _spec(StructuredOutputKind.REGEX, "\U000a21e9"))
        grammars.add("fine", _spec(StructuredOutputKind.REGEX, "[a-z]+"))
        bitmask, errors = grammars.bitmask([("dead-end", [1, 2], 2), ("fine", [1, 2], 2)])
    finally:
        service.shutdown()
    assert list(errors) == ["dead-end"]
    assert "allows no token of this model's vocabulary" in errors["dead-end"]
    assert bitmask is not None and bitmask.rows == [1] and bitmask.bitmask.shape[0] == 1
    assert bool(bitmask.bitmask.ne(0).any())


def _reports(grammars, count: int, deadline_s: float = 30.0) -> dict:
    """``count`` reports from ``take_ready``, keyed by request id."""
    deadline = time.monotonic() + deadline_s
    reports: dict = {}
    while len(reports) < count:
        assert time.monotonic() < deadline, f"only {reports} within {deadline_s}s"
        for request_id, seq, error in grammars.take_ready():
            assert request_id not in reports, f"{request_id} reported twice"
            reports[request_id] = (seq, error)
        time.sleep(0.005)
    return reports


def test_prepared_grammars_are_reported_once_held_until_released(model_dir, tokenizer):
    """The engine core's CompileGrammar / GrammarReady / ReleaseGrammars on the driver:
    each compile is reported once with its seq (xgrammar's reason when it fails); the
    compile is held for the request across preemption and forgotten on release, also
    while it still runs (then never reported)."""
    runner, sim = _runner(model_dir)
    grammars = runner.grammars()
    pattern = r"[a-z]{3}\.[0-9]{2}"
    spec = _spec(StructuredOutputKind.REGEX, pattern)
    grammars.prepare("a", 7, spec)
    grammars.prepare("bad", 8, _spec(StructuredOutputKind.JSON_SCHEMA, '{"type": "nope"}'))
    reports = _reports(grammars, 2)
    assert reports["a"] == (7, None)
    assert reports["bad"][0] == 8 and 'Unsupported type "nope"' in reports["bad"][1]
    assert grammars.take_ready() == [] and not grammars.has_unreported
    grammars.release(["bad"])
    assert grammars.num_held() == 1
    held = grammars._held["a"]
    sim.add("a", [1, 40], SamplingParams(temperature=1.0, seed=3, structured_output=spec))
    sim.step({"a": 2})
    sim.finished.append("a")  # preempted: the matcher goes, the held compile stays
    request = sim.requests["a"]
    request.sent, request.num_computed_tokens, request.block_ids = False, 0, []
    sim.step({"a": len(request.token_ids)})
    assert grammars._grammars["a"].compiled is held
    while request.token_ids[-1] not in EOS and len(request.token_ids) < 40:
        sim.step({"a": 1})
    assert re.fullmatch(pattern, _text(tokenizer, request.token_ids[2:]))
    grammars.release(["a"])
    assert grammars.num_held() == 0
    late = _spec(StructuredOutputKind.REGEX, "[0-9]{1,40}x")
    grammars.prepare("c", 9, late)
    grammars.release(["c"])  # aborted while compiling
    grammars.compilers.compile(late).result(timeout=30)
    assert grammars.take_ready() == [] and grammars.num_held() == 0


def test_apply_token_bitmask_matches_a_per_token_reference():
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32
    logits = torch.randn(4, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    rows = torch.tensor([3, 1])
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for token in range(vocab):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)
