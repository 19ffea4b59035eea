"""FP8 weights on the GPU (``-m gpu``): the tiny Qwen3 / Qwen3-MoE checkpoints of
``test_fp8_weights.py`` in bf16 through the compiled paths (Triton ``fp8_matmul`` for block
scales, ``torch._scaled_mm`` with per-token FP8 activations for per-row scales on sm_89+,
the fused-MoE kernel with FP8 experts: its grouped GEMMs w8a8, with per-token or per-block
FP8 activations, where the GPU dots e4m3 natively).

Compared over a prefill and teacher-forced decodes, full-vocab logprobs:

* an FP8 checkpoint against its dequantised twin, both bf16 on the GPU: the weights are the
  same numbers, so only bf16 rounding (and, on the ``_scaled_mm`` path and in the w8a8
  experts, the FP8 activations) separates them: within ``DEQUANT_ATOL``;
* ``--quantization fp8`` against the bf16 original on the GPU: within ``ONLINE_ATOL``.

Each test prints its worst logprob difference (``-rP`` shows it).
"""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.platform import detect_platform

from .test_fp8_weights import LAYOUTS, MOE_OVERRIDES, _logprobs, _write_quantized
from .tiny_models import make_hf_model

pytestmark = pytest.mark.gpu

DEQUANT_ATOL = 0.1  # bf16 rounding of 2 tiny layers, plus FP8 activations (_scaled_mm, w8a8)
ONLINE_ATOL = 0.15  # the above plus the weights' own e4m3 rounding


@pytest.fixture
def device() -> torch.device:
    platform = detect_platform(0)
    if not platform.is_gpu:
        pytest.skip("needs a CUDA or ROCm GPU")
    return platform.device


def _overrides(kind: str) -> dict:
    return MOE_OVERRIDES if kind == "qwen3_moe" else {}


@pytest.mark.parametrize("layout", ["fp8-block", "fp8-tensor-static", "ct-channel"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_gpu_fp8_checkpoint_vs_dequantised_bf16(kind, layout, device, tmp_path):
    make_hf_model(kind, tmp_path / "src", **_overrides(kind))
    fp8_dir, deq_dir = _write_quantized(tmp_path / "src", LAYOUTS[layout], tmp_path)
    actual, runner = _logprobs(fp8_dir, device=device, dtype=torch.bfloat16)
    expected, _ = _logprobs(deq_dir, device=device, dtype=torch.bfloat16)
    backend = runner.model.model.layers[0].self_attn.qkv_proj.linear_method.backend
    worst = float((actual - expected).abs().max())
    agree = float((actual.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"{kind} {layout} backend={backend}: max |dlogprob| {worst:.4f}, argmax agree {agree}")
    if "weight_block_size" in LAYOUTS[layout]:
        assert backend == "triton"
    elif detect_platform(0).has_fp8_scaled_mm:
        assert backend == "scaled_mm"
    torch.testing.assert_close(actual, expected, atol=DEQUANT_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_gpu_quantization_fp8_vs_bf16(kind, device, tmp_path):
    make_hf_model(kind, tmp_path, **_overrides(kind))
    actual, runner = _logprobs(tmp_path, "fp8", device=device, dtype=torch.bfloat16)
    expected, _ = _logprobs(tmp_path, device=device, dtype=torch.bfloat16)
    worst = float((actual - expected).abs().max())
    print(f"{kind} online fp8 vs bf16: max |dlogprob| {worst:.4f}")
    assert runner.model.model.layers[0].self_attn.o_proj.weight.dtype == (
        detect_platform(0).fp8_dtype
    )
    torch.testing.assert_close(actual, expected, atol=ONLINE_ATOL, rtol=0)
