"""Teacher-forced greedy runs of one model under two KV-cache dtypes, compared step by step
(the FP8 KV-cache accuracy tests and ``benchmarks/kv_cache_dtype_accuracy.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.platform import Platform

from .tiny_models import EngineSim

PROMPTS = [
    "The history of the printing press begins in",
    "Write a short poem about the sea and the wind.",
    "def fibonacci(n):\n    ",
    "Question: What is the capital of France? Answer:",
    "In a small village at the foot of the mountains there lived an old clockmaker who",
    "Explain, step by step, how a refrigerator keeps food cold.",
]


def prompts(model_dir: Path) -> list[list[int]]:
    """``PROMPTS`` tokenised, or token-id patterns for a model without a tokenizer
    (dummy weights)."""
    if not (model_dir / "tokenizer.json").is_file():
        return [[(97 * i + 13 * j) % 150000 + 10 for j in range(9 + 23 * i)] for i in range(6)]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in PROMPTS]


def greedy_run(
    model_dir: Path,
    platform: Platform,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype | None,
    num_steps: int,
    graphs: bool = False,
    forced: list | None = None,
) -> list:
    """Prefill the prompts, then ``num_steps`` greedy decodes (top-5 logprobs); with
    ``forced`` (another run's outputs), each step continues from that run's tokens
    (teacher forcing), so both runs see the same contexts at every step. A model
    without a tokenizer gets dummy weights. On CPU the kernels' torch references run
    (the only CPU attention that reads FP8 caches)."""
    dummy = not (model_dir / "tokenizer.json").is_file()
    runner = ModelRunner.from_model_dir(
        model_dir,
        platform.device,
        dtype,
        seed=0,
        load_format="dummy" if dummy else "auto",
        kv_cache_dtype=kv_cache_dtype,
    )
    runner.init_kv_cache(num_blocks=512, block_size=16)
    runner.attention_backend = "triton"
    if graphs:
        runner.capture_decode_graphs(platform, 8, 1024)
    engine = EngineSim(runner.execute, num_blocks=512, block_size=16)
    params = SamplingParams(temperature=0.0, logprobs=5)
    for i, prompt in enumerate(prompts(model_dir)):
        engine.add(f"r{i}", prompt, params)
    outputs = [engine.step({rid: len(r.token_ids) for rid, r in engine.requests.items()})]
    for step in range(num_steps):
        if forced is not None:
            tokens = forced[step].sampled_token_ids
            for rid, token in zip(outputs[-1].request_ids, tokens, strict=True):
                engine.requests[rid].token_ids[-1] = token
        outputs.append(engine.step({rid: 1 for rid in engine.requests}))
    return outputs


def compare_runs(reference: list, actual: list) -> tuple[int, int, float, float]:
    """(agreeing greedy picks, picks, worst and mean |Δ logprob| of the reference's pick
    where the actual run's top 5 holds it)."""
    picks = agree = 0
    deltas = []
    for expected, got in zip(reference, actual, strict=True):
        assert got.request_ids == expected.request_ids
        for i in range(len(expected.request_ids)):
            picks += 1
            want_id = expected.sampled_token_ids[i]
            agree += got.sampled_token_ids[i] == want_id
            want = dict(expected.top_logprobs[i])[want_id]
            have = dict(got.top_logprobs[i]).get(want_id)
            if have is not None:
                deltas.append(abs(have - want))
    return agree, picks, max(deltas), sum(deltas) / len(deltas)
