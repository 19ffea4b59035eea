"""rms_norm (Triton) vs rms_norm_ref (torch) and the RMSNorm layer."""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.kernels.rms_norm import rms_norm, rms_norm_ref
from vtllm.worker.layers.norm import RMSNorm

from .marks import assert_close, gpu


def _inputs(shape, dtype, device, generator, with_residual):
    x = torch.randn(*shape, generator=generator).to(device, dtype)
    residual = torch.randn(*shape, generator=generator).to(device, dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=generator)).to(device, dtype)
    return x, residual, weight


def _check(shape, dtype, device, generator, with_residual, gemma):
    x, residual, weight = _inputs(shape, dtype, device, generator, with_residual)
    expected, expected_residual = rms_norm_ref(x, weight, 1e-6, residual, gemma)
    actual, actual_residual = rms_norm(x, weight, 1e-6, residual, gemma)
    assert actual.shape == x.shape and actual.dtype == dtype
    assert_close(actual, expected, "normed")
    if with_residual:
        # the add is one rounding of an exact fp32 sum: bitwise equal
        assert torch.equal(actual_residual, expected_residual)
    else:
        assert actual_residual is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 100), (3, 1000), (5, 3, 80)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_matches_reference(dtype, shape, with_residual, gemma, device, generator):
    _check(shape, dtype, device, generator, with_residual, gemma)


def test_matches_rmsnorm_layer(device, generator):
    x, _, weight = _inputs((9, 72), torch.float16, device, generator, False)
    layer = RMSNorm(72, eps=1e-5).to(device)
    layer.weight.data = weight
    actual, _ = rms_norm(x, weight, 1e-5)
    assert_close(actual, layer(x), "vs layers.norm.RMSNorm")


def test_strided_rows(device, generator):
    x = torch.randn(6, 200, generator=generator).to(device)[:, :100]  # row stride 200
    weight = torch.randn(100, generator=generator).to(device)
    assert_close(rms_norm(x, weight, 1e-6)[0], rms_norm_ref(x, weight, 1e-6)[0], "strided")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4097, 4096), (300, 5376), (2000, 40, 128), (31, 16384)])
@pytest.mark.parametrize(("with_residual", "gemma"), [(False, False), (True, False), (True, True)])
def test_gpu_matches_reference(dtype, shape, with_residual, gemma, device):
    _check(shape, dtype, device, torch.Generator().manual_seed(4), with_residual, gemma)


@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma4_weight_without_offset(with_residual, device, generator):
    """``weight_offset=0.0`` (Gemma 4): the weight itself, multiplied in fp32 before the
    one rounding, as transformers' ``Gemma4RMSNorm`` does it."""
    x, residual, weight = _inputs((5, 3, 80), torch.float16, device, generator, with_residual)
    expected, _ = rms_norm_ref(x, weight, 1e-6, residual, gemma=True, weight_offset=0.0)
    actual, _ = rms_norm(x, weight, 1e-6, residual, gemma=True, weight_offset=0.0)
    assert_close(actual, expected, "gemma4")
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h = h.float()
    by_hand = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * weight.float()
    torch.testing.assert_close(expected, by_hand.to(x.dtype))
