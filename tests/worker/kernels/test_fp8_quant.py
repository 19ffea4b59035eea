"""quantize_fp8 (Triton) vs quantize_fp8_ref (torch): dynamic e4m3 activation scales per row
and per K group, and what the round trip loses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtllm.worker.kernels.fp8_matmul import dequantize_ref
from vtllm.worker.kernels.fp8_quant import quantize_fp8, quantize_fp8_ref

from .marks import gpu


def _kernel_matches_reference(x, fp8_dtype, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's codes and scales against the reference's (returned): the same e4m3
    values, normal ones exactly (rounded in fp32 first), subnormals to one step (Triton's
    interpreter rounds some of those its own way; a GPU matches exactly)."""
    rows, k = x.shape
    actual, actual_scale = quantize_fp8(x, fp8_dtype, group)
    expected, expected_scale = quantize_fp8_ref(x, fp8_dtype, group)
    assert actual.dtype == fp8_dtype and actual.shape == (rows, k)
    assert actual_scale.shape == (rows, -(-k // (group or k)))
    assert actual_scale.dtype == torch.float32
    torch.testing.assert_close(actual_scale, expected_scale, atol=0, rtol=1e-6)
    finfo = torch.finfo(fp8_dtype)
    normal = expected.float().abs() >= finfo.smallest_normal
    assert torch.equal(actual.float()[normal], expected.float()[normal])
    subnormal_step = finfo.smallest_normal / 8
    torch.testing.assert_close(actual.float(), expected.float(), atol=subnormal_step, rtol=0)
    return expected, expected_scale


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize(
    ("rows", "k", "group"),
    [(5, 64, None), (3, 200, None), (4, 256, 128), (2, 300, 128), (1, 40, 16), (3, 2100, None)],
)
def test_matches_reference(rows, k, group, fp8_dtype, device, generator):
    x = (torch.randn(rows, k, generator=generator) * 3).to(device)
    x[0, : min(k, 16)] = 0.0  # an all-zero group (the first) when group == 16
    _kernel_matches_reference(x, fp8_dtype, group)


def test_round_trip_error_is_e4m3_rounding(device, generator):
    x = torch.randn(8, 512, generator=generator).to(device)
    for group in (None, 128):
        x_fp8, scale = quantize_fp8(x, torch.float8_e4m3fn, group)
        back = dequantize_ref(x_fp8, scale, (1, group or 512), torch.float32)
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormals
        limit = x.abs() * 2**-4 + scale.repeat_interleave(group or 512, 1) * 2**-6
        assert bool(((back - x).abs() <= limit).all())
        # every row (group) reaches the format's max: the scale is amax / 448
        assert float(x_fp8.float().abs().amax()) == 448.0


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.integers(1, 4),
    k=st.integers(1, 300),
    group=st.sampled_from([None, 16, 32, 128]),
    magnitude=st.sampled_from([1e-6, 1.0, 3e4]),
    fp8_dtype=st.sampled_from([torch.float8_e4m3fn, torch.float8_e4m3fnuz]),
    seed=st.integers(0, 2**16),
)
def test_quantize_properties(rows, k, group, magnitude, fp8_dtype, seed, device):
    """Any shape, group and scale: the kernel equals the reference (normal codes exactly);
    each group's largest |x| maps to the format's max; every code is finite and within
    ±max; the round trip keeps e4m3's precision; quantising the dequantised values again
    gives the same codes (the grid is a fixed point)."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * magnitude
    x = x.to(device)
    ref_codes, ref_scale = _kernel_matches_reference(x, fp8_dtype, group)
    finfo = torch.finfo(fp8_dtype)
    values = ref_codes.float()
    assert bool(torch.isfinite(values).all()) and float(values.abs().max()) <= finfo.max
    width = group or k
    padded = torch.zeros(rows, -(-k // width) * width, device=values.device)
    padded[:, :k] = values.abs()
    assert bool((padded.view(rows, -1, width).amax(-1) == finfo.max).all())
    back = dequantize_ref(ref_codes, ref_scale, (1, group or k), torch.float32)
    step = ref_scale.repeat_interleave(width, 1)[:, :k] * finfo.smallest_normal / 8
    assert bool(((back - x).abs() <= x.abs() * 2**-4 + step).all())
    again, _ = quantize_fp8_ref(back, fp8_dtype, group)
    assert torch.equal(again.float(), ref_codes.float())


def test_empty_and_bad_inputs(device):
    out, scale = quantize_fp8(torch.zeros(0, 64, device=device), torch.float8_e4m3fn)
    assert out.shape == (0, 64) and scale.shape == (0, 1)
    with pytest.raises(ValueError, match="takes \\[rows, k\\]"):
        quantize_fp8(torch.zeros(64, device=device), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="group must be positive"):
        quantize_fp8(torch.zeros(2, 64, device=device), torch.float8_e4m3fn, 0)


@gpu
@pytest.mark.parametrize("group", [None, 128])
def test_gpu_bf16_activations(group, device):
    x = torch.randn(300, 2048, device=device, dtype=torch.bfloat16)
    from vtllm.worker.platform import platform_of

    fp8_dtype = platform_of(x.device).fp8_dtype
    actual, scale = quantize_fp8(x, fp8_dtype, group)
    expected, expected_scale = quantize_fp8_ref(x, fp8_dtype, group)
    torch.testing.assert_close(scale, expected_scale, atol=0, rtol=1e-6)
    assert torch.equal(actual.float(), expected.float())  # hardware conversion: bit for bit


@gpu
def test_gpu_dense_activations_same_codes_as_quantize_rows(device):
    """The dense ``_scaled_mm`` path's per-token quantiser (the kernel on a GPU) gives
    ``quantize_rows``' codes and scales exactly."""
    from vtllm.worker.layers.fp8 import quantize_activations, quantize_rows

    x = torch.randn(130, 4096, device=device, dtype=torch.bfloat16)
    x_fp8, scale = quantize_activations(x, torch.float8_e4m3fn)
    expected, expected_scale = quantize_rows(x, torch.float8_e4m3fn)
    assert scale.shape == (130, 1)
    torch.testing.assert_close(scale[:, 0], expected_scale, atol=0, rtol=1e-6)
    assert torch.equal(x_fp8.float(), expected.float())
