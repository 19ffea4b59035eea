"""The bench roofline's byte accounting (``vtllm.roofline``) against independent counts.

Totals: ``transformers`` builds each config on the meta device and counts its parameters.
Per-step bytes: the published architecture numbers worked by hand here (which experts a
batch-1 step reads, the LM head, one embedding row). KV: a brute-force sum over contexts.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from vtllm.bench import MODEL_SHAPES
from vtllm.roofline import model_bytes, prefill_flops

# mistralai/Mixtral-8x7B-v0.1's shapes: 8 experts 14336 wide, top 2, in every layer
MIXTRAL_8X7B = dict(
    model_type="mixtral",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    tie_word_embeddings=False,
    sliding_window=None,
)
# google/gemma-4-26B-A4B's text decoder: a dense MLP beside 128 experts, every 6th layer
# full attention (head_dim 512, 2 KV heads, k = v projection), the rest sliding (1024)
GEMMA4_26B = MODEL_SHAPES["gemma4-26b-moe"]


def _transformers_num_params(hf: dict) -> int:
    fields = {k: v for k, v in hf.items() if k not in ("model_type", "architectures")}
    config = transformers.AutoConfig.for_model(hf["model_type"], **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "hf",
    [
        MODEL_SHAPES["llama3-8b"],
        MODEL_SHAPES["qwen3-0.6b"],
        MODEL_SHAPES["qwen3-30b-a3b"],
        MIXTRAL_8X7B,
        pytest.param(
            GEMMA4_26B,
            marks=pytest.mark.skipif(
                not hasattr(transformers, "Gemma4TextConfig"), reason="transformers lacks Gemma 4"
            ),
        ),
    ],
    ids=["llama3-8b", "qwen3-0.6b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma4-26b-moe"],
)
def test_total_weights_match_transformers_parameter_count(hf):
    assert model_bytes(hf, 2).total_weight_bytes == 2 * _transformers_num_params(hf)


def test_qwen3_30b_a3b_step_reads_top8_experts_lm_head_and_one_embedding_row():
    sizes = model_bytes(MODEL_SHAPES["qwen3-30b-a3b"], 2)
    h, layers, vocab = 2048, 48, 151936
    attention = h * 128 * (32 + 4 + 4 + 32)  # q, k, v, o
    expert = 3 * h * 768  # gate, up, down
    router, norms = 128 * h, 2 * h + 2 * 128
    per_layer = attention + router + norms
    step = layers * (per_layer + 8 * expert) + vocab * h + h + h  # LM head, a row, final norm
    total = layers * (per_layer + 128 * expert) + 2 * vocab * h + h
    assert sizes.step_weight_bytes == 2 * step
    assert sizes.total_weight_bytes == 2 * total
    assert sizes.step_expert_bytes == 2 * layers * 8 * expert
    assert sizes.expert_bytes == 2 * layers * 128 * expert
    # "3.3 B activated" as Qwen states it counts the input embedding table besides
    assert (step + vocab * h) / 3.3e9 == pytest.approx(1.0, abs=0.02)
    assert sizes.step_weight_fraction == pytest.approx(0.0996, abs=1e-4)
    assert sizes.kv_bytes(1000) == 1000 * layers * 2 * 4 * 128 * 2  # no sliding layers


def test_dense_step_reads_everything_but_the_input_embedding_table():
    sizes = model_bytes(MODEL_SHAPES["llama3-8b"], 2)
    table = 2 * 128256 * 4096
    assert sizes.step_weight_bytes == sizes.total_weight_bytes - table + 2 * 4096
    assert sizes.expert_bytes == sizes.step_expert_bytes == 0
    tied = model_bytes(MODEL_SHAPES["qwen3-0.6b"], 2)  # the table is the LM head: read whole
    assert tied.step_weight_bytes == tied.total_weight_bytes + 2 * 1024


def test_mixtral_reads_two_of_eight_experts():
    sizes = model_bytes(MIXTRAL_8X7B, 2)
    expert = 2 * 3 * 4096 * 14336
    assert sizes.expert_bytes == 32 * 8 * expert
    untouched = 32 * 6 * expert
    input_table = 2 * 32000 * 4096
    assert sizes.step_weight_bytes == sizes.total_weight_bytes - untouched - input_table + 2 * 4096
    # published: 12.9 B active parameters (embedding table included)
    assert (sizes.step_weight_bytes + input_table) / 2 / 12.9e9 == pytest.approx(1.0, abs=0.01)


def test_gemma4_counts_dense_mlp_beside_experts_and_per_layer_type_kv():
    sizes = model_bytes(GEMMA4_26B, 2)
    h = 2816
    assert sizes.step_expert_bytes == 2 * 30 * 8 * 3 * h * 704
    # Google's "3.8 B active" (the tied table is the LM head, read whole)
    assert sizes.step_weight_bytes / 2 / 3.8e9 == pytest.approx(1.0, abs=0.02)
    sliding, full = 2 * 8 * 256 * 2, 2 * 2 * 512 * 2  # K and V bytes per token per layer
    assert sizes.kv_bytes(100) == 100 * (25 * sliding + 5 * full)
    assert sizes.kv_bytes(5000) == 1024 * 25 * sliding + 5000 * 5 * full


def test_kv_while_decoding_is_the_sum_over_each_steps_context():
    sizes = model_bytes(GEMMA4_26B, 2)
    for prompt_len, num_output in [(900, 300), (100, 50), (2000, 10), (1023, 2), (5, 0)]:
        brute = sum(sizes.kv_bytes(prompt_len + j) for j in range(num_output))
        assert sizes.kv_bytes_while_decoding(prompt_len, num_output) == brute


def test_fp8_linears_and_kv_are_one_byte_the_rest_stays_bf16():
    hf = MODEL_SHAPES["qwen3-30b-a3b"]
    bf16, fp8 = model_bytes(hf, 2), model_bytes(hf, 2, linear_bytes=1, kv_bytes=1)
    h = 2048
    linears_in_step = 48 * (h * 128 * 72 + 8 * 3 * h * 768)  # attention + top-8 experts
    assert bf16.step_weight_bytes - fp8.step_weight_bytes == linears_in_step
    assert fp8.step_expert_bytes * 2 == bf16.step_expert_bytes
    assert fp8.kv_bytes(10) * 2 == bf16.kv_bytes(10)


def test_prefill_flops_of_llama3_8b_by_hand():
    hf, tokens = MODEL_SHAPES["llama3-8b"], 8000
    h, layers, vocab = 4096, 32, hf["vocab_size"]
    per_layer = 2 * h * h + 2 * h * 1024 + 3 * h * 14336 + 2 * h  # q o, k v, MLP, norms
    linears = 2 * tokens * (layers * per_layer + h)  # + the final norm
    lm_head = 2 * vocab * h  # the last token's logits only
    attention = layers * 4 * 32 * 128 * tokens * (tokens + 1) // 2
    assert prefill_flops(hf, tokens) == linears + lm_head + attention
    # ~129 TFLOP, of which causal attention is ~13 %
    assert 1.28e14 < prefill_flops(hf, tokens) < 1.30e14


def test_prefill_attention_flops_stop_growing_at_the_sliding_window():
    hf = dict(MIXTRAL_8X7B, model_type="mistral", intermediate_size=14336, sliding_window=100)
    del hf["num_local_experts"], hf["num_experts_per_tok"]
    dense = prefill_flops(dict(hf, sliding_window=None), 300)
    windowed = prefill_flops(hf, 300)
    per_key = 4 * 32 * 128 * 32  # heads x head_dim x layers, 4 FLOP a query-key pair
    all_pairs = sum(i + 1 for i in range(300))
    window_pairs = sum(min(i + 1, 100) for i in range(300))
    assert dense - windowed == per_key * (all_pairs - window_pairs)
