"""The model runner, driven with engine-style SchedulerOutputs, against transformers,
for every supported family (Llama, Mistral, Qwen2, Qwen3, Gemma 3) and for checkpoints
written sharded and in bf16 / fp16.

Tolerance: fp32 everywhere; full-vocab logprobs within atol 1e-4 (a logprob vector is the
logits up to a per-row constant, so this pins the logits), greedy tokens identical.
The test sequences grow to ~28 tokens, past the tiny models' 6-token sliding window.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from vtllm.protocol.messages import SamplingParams
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import VOCAB_SIZE, EngineSim, full_logprobs, hf_last_logprobs, make_hf_model

ATOL = 1e-4
GREEDY_ALL_LOGPROBS = SamplingParams(temperature=0.0, logprobs=VOCAB_SIZE)
NUM_DECODE_STEPS = 16


def _runner(model_dir) -> ModelRunner:
    runner = ModelRunner.from_model_dir(model_dir, torch.device("cpu"), torch.float32, seed=0)
    runner.init_kv_cache(num_blocks=64, block_size=4)
    return runner


def _check(engine: EngineSim, hf_model, output) -> None:
    """Every sampled row: its logprobs match the reference and its token is the argmax."""
    for i, request_id in enumerate(output.request_ids):
        sequence = engine.requests[request_id].token_ids[:-1]  # before the new token
        expected = hf_last_logprobs(hf_model, sequence)
        actual = full_logprobs(output, i, VOCAB_SIZE)
        torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
        assert output.sampled_token_ids[i] == int(expected.argmax())
        assert output.logprobs[i] == pytest.approx(float(expected.max()), abs=ATOL)


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "gemma3"])
def test_prefill_whole_then_decode_two_requests(kind, tmp_path):
    _prefill_then_decode(tmp_path, make_hf_model(kind, tmp_path))


@pytest.mark.parametrize("kind,file_dtype", [("gemma3", torch.bfloat16), ("qwen3", torch.float16)])
def test_sharded_half_precision_checkpoint(kind, file_dtype, tmp_path):
    """Weights written in ``file_dtype`` over several shards, loaded into fp32: the
    reference is transformers loading the same files into fp32."""
    written = make_hf_model(kind, tmp_path / "fp32").to(file_dtype)
    model_dir = tmp_path / "sharded"
    written.save_pretrained(model_dir, max_shard_size="100KB")
    assert len(list(model_dir.glob("*.safetensors"))) > 2
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert hf_model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    _prefill_then_decode(model_dir, hf_model.eval())


def _prefill_then_decode(model_dir, hf_model) -> None:
    """Two requests prefilled whole in one step, then 16 decode steps of both."""
    engine = EngineSim(_runner(model_dir).execute, num_blocks=64, block_size=4)
    prompts = {"a": [5, 9, 17, 33, 65, 1, 7, 11, 13, 100, 4], "b": [8, 3, 120, 6, 6, 42]}
    for request_id, prompt in prompts.items():
        engine.add(request_id, prompt, GREEDY_ALL_LOGPROBS)
    output = engine.step({rid: len(p) for rid, p in prompts.items()})
    assert output.request_ids == ["a", "b"]
    _check(engine, hf_model, output)
    for _ in range(NUM_DECODE_STEPS):
        output = engine.step({"a": 1, "b": 1})
        assert output.errors == {}
        _check(engine, hf_model, output)
    assert len(engine.requests["a"].token_ids) == len(prompts["a"]) + 1 + NUM_DECODE_STEPS


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_chunked_prefill_mixed_with_decode(kind, tmp_path):
    """Request a prefills in chunks of 5 (no token until the last chunk) while request b
    decodes in the same steps; then both decode. Gemma 3's local layers see each chunk's
    window reach back into the cached prefix."""
    hf_model = make_hf_model(kind, tmp_path)
    engine = EngineSim(_runner(tmp_path).execute, num_blocks=64, block_size=4, seed=1)
    prompt_a = list(range(10, 33))  # 23 tokens: chunks 5, 5, 5, 5, 3
    engine.add("b", [7, 8, 9], GREEDY_ALL_LOGPROBS)
    _check(engine, hf_model, engine.step({"b": 3}))
    engine.add("a", prompt_a, GREEDY_ALL_LOGPROBS)
    chunks = [5, 5, 5, 5, 3]
    for chunk_idx, chunk in enumerate(chunks):
        output = engine.step({"a": chunk, "b": 1})
        last = chunk_idx == len(chunks) - 1
        assert output.request_ids == (["a", "b"] if last else ["b"])
        _check(engine, hf_model, output)
    for _ in range(NUM_DECODE_STEPS):
        _check(engine, hf_model, engine.step({"b": 1, "a": 1}))


def test_prefix_hit_and_resume_after_preemption(tmp_path):
    """A request that arrives with KV already computed (prefix hit), and a request that is
    preempted, dropped, and re-sent in full with its outputs, continue exactly."""
    hf_model = make_hf_model("qwen3", tmp_path)
    runner = _runner(tmp_path)
    engine = EngineSim(runner.execute, num_blocks=64, block_size=4, seed=2)
    engine.add("a", list(range(40, 52)), GREEDY_ALL_LOGPROBS)
    engine.step({"a": 12})
    for _ in range(3):
        engine.step({"a": 1})
    # preempt: the engine frees the request and later re-sends everything as new
    request = engine.requests["a"]
    engine.free_blocks.extend(request.block_ids)
    engine.finished.append("a")
    request.block_ids, request.num_computed_tokens, request.sent = [], 0, False
    output = engine.step({"a": len(request.token_ids) - 1})
    assert output.request_ids == []
    output = engine.step({"a": 1})
    _check(engine, hf_model, output)
    assert len(runner.states) == 1


def test_bad_schedule_is_a_per_request_error(tmp_path):
    make_hf_model("llama_tied", tmp_path)
    engine = EngineSim(_runner(tmp_path).execute, num_blocks=64, block_size=4)
    engine.add("ok", [1, 2, 3], SamplingParams(temperature=0.0))
    engine.add("bad", [4, 5], SamplingParams(temperature=0.0))
    engine.requests["bad"].sent = True  # never sent in full: the worker has no state for it
    output = engine.step({"ok": 3, "bad": 2})
    assert output.request_ids == ["ok"]
    assert "no state" in output.errors["bad"]
    engine.add("fine", [9, 9], SamplingParams(temperature=0.0))
    ok = engine.requests["ok"]
    ok.token_ids.append(0)
    ok.num_tokens_sent = len(ok.token_ids)  # a token the worker is never told about
    output = engine.step({"ok": 2, "fine": 2})
    assert output.request_ids == ["fine"]
    assert "only 3 tokens are known" in output.errors["ok"]
