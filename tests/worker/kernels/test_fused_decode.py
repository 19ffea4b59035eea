"""The fused decode chain of a Llama-family layer (``LlamaDecoderLayer.forward_fused``'s
dense part: four GEMVs with the norms, SwiGLU and residual adds folded in) against the
unfused layer, and when a model may take it."""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.distributed import TPGroup
from vtllm.worker.kernels.gemv import GemvTiles
from vtllm.worker.layers.small_batch import FusedDecodeTiles, tune_fused_decode
from vtllm.worker.models.llama import LlamaArgs, LlamaDecoderLayer

CONFIG = dict(
    model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)  # fmt: skip
TILES = FusedDecodeTiles(*(GemvTiles(16, 32, 4) for _ in range(4)))


def make_layer(dtype: torch.dtype, device, **overrides) -> LlamaDecoderLayer:
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(LlamaArgs.from_hf_config(CONFIG | overrides), TPGroup(), 0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return layer.to(device, dtype)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chain_matches_the_unfused_layer(device, rows, dtype):
    layer = make_layer(dtype, device)
    x = torch.randn(rows, 64, device=device).to(dtype)  # the residual stream
    o = torch.randn(rows, 64, device=device).to(dtype)  # attention's output, 4 heads x 16
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    h, residual = layer.input_layernorm(x, torch.zeros_like(x))
    torch.testing.assert_close(layer.fused_qkv(x, TILES), layer.self_attn.qkv_proj(h), **tolerance)
    mlp_out, residual = layer.post_attention(o, x)
    expected = (mlp_out.float() + residual.float()).to(dtype)  # what the next norm adds
    torch.testing.assert_close(layer.fused_post_attention(o, x, TILES), expected, **tolerance)


def test_only_plain_llama_layers_on_a_gpu_are_eligible():
    cpu = torch.device("cpu")
    assert make_layer(torch.bfloat16, cpu).fused_decode_eligible() == "bfloat16 weights on cpu"
    gelu = make_layer(torch.bfloat16, cpu, hidden_act="gelu_pytorch_tanh")
    assert gelu.fused_decode_eligible() == "activation gelu_pytorch_tanh"
    biased = make_layer(torch.bfloat16, cpu, model_type="qwen2")
    assert biased.fused_decode_eligible() == "biased projections"


def test_a_model_without_the_chain_is_left_alone(caplog):
    model = torch.nn.Linear(4, 4)
    assert tune_fused_decode(model, platform=None, tiles_by_shape={}) is None
    assert not caplog.records  # nothing to say about a model that has no chain


def test_moe_models_keep_their_unfused_layers():
    from vtllm.worker.models.moe_llama import MoeLlamaArgs, MoeLlamaForCausalLM

    config = CONFIG | dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    model = MoeLlamaForCausalLM(MoeLlamaArgs.from_hf_config(config), TPGroup())
    assert model.fused_decode is None
    assert model.model.layers[0].fused_decode_eligible() == "SparseMoeBlock layers"
