"""CPU weight-only int8 / int4 linears (``layers/cpu_quant.py``): the packing round-trips,
each kernel agrees with a plain bf16 product by its dequantised weight, and a quantised
tiny model still generates from the same logits (within the stated tolerance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtllm.worker.attention import build_attention_metadata
from vtllm.worker.distributed import TPGroup
from vtllm.worker.layers import cpu_quant
from vtllm.worker.layers.linear import ColumnParallelLinear
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import greedy_tokens, make_hf_model, readme_prompt


def _q4_1_blocks(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A weight made of GGUF ``Q4_1`` blocks: ``min + scale * k`` with k in 0..15 using both
    ends, scale and min exact in bf16."""
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // 32
    k = torch.randint(0, 16, (out_features, groups, 32), generator=gen)
    k[..., 0], k[..., 1] = 0, 15
    scale = (torch.rand(out_features, groups, 1, generator=gen) * 0.01 + 1e-3).bfloat16().float()
    low = (torch.randn(out_features, groups, 1, generator=gen) * 0.05).bfloat16().float()
    return (low + scale * k).view(out_features, in_features)


def test_int4_recovers_q4_1_blocks_up_to_bf16_rounding():
    weight = _q4_1_blocks(32, 64, seed=0)
    _, _, dense = cpu_quant.quantize_int4(weight)
    # zero = min + 8 * scale is rounded to bf16: at most half an ulp of it per value
    torch.testing.assert_close(dense.float(), weight, atol=2e-3, rtol=0)
    assert (dense.float() - weight).abs().mean() < 2e-4


def test_int8_error_is_within_half_a_step():
    weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(1))
    q, scale, dense = cpu_quant.quantize_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    step = scale.float()[:, None]
    bf16_rounding = weight.abs() * 2.0**-8  # the dequantised weight is stored in bf16
    assert bool(((dense.float() - weight).abs() <= 0.501 * step + bf16_rounding).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("num_rows", [1, 5, cpu_quant.MAX_QUANTIZED_ROWS + 3])
def test_kernel_matches_product_by_dequantised_weight(quantization, num_rows, dtype):
    """Up to MAX_QUANTIZED_ROWS rows: the packed weights (x rounded to bf16); more: the
    dense weight as loaded, exactly."""
    gen = torch.Generator().manual_seed(num_rows)
    layer = ColumnParallelLinear(64, [32, 16], bias=True, tp=TPGroup())
    layer.weight.data = torch.randn(48, 64, generator=gen).to(dtype)
    layer.bias.data = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(num_rows, 64, generator=gen).to(dtype)
    loaded = layer.weight.data.clone()
    if quantization == "int8":
        _, _, dequantised = cpu_quant.quantize_int8(loaded)
        cpu_quant._install_int8(layer)
    else:
        _, _, dequantised = cpu_quant.quantize_int4(loaded)
        cpu_quant._install_int4(layer)
    assert layer.linear_method is not None and torch.equal(layer.weight, loaded)
    y = layer(x)
    assert y.dtype == dtype
    if num_rows > cpu_quant.MAX_QUANTIZED_ROWS:
        torch.testing.assert_close(y, F.linear(x, loaded) + layer.bias, atol=0, rtol=0)
        return
    expected = F.linear(x.bfloat16().float(), dequantised.float(), layer.bias.float())
    torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)


def test_int4_shape_rule():
    assert cpu_quant.int4_supported(torch.empty(48, 64))
    assert not cpu_quant.int4_supported(torch.empty(40, 64))  # outputs not a multiple of 16
    assert not cpu_quant.int4_supported(torch.empty(48, 40))  # inputs not a multiple of 32


def test_int4_pays_on_x86_with_avx2_only():
    zen3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
    zen4 = "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    assert cpu_quant.fast_int4_cpu(zen3) and cpu_quant.fast_int4_cpu(zen4)
    assert not cpu_quant.fast_int4_cpu("flags\t\t: fpu sse2 avx\n")  # pre-2013 x86
    assert not cpu_quant.fast_int4_cpu("Features\t: fp asimd evtstrm aes\n")  # arm64


def test_auto_picks_int4_only_for_a_4bit_gguf_where_it_pays():
    q4 = {"vtllm_gguf_linear_types": ["Q4_1"]}
    assert cpu_quant.choose_quantization(None, False, q4, fast_int4=True) == "int4"
    assert cpu_quant.choose_quantization(None, False, q4, fast_int4=False) == "none"
    assert cpu_quant.choose_quantization(None, True, q4, fast_int4=True) == "none"
    q8 = {"vtllm_gguf_linear_types": ["Q4_1", "Q8_0"]}
    assert cpu_quant.choose_quantization(None, False, q8, fast_int4=True) == "none"
    assert cpu_quant.choose_quantization(None, False, {}, fast_int4=True) == "none"
    assert cpu_quant.choose_quantization("fp8", False, q4, fast_int4=True) == "none"
    assert cpu_quant.choose_quantization("int8", False, {}, fast_int4=False) == "int8"
    assert cpu_quant.choose_quantization("none", False, q4, fast_int4=True) == "none"
    with pytest.raises(ValueError, match="CPU format"):
        cpu_quant.choose_quantization("int4", True, {}, fast_int4=True)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantised_tiny_model_keeps_its_logits(tmp_path, quantization):
    """A tied tiny Llama in float32: logits of a 5-token prompt (few rows: the quantised
    kernels serve every layer) within 0.1 of the unquantised model's (random weights of
    std 0.02: logits ~ ±1), and the same greedy token."""
    make_hf_model("llama_tied", tmp_path)
    prompt = [5, 6, 7, 8, 9]

    def logits(quant: str) -> tuple[torch.Tensor, ModelRunner]:
        runner = ModelRunner.from_model_dir(
            tmp_path, torch.device("cpu"), torch.float32, seed=0, cpu_quantization=quant
        )
        runner.init_kv_cache(num_blocks=4, block_size=4)
        metadata = build_attention_metadata([5], [5], [[1, 2]], 4, torch.device("cpu"))
        with torch.inference_mode():
            hidden = runner.model(
                torch.tensor(prompt), torch.arange(5), runner.kv_caches, metadata
            )  # [5, hidden]
            return runner.model.compute_logits(hidden[-1:])[0], runner

    reference, _ = logits("none")
    quantised, runner = logits(quantization)
    lm_head = runner.model.lm_head
    assert isinstance(lm_head.linear_method, cpu_quant.CpuInt8Method)
    # tied: the embedding still reads the loaded weight
    assert lm_head.weight is runner.model.model.embed_tokens.weight
    assert lm_head.weight.dtype == torch.float32
    expected_method = cpu_quant.CpuInt4Method if quantization == "int4" else cpu_quant.CpuInt8Method
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.linear_method, expected_method)
    torch.testing.assert_close(quantised, reference, atol=0.1, rtol=0)
    assert int(quantised.argmax()) == int(reference.argmax())


def test_embedded_model_answers_the_readme_question_from_int4_as_from_float32(smollm2_dir):
    """What `make serve` now does on any x86 CPU with AVX2 (int4 decode) answers the README's
    question with the same 16 greedy tokens as float32 (on this CI's CPU, bf16 native or
    emulated)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompt = readme_prompt(tokenizer)

    def generate(quantization: str) -> list[int]:
        runner = ModelRunner.from_model_dir(smollm2_dir, torch.device("cpu"), torch.float32, seed=0)
        if quantization != "none":
            cpu_quant.quantize_for_cpu(runner.model, quantization)
        runner.init_kv_cache(num_blocks=16, block_size=16)
        return greedy_tokens(runner, prompt, 16)

    int4 = generate("int4")
    assert int4 == generate("none")
    assert tokenizer.decode(int4).startswith("The capital of France is Paris")


def test_prompt_steps_read_the_dense_weights_however_few_rows(tmp_path):
    """A 5-token prompt (fewer rows than MAX_QUANTIZED_ROWS) through an int4 runner's
    steps: the prompt's step, and so its first token, is the unquantised model's to the
    last bit (a prefix-cache hit leaves as few as one prompt token to compute); the decode
    step after it reads the int4 weights."""
    from vtllm.protocol.messages import SamplingParams

    from .tiny_models import EngineSim

    make_hf_model("llama_tied", tmp_path)

    def logprobs(quantization: str) -> list[float]:
        runner = ModelRunner.from_model_dir(
            tmp_path, torch.device("cpu"), torch.float32, seed=0, cpu_quantization=quantization
        )
        runner.init_kv_cache(num_blocks=8, block_size=4)
        engine = EngineSim(runner.execute, num_blocks=8, block_size=4)
        engine.add("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, logprobs=0))
        first = engine.step({"r": 5}).logprobs
        # the decode of the token just sampled, then a cached prompt's last token alone
        second = engine.step({"r": 1}).logprobs
        engine.add("hit", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, logprobs=0))
        hit_request = engine.requests["hit"]  # as after a prefix-cache hit: r's first block
        hit_request.block_ids = engine.requests["r"].block_ids[:1]
        hit_request.num_computed_tokens = 4
        hit = engine.step({"hit": 1}).logprobs
        return [*first, *second, *hit]

    dense_first, dense_second, dense_hit = logprobs("none")
    int4_first, int4_second, int4_hit = logprobs("int4")
    assert (int4_first, int4_hit) == (dense_first, dense_hit)
    assert int4_second != dense_second
