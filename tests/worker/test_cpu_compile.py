"""The compiled CPU decode step (``worker/cpu_compile.py``) and prompt step
(``worker/cpu_compile_prompt.py``) against the eager forward.

A tiny Llama: decode steps of changing batch sizes and positions give the eager step's
greedy tokens and logprobs (within fp32 rounding) and compile nothing after the warm-up;
so do prompt steps of changing lengths, whole or in chunks over a cached prefix.
The embedded SmolLM2: the same greedy tokens as eager for the README's question and the
model-vs-transformers prompts. The choice (VT_CPU_COMPILE auto / on / off,
--enforce-eager, unsupported models) and the fallback when a compiled step raises.
"""

from __future__ import annotations

import pytest
import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker import cpu_compile, cpu_compile_prompt
from vtllm.worker.layers.cpu_quant import quantize_for_cpu
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import EngineSim, make_hf_model

TOP_N = 5


@pytest.fixture
def compile_on(monkeypatch):
    monkeypatch.setenv("VT_CPU_COMPILE", "on")  # float32 models too (auto: quantised only)


def _runner(model_dir, compiled: bool, max_num_seqs: int = 8) -> ModelRunner:
    runner = ModelRunner.from_model_dir(model_dir, torch.device("cpu"), torch.float32, seed=0)
    runner.init_kv_cache(num_blocks=64, block_size=4)
    if compiled:
        assert runner.compile_cpu_steps(max_num_seqs)
    return runner


def _generate(runner: ModelRunner, prompts: dict[str, list[int]], steps: int) -> EngineSim:
    """Greedy with logprobs; requests join and leave so the decode batch size and the
    block-table width change from step to step."""
    engine = EngineSim(runner.execute, num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, logprobs=TOP_N)
    ids = list(prompts)
    engine.add(ids[0], prompts[ids[0]], params)
    engine.step({ids[0]: len(prompts[ids[0]])})
    engine.logprobs = {request_id: [] for request_id in ids}
    for step in range(steps):
        if step < len(ids) - 1:  # a new prompt prefills alone, then joins the decodes
            new_id = ids[step + 1]
            engine.add(new_id, prompts[new_id], params)
            engine.step({new_id: len(prompts[new_id])})
        schedule = {request_id: 1 for request_id in engine.requests}
        output = engine.step(schedule)
        for request_id, top in zip(output.request_ids, output.top_logprobs, strict=True):
            engine.logprobs[request_id].append(top)
    return engine


def _assert_same_top_logprobs(ours_per_step: list, theirs_per_step: list) -> None:
    """The same top tokens at every step, their log-probabilities within fp32 rounding."""
    for ours, theirs in zip(ours_per_step, theirs_per_step, strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in ours]),
            torch.tensor([lp for _, lp in theirs]),
            atol=1e-4,
            rtol=0,
        )


@pytest.mark.parametrize("max_layers_per_region", [8, 1], ids=["one region", "two regions"])
def test_compiled_decode_matches_eager_without_recompiles(
    tmp_path, compile_on, monkeypatch, max_layers_per_region
):
    """Two regions of one layer each share one graph per batch class, as one of two."""
    monkeypatch.setattr(cpu_compile, "MAX_LAYERS_PER_REGION", max_layers_per_region)
    make_hf_model("llama", tmp_path)
    prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12, 13, 14], "c": [3] * 11}
    eager = _generate(_runner(tmp_path, compiled=False), prompts, steps=9)

    torch._dynamo.reset()
    runner = _runner(tmp_path, compiled=True)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    compiled = _generate(runner, prompts, steps=9)
    assert (
        runner.cpu_steps.compiled_decode is not None
        and runner.cpu_steps.compiled_prompt is not None
    )
    assert runner.cpu_steps.compiled_decode.group_size == min(2, max_layers_per_region)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "a step recompiled"
    for request_id in prompts:
        assert compiled.requests[request_id].token_ids == eager.requests[request_id].token_ids
        _assert_same_top_logprobs(compiled.logprobs[request_id], eager.logprobs[request_id])


def _prompt_logprobs(runner: ModelRunner, chunked: dict[str, list[int]]) -> list:
    """Top log-probabilities after each prompt, prefilled in the given chunk lengths."""
    engine = EngineSim(runner.execute, num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, logprobs=TOP_N)
    tops = []
    for i, (request_id, chunks) in enumerate(chunked.items()):
        engine.add(request_id, [(11 * j + i) % 90 + 5 for j in range(sum(chunks))], params)
        for chunk in chunks:
            output = engine.step({request_id: chunk})
        tops.append(output.top_logprobs[0])
        engine.finish(request_id)
    return tops


def test_compiled_prompt_step_matches_eager_without_recompiles(tmp_path, compile_on):
    make_hf_model("llama", tmp_path)
    chunked = {"two": [2], "five": [5], "seventeen": [17], "chunked": [12, 9, 19]}
    eager = _prompt_logprobs(_runner(tmp_path, compiled=False), chunked)

    torch._dynamo.reset()
    runner = _runner(tmp_path, compiled=True)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    compiled = _prompt_logprobs(runner, chunked)
    assert runner.cpu_steps.compiled_prompt is not None
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "a prompt step recompiled"
    _assert_same_top_logprobs(compiled, eager)


def test_a_failing_compiled_step_falls_back_to_eager(tmp_path, compile_on):
    make_hf_model("llama", tmp_path)
    prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12]}
    eager = _generate(_runner(tmp_path, compiled=False), prompts, steps=3)
    runner = _runner(tmp_path, compiled=False)
    runner.cpu_steps.compiled_decode = cpu_compile.CompiledDecode(runner.model, runner.kv_caches, 4)

    def broken(*args, **kwargs):
        raise RuntimeError("compiler bug")

    runner.cpu_steps.compiled_decode._layers = broken  # not compiled at all: the first call raises
    runner.cpu_steps.compiled_prompt = cpu_compile_prompt.CompiledPrompt(runner.model)
    runner.cpu_steps.compiled_prompt._pre = broken
    fallen_back = _generate(runner, prompts, steps=3)
    assert runner.cpu_steps.compiled_decode is None and runner.cpu_steps.compiled_prompt is None
    for request_id in prompts:
        assert fallen_back.requests[request_id].token_ids == eager.requests[request_id].token_ids


def test_opt_outs_and_unsupported_models(tmp_path, monkeypatch, compile_on):
    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path, compiled=False)
    model = runner.model
    assert cpu_compile.compile_reason(model, is_gpu=False, enforce_eager=False) is None
    assert cpu_compile.compile_reason(model, is_gpu=False, enforce_eager=True) == "--enforce-eager"
    assert cpu_compile.compile_reason(model, is_gpu=True, enforce_eager=False) == "not on a CPU"
    assert cpu_compile.compile_reason(torch.nn.Linear(2, 2), False, False) == (
        "Linear has no compiled CPU decode step"
    )
    monkeypatch.setenv("VT_CPU_COMPILE", "auto")
    assert cpu_compile.compile_reason(model, False, False).startswith("weights not quantised")
    quantize_for_cpu(model, "int8")
    assert cpu_compile.compile_reason(model, is_gpu=False, enforce_eager=False) is None
    monkeypatch.setenv("VT_CPU_COMPILE", "off")
    assert not runner.compile_cpu_steps(8)
    assert runner.cpu_steps.compiled_decode is None


def test_smollm2_greedy_tokens_unchanged(smollm2_dir, compile_on):
    """The embedded model (float32, as served here) decodes the same greedy tokens
    compiled as eager: the README's question and three plain prompts, 24 tokens each."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    readme = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    texts = [readme, "The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    prompts = {str(i): tokenizer.encode(text).ids for i, text in enumerate(texts)}

    def generate(compiled: bool) -> dict[str, list[int]]:
        runner = ModelRunner.from_model_dir(smollm2_dir, torch.device("cpu"), torch.float32, seed=0)
        runner.init_kv_cache(num_blocks=64, block_size=16)
        if compiled:  # no warm-up: the first decode step compiles its one graph (batch 4)
            runner.cpu_steps.compiled_decode = cpu_compile.CompiledDecode(
                runner.model, runner.kv_caches, 16
            )
        engine = EngineSim(runner.execute, num_blocks=64, block_size=16)
        for request_id, prompt in prompts.items():
            engine.add(request_id, prompt, SamplingParams(temperature=0.0))
        engine.step({request_id: len(prompt) for request_id, prompt in prompts.items()})
        for _ in range(23):
            engine.step({request_id: 1 for request_id in prompts})
        assert (runner.cpu_steps.compiled_decode is not None) == compiled  # no fallback to eager
        return {r: engine.requests[r].token_ids[len(prompts[r]) :] for r in prompts}

    eager, compiled = generate(False), generate(True)
    assert compiled == eager
    assert tokenizer.decode(compiled["0"]).startswith("The capital of France is Paris")


def test_layers_per_region_splits_into_equal_groups():
    assert [cpu_compile.layers_per_region(n) for n in (30, 32, 28, 24, 22, 7, 2)] == [
        6,
        8,
        7,
        8,
        2,
        7,
        2,
    ]
