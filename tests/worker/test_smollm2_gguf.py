"""The embedded SmolLM2-135M (converted from GGUF by gguf_convert) against transformers on
the same converted directory, fp32: identical greedy tokens for 3 prompts x 32 tokens,
and the top-20 logprobs of every generated position within atol 2e-3 (30 layers of fp32
with different matmul orders)."""

from __future__ import annotations

import pytest
import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import EngineSim

NUM_NEW_TOKENS = 32
TOP_N = 20
ATOL = 2e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    gguf_convert = pytest.importorskip("vtllm.worker.loader.gguf_convert")
    try:
        return gguf_convert.resolve_model_dir(None, tmp_path_factory.mktemp("vt_cache"))
    except FileNotFoundError as e:  # the embedded GGUF package is not installed
        pytest.skip(str(e))


def test_greedy_tokens_and_logprobs_match_transformers(smollm2_dir):
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in PROMPTS]
    runner = ModelRunner.from_model_dir(smollm2_dir, torch.device("cpu"), torch.float32, seed=0)
    runner.init_kv_cache(num_blocks=64, block_size=16)
    engine = EngineSim(runner.execute, num_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, logprobs=TOP_N)
    top_logprobs: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    schedule = {}
    for i, prompt in enumerate(prompts):
        engine.add(str(i), prompt, params)
        schedule[str(i)] = len(prompt)
    for _ in range(NUM_NEW_TOKENS):
        output = engine.step(schedule)
        for request_id, top in zip(output.request_ids, output.top_logprobs, strict=True):
            top_logprobs[request_id].append(top)
        schedule = {request_id: 1 for request_id in schedule}

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32
    ).eval()
    for i, prompt in enumerate(prompts):
        # teacher-forced on our tokens: if the reference's argmax at every position is our
        # next token, its own greedy generation is exactly our sequence
        sequence = engine.requests[str(i)].token_ids
        assert len(sequence) == len(prompt) + NUM_NEW_TOKENS
        with torch.no_grad():
            logits = hf_model(torch.tensor([sequence[:-1]])).logits[0].float()
        reference = torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)  # [32, vocab]
        assert reference.argmax(-1).tolist() == sequence[len(prompt) :], PROMPTS[i]
        for step, top in enumerate(top_logprobs[str(i)]):
            ids = [token_id for token_id, _ in top]
            actual = torch.tensor([logprob for _, logprob in top])
            torch.testing.assert_close(actual, reference[step, ids], atol=ATOL, rtol=0)
