"""silu_and_mul / gelu_tanh_and_mul (Triton) vs their torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtllm.worker.kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

from .marks import assert_close, gpu

PAIRS = {
    "silu": (silu_and_mul, silu_and_mul_ref),
    "gelu_tanh": (gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
}


def _check(activation, num_tokens, d, dtype, device, generator, row_padding=0):
    kernel, ref = PAIRS[activation]
    x = 3 * torch.randn(num_tokens, 2 * d + row_padding, generator=generator)
    x = x.to(device, dtype)[:, : 2 * d]  # strided rows when padded
    actual = kernel(x)
    assert actual.shape == (num_tokens, d) and actual.dtype == dtype
    assert_close(actual, ref(x), activation)


# numpy's exp overflows to inf for very negative gates; sigmoid is then 0, as on a GPU
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("activation", sorted(PAIRS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "d", "row_padding"), [(5, 100, 0), (3, 1500, 6)])
def test_matches_reference(activation, dtype, num_tokens, d, row_padding, device, generator):
    _check(activation, num_tokens, d, dtype, device, generator, row_padding)


def test_references_match_the_model_formulas(generator):
    x = torch.randn(4, 64, generator=generator)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(gate) * up)
    gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), gelu * up)


def test_rejects_odd_width(device):
    with pytest.raises(ValueError, match="must be even, got 7"):
        silu_and_mul(torch.zeros(2, 7, device=device))


@gpu
@pytest.mark.parametrize("activation", sorted(PAIRS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("num_tokens", "d"), [(4096, 14336), (777, 10240), (1, 18944)])
def test_gpu_matches_reference(activation, dtype, num_tokens, d, device):
    _check(activation, num_tokens, d, dtype, device, torch.Generator().manual_seed(6))
