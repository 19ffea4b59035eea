"""Model runner behaviour that needs no reference model: seeded sampling through whole
steps, preemption resume, and state bookkeeping."""

from __future__ import annotations

import pytest
import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import EngineSim, make_hf_model

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama_tied", path)
    return path


def _engine(model_dir, seed: int = 0) -> tuple[ModelRunner, EngineSim]:
    runner = ModelRunner.from_model_dir(model_dir, torch.device("cpu"), torch.float32, seed=seed)
    runner.init_kv_cache(num_blocks=64, block_size=4)
    return runner, EngineSim(runner.execute, num_blocks=64, block_size=4, seed=seed)


def _generate(engine: EngineSim, others: int, preempt_at: int | None = None) -> list[int]:
    prompt = [11, 12, 13, 14, 15]
    engine.add("seeded", prompt, SEEDED)
    for i in range(others):
        engine.add(f"other{i}", [20 + i] * (3 + i), SamplingParams(temperature=1.0))
    schedule = {rid: len(req.token_ids) for rid, req in engine.requests.items()}
    for step in range(NUM_TOKENS):
        engine.step(schedule)
        schedule = {rid: 1 for rid in engine.requests}
        if step == preempt_at:  # drop it, then re-send prompt + outputs in full
            request = engine.requests["seeded"]
            engine.free_blocks.extend(request.block_ids)
            engine.finished.append("seeded")
            request.block_ids, request.num_computed_tokens, request.sent = [], 0, False
            engine.step({rid: 1 for rid in engine.requests if rid != "seeded"})
            schedule["seeded"] = len(request.token_ids)
    return engine.requests["seeded"].token_ids[len(prompt) :]


def test_seeded_request_is_reproducible_across_batches_and_preemption(model_dir):
    alone = _generate(_engine(model_dir)[1], others=0)
    assert len(alone) == NUM_TOKENS
    assert _generate(_engine(model_dir, seed=5)[1], others=3) == alone
    assert _generate(_engine(model_dir, seed=6)[1], others=2, preempt_at=4) == alone


def test_unseeded_requests_follow_the_engine_seed(model_dir):
    def run(seed: int) -> list[int]:
        engine = _engine(model_dir, seed=seed)[1]
        engine.add("r", [1, 2, 3], SamplingParams(temperature=1.0))
        engine.step({"r": 3})
        for _ in range(NUM_TOKENS - 1):
            engine.step({"r": 1})
        return engine.requests["r"].token_ids

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_finished_requests_are_dropped(model_dir):
    runner, engine = _engine(model_dir)
    engine.add("a", [1, 2, 3], SamplingParams(temperature=0.0))
    engine.add("b", [4, 5], SamplingParams(temperature=0.0))
    engine.step({"a": 3, "b": 2})
    assert len(runner.states) == 2
    engine.finish("a")
    output = engine.step({"b": 1})
    assert output.request_ids == ["b"]
    assert "a" not in runner.states and len(runner.states) == 1


def test_empty_step_returns_empty_output(model_dir):
    _, engine = _engine(model_dir)
    output = engine.step({})
    assert output.request_ids == [] and output.sampled_token_ids == [] and output.errors == {}
