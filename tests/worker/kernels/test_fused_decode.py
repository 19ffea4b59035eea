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


def test_pdl_is_left_out_where_it_cannot_run(device, monkeypatch):
    """Programmatic dependent launch only on CUDA sm90+ with VT_DECODE_PDL=auto (off by
    default); a launch that fails (here Triton's interpreter, which has no griddepcontrol)
    leaves the chain plain, with the reason, instead of failing the start-up."""
    from vtllm.worker.layers.small_batch import _pdl_available, time_chain_with_pdl
    from vtllm.worker.platform import Platform, PlatformKind, detect_platform

    platform = detect_platform(0)
    monkeypatch.setenv("VT_DECODE_PDL", "auto")
    assert not _pdl_available(Platform(PlatformKind.CPU, torch.device("cpu")))
    monkeypatch.setenv("VT_DECODE_PDL", "off")
    assert not _pdl_available(platform)
    monkeypatch.delenv("VT_DECODE_PDL")
    assert not _pdl_available(platform)  # the default
    if device.type != "cpu":
        return  # on a GPU the launch itself is tested in test_gemv.py
    pdl_us, why_not = time_chain_with_pdl(platform, [make_layer(torch.float32, device)], TILES)
    assert pdl_us is None and why_not.startswith("InterpreterError")


class _TimedPlatform:
    """Stands in for a GPU's graph timing: hands out the given µs in turn."""

    def __init__(self, *timings: float) -> None:
        self.timings = list(timings)

    def graph_us(self, fn, calls, replays) -> float:
        return self.timings.pop(0)

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize(
    ("unfused", "fused", "pdl", "chosen", "log"),
    [
        (30.0, 26.0, None, "plain", "26.0 µs fused, no PDL (InterpreterError"),
        (30.0, 26.0, 22.0, "pdl", "26.0 µs fused, with PDL 22.0 µs → fused with PDL"),
        (30.0, 26.0, 25.5, "plain", "with PDL 25.5 µs → fused for steps of up to 4"),
        (30.0, 29.0, 28.0, None, "with PDL 28.0 µs → unfused"),
    ],
)
def test_start_up_picks_the_chain_and_pdl_by_their_times(
    unfused, fused, pdl, chosen, log, device, monkeypatch, caplog
):
    """The decision alone (the timings stand in for a GPU's): the chain where it takes
    under 95 % of the unfused layer's time, PDL where it takes under 95 % of the plain
    chain's; the log line gives every time."""
    import logging

    from vtllm.worker.layers import small_batch
    from vtllm.worker.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(LlamaArgs.from_hf_config(CONFIG), TPGroup())
    monkeypatch.setattr(LlamaDecoderLayer, "fused_decode_eligible", lambda self: None)
    monkeypatch.setattr(small_batch, "_pdl_available", lambda platform: True)
    if pdl is not None:
        monkeypatch.setattr(small_batch, "time_chain_with_pdl", lambda *_: (pdl, ""))
    else:  # the real check: Triton's interpreter cannot launch with PDL
        model = model.to(device)
        for module in model.modules():  # finite weights for the check's eager run
            for param in module.parameters(recurse=False):
                torch.nn.init.normal_(param, std=0.05)
    shapes = {(128, 64): GemvTiles(16, 32, 4), (64, 64): GemvTiles(16, 32, 4),
              (192, 64): GemvTiles(16, 32, 4), (64, 96): GemvTiles(16, 32, 4)}  # fmt: skip
    with caplog.at_level(logging.INFO, logger=small_batch.__name__):
        tiles = tune_fused_decode(model, _TimedPlatform(unfused, fused), shapes)
    assert log in caplog.text
    if chosen is None:
        assert tiles is None and model.fused_decode is None
    else:
        assert model.fused_decode is tiles and tiles.pdl == (chosen == "pdl")


def test_a_chain_that_fails_at_start_up_leaves_the_layer_unfused(monkeypatch, caplog):
    """Start-up survives a fused chain this device refuses: logged, the model unfused."""
    import logging

    from vtllm.worker.layers import small_batch
    from vtllm.worker.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(LlamaArgs.from_hf_config(CONFIG), TPGroup())
    monkeypatch.setattr(LlamaDecoderLayer, "fused_decode_eligible", lambda self: None)

    def refuses(*_):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(small_batch, "time_decode_chain", refuses)
    shapes = {(128, 64): GemvTiles(16, 32, 4), (64, 64): GemvTiles(16, 32, 4),
              (192, 64): GemvTiles(16, 32, 4), (64, 96): GemvTiles(16, 32, 4)}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger=small_batch.__name__):
        assert tune_fused_decode(model, None, shapes) is None
    assert model.fused_decode is None
    assert "timing failed (RuntimeError: out of resources" in caplog.text
