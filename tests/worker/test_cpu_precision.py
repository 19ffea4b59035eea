"""bf16 arithmetic for CPU prompt steps (``worker/cpu_precision.py``): when it is on, how
it is switched, and that a prefill in it stays within the stated tolerance of float32
(tests/conftest.py turns it off for the rest of the suite)."""

from __future__ import annotations

import pytest
import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker import cpu_precision
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import EngineSim, greedy_tokens, make_hf_model, readme_prompt

ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
ZEN3 = frozenset({"avx2", "fma"})


def test_auto_is_on_for_float32_models_on_cpus_with_native_bf16():
    enabled = cpu_precision.bf16_prefill_enabled
    assert enabled("auto", False, torch.float32, ZEN4)
    assert enabled("auto", False, torch.float32, SAPPHIRE_RAPIDS)
    assert not enabled("auto", False, torch.float32, ZEN3)  # emulated bf16: slower
    assert enabled("on", False, torch.float32, ZEN3)
    assert not enabled("off", False, torch.float32, SAPPHIRE_RAPIDS)
    assert not enabled("on", False, torch.bfloat16, ZEN3)  # already bf16
    assert not enabled("on", True, torch.float32, ZEN4)  # GPUs have their own


def test_cpu_flags_reads_the_flags_line():
    cpuinfo = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\nbugs\t\t: spectre\n"
    assert cpu_precision.cpu_flags(cpuinfo) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_precision.cpu_flags("processor : 0\n") == frozenset()


def test_bf16_products_switches_onednn_and_restores_it():
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if matmul is None or not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no oneDNN fp32_precision setting")
    before = matmul.fp32_precision
    with cpu_precision.bf16_products(True):
        assert matmul.fp32_precision == "bf16"
        with cpu_precision.bf16_products(False):
            assert matmul.fp32_precision == "bf16"  # off: leaves the setting alone
    assert matmul.fp32_precision == before


def _prefill_logprobs(model_dir, chunks: list[int], bf16: bool, monkeypatch) -> list[float]:
    """Log-probabilities of the top 5 after a 40-token prompt prefilled in ``chunks``."""
    monkeypatch.setenv("VT_CPU_BF16_PREFILL", "on" if bf16 else "off")
    runner = ModelRunner.from_model_dir(model_dir, torch.device("cpu"), torch.float32, seed=0)
    assert runner.bf16_prefill == bf16
    runner.init_kv_cache(num_blocks=16, block_size=4)
    engine = EngineSim(runner.execute, num_blocks=16, block_size=4)
    prompt = [(7 * i + 3) % 200 + 5 for i in range(sum(chunks))]
    engine.add("r", prompt, SamplingParams(temperature=0.0, logprobs=5))
    for chunk in chunks:
        output = engine.step({"r": chunk})
    return output.top_logprobs[0]


@pytest.mark.parametrize("chunks", [[40], [16, 24]], ids=["one chunk", "two chunks"])
def test_bf16_prefill_stays_within_tolerance_of_float32(tmp_path, monkeypatch, chunks):
    """A tiny Llama (random weights of std 0.02): the top-5 tokens after the prompt are
    float32's, their log-probabilities within 0.005 (5e-4 seen); the second chunk attends over a
    cached prefix with its mask in bf16."""
    make_hf_model("llama", tmp_path)
    float32 = _prefill_logprobs(tmp_path, chunks, False, monkeypatch)
    bf16 = _prefill_logprobs(tmp_path, chunks, True, monkeypatch)
    assert [t for t, _ in bf16] == [t for t, _ in float32]
    for (_, got), (_, want) in zip(bf16, float32, strict=True):
        assert got == pytest.approx(want, abs=0.005)


def test_embedded_model_answers_the_readme_question_with_bf16_prefill(smollm2_dir, monkeypatch):
    """What `make serve` does on a CPU with native bf16 (bf16 prompt steps, int4 decode)
    answers the README's question as float32 does."""
    from tokenizers import Tokenizer

    from vtllm.worker.layers import cpu_quant

    monkeypatch.setenv("VT_CPU_BF16_PREFILL", "on")
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    prompt = readme_prompt(tokenizer, system)
    runner = ModelRunner.from_model_dir(smollm2_dir, torch.device("cpu"), torch.float32, seed=0)
    assert runner.bf16_prefill
    cpu_quant.quantize_for_cpu(runner.model, "int4")
    runner.init_kv_cache(num_blocks=16, block_size=16)
    answer = tokenizer.decode(greedy_tokens(runner, prompt, 10))
    assert answer.startswith("The capital of France is Paris"), answer
