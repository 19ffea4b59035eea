"""The small-batch GEMV (``kernels/gemv.py``) against ``F.linear``, and the start-up choice
between them (``layers/small_batch.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtllm.worker.kernels.gemv import CANDIDATE_TILES, MAX_GEMV_ROWS, GemvTiles, gemv, gemv_ref

from .marks import gpu


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("tiles", [CANDIDATE_TILES[0], GemvTiles(16, 64, 4)])
def test_gemv_matches_linear(device, rows, tiles):
    generator = torch.Generator().manual_seed(rows)
    # N and K not multiples of the tiles: the masks
    x = torch.randn(rows, 200, generator=generator).to(device)
    w = (torch.randn(72, 200, generator=generator) / 200**0.5).to(device)
    torch.testing.assert_close(gemv(x, w, tiles), gemv_ref(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", ["norm", "silu_and_mul", "residual", "act+residual"])
def test_fused_stages_match_the_separate_kernels(device, rows, dtype, stage):
    """The norm prologue, the SwiGLU prologue and the residual epilogue give what the
    separate reference kernels give (bf16: within the GEMV's own rounding of the sum;
    K = 200 and N = 72 leave partial tiles)."""
    generator = torch.Generator().manual_seed(rows)
    norm = stage == "norm"
    act = stage in ("silu_and_mul", "act+residual")
    x = torch.randn(rows, 400 if act else 200, generator=generator).to(device, dtype)
    w = (torch.randn(72, 200, generator=generator) / 200**0.5).to(device, dtype)
    stages = dict(
        norm_weight=(torch.rand(200, generator=generator) + 0.5).to(device, dtype)
        if norm
        else None,
        norm_eps=1e-5,
        silu_and_mul=act,
        residual=torch.randn(rows, 72, generator=generator).to(device, dtype)
        if stage in ("residual", "act+residual")
        else None,
    )
    actual = gemv(x, w, GemvTiles(16, 64, 4), **stages)
    expected = gemv_ref(x, w, **stages)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    if stage == "residual" and device.type != "cpu":
        # the epilogue adds to the rounded product: exactly the sum (not in Triton's
        # interpreter, whose fp32 -> bf16 casts truncate)
        unfused = gemv(x, w, GemvTiles(16, 64, 4))
        torch.testing.assert_close(
            actual, (unfused.float() + stages["residual"].float()).to(dtype), atol=0, rtol=0
        )


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_of_fp8_rows_with_scales_matches_the_dequantised_weight(device, rows):
    """An e4m3 weight with one scale per output row (``--quantization fp8``): the row's
    scale multiplies the fp32 sum once; the reference dequantises first."""
    generator = torch.Generator().manual_seed(rows)
    w = (torch.randn(40, 200, generator=generator) * 100).clamp(-448, 448)
    w = w.to(torch.float8_e4m3fn).to(device)
    scale = (torch.rand(40, generator=generator) * 1e-3 + 1e-4).to(device)
    x = torch.randn(rows, 200, generator=generator).to(device)
    actual = gemv(x, w, GemvTiles(4, 64, 4), row_scale=scale)
    torch.testing.assert_close(actual, gemv_ref(x, w, scale), atol=1e-5, rtol=1e-5)


def test_fp8_layer_takes_the_gemv_only_where_tuned_and_for_few_rows(device, monkeypatch):
    """``Fp8LinearMethod.gemv_tiles`` (set by start-up tuning) sends up to 4 rows to the
    GEMV with the layer's row scales; 5 rows, or no tiles, take the method's matmul."""
    from vtllm.worker.kernels import gemv as gemv_module
    from vtllm.worker.layers.fp8 import Fp8LinearMethod

    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    w = (torch.randn(24, 64, generator=generator) * 50).clamp(-448, 448)
    layer.weight = torch.nn.Parameter(w.to(torch.float8_e4m3fn).to(device), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(
        (torch.rand(24, generator=generator) * 1e-2).to(device), requires_grad=False
    )
    calls = []
    real_gemv = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(a) or real_gemv(*a, **k))
    method = Fp8LinearMethod(None, "reference")
    for rows, tiles, via_gemv in ((4, None, False), (4, GemvTiles(4, 64, 4), True),
                                  (5, GemvTiles(4, 64, 4), False)):  # fmt: skip
        method.gemv_tiles = tiles
        calls.clear()
        x = torch.randn(rows, 64, generator=generator).to(device)
        actual = method.apply(layer, x)
        assert bool(calls) == via_gemv
        torch.testing.assert_close(
            actual, gemv_ref(x, layer.weight, layer.weight_scale), atol=1e-4, rtol=1e-4
        )


def test_gemv_refuses_more_rows_or_other_k(device):
    w = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv(torch.zeros(MAX_GEMV_ROWS + 1, 16, device=device), w, CANDIDATE_TILES[0])
    with pytest.raises(ValueError, match="matching K"):
        gemv(torch.zeros(1, 12, device=device), w, CANDIDATE_TILES[0])
    with pytest.raises(ValueError, match=r"x holds gate \| up"):
        gemv(torch.zeros(1, 16, device=device), w, CANDIDATE_TILES[0], silu_and_mul=True)
    with pytest.raises(ValueError, match=r"norm_weight \(8,\) for K = 16"):
        gemv(torch.zeros(1, 16, device=device), w, CANDIDATE_TILES[0], norm_weight=w[0, :8])
    with pytest.raises(ValueError, match=r"residual \(2, 8\) for an output of \(1, 8\)"):
        gemv(torch.zeros(1, 16, device=device), w, CANDIDATE_TILES[0], residual=w[:2, :8])


@gpu
@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 3072), (151936, 1024)])
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_gemv_bf16_realistic_shapes(shape, rows):
    """bf16 at Qwen3-0.6B's shapes (qkv, down, LM head): fp32 sums rounded once, within
    bf16 rounding of cuBLAS's result."""
    torch.manual_seed(0)
    n, k = shape
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    expected = F.linear(x.float(), w.float())
    for tiles in CANDIDATE_TILES:
        torch.testing.assert_close(gemv(x, w, tiles).float(), expected, atol=2e-2, rtol=1.6e-2)


@gpu
def test_gpu_tuning_installs_only_winners_and_keeps_outputs():
    """On the GPU: every dense shape of a small model is timed, the GEMV is installed
    exactly where it won, and 1-row and 8-row products still match F.linear."""
    from vtllm.worker.distributed import TPGroup
    from vtllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vtllm.worker.layers.small_batch import GemvMethod, tune_small_batch_linears
    from vtllm.worker.platform import detect_platform

    platform = detect_platform(0)
    torch.manual_seed(0)
    model = torch.nn.ModuleList(
        [ColumnParallelLinear(1024, [2048, 1024, 1024], False, TPGroup()) for _ in range(4)]
        + [RowParallelLinear(3072, 1024, False, TPGroup()) for _ in range(4)]
    ).to("cuda", torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    timings = tune_small_batch_linears(model, platform)
    assert sorted(t.shape for t in timings) == [(1024, 3072), (4096, 1024)]
    for timing in timings:
        layers = [m for m in model if tuple(m.weight.shape) == timing.shape]
        installed = {isinstance(m.linear_method, GemvMethod) for m in layers}
        assert installed == {timing.gemv_wins}
        assert timing.own_us > 0 and timing.gemv_us > 0
    for layer in model:
        for rows in (1, 8):
            x = torch.randn(rows, layer.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(
                layer(x).float(), F.linear(x, layer.weight).float(), atol=2e-2, rtol=1.6e-2
            )


@gpu
def test_gpu_tuning_of_fp8_layers_installs_tiles_only_where_the_gemv_wins():
    """FP8 per-row layers (quantised at load, as --quantization fp8 does) are timed against
    their own Triton kernel; where the GEMV wins their method holds its tiles, and 1-row
    and 8-row products match the dequantised weight."""
    from vtllm.worker.distributed import TPGroup
    from vtllm.worker.layers.fp8 import Fp8LinearMethod, linear_backend, quantize_rows
    from vtllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vtllm.worker.layers.small_batch import tune_small_batch_linears
    from vtllm.worker.platform import detect_platform

    platform = detect_platform(0)
    torch.manual_seed(0)
    model = torch.nn.ModuleList(
        [ColumnParallelLinear(2048, [4096, 512, 512], False, TPGroup()) for _ in range(4)]
        + [RowParallelLinear(4096, 2048, False, TPGroup()) for _ in range(4)]
    ).to("cuda", torch.bfloat16)
    for layer in model:
        layer.weight.data.normal_(0, 0.02)
        w_fp8, scale = quantize_rows(layer.weight.data, platform.fp8_dtype)
        layer.weight = torch.nn.Parameter(w_fp8, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.contiguous(), requires_grad=False)
        layer.linear_method = Fp8LinearMethod(None, linear_backend(platform, None, layer))
    timings = tune_small_batch_linears(model, platform, torch.bfloat16)
    assert sorted(t.shape for t in timings) == [(2048, 4096), (5120, 2048)]
    for timing in timings:
        layers = [m for m in model if tuple(m.weight.shape) == timing.shape]
        assert {m.linear_method.gemv_tiles is not None for m in layers} == {timing.gemv_wins}
    for layer in model:
        dequantised = (layer.weight.float() * layer.weight_scale[:, None]).bfloat16()
        for rows in (1, 8):
            x = torch.randn(rows, layer.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(
                layer(x).float(), F.linear(x, dequantised).float(), atol=3e-2, rtol=3e-2
            )


@gpu
def test_gpu_pdl_chain_gives_the_plain_chain_bits():
    """Programmatic dependent launch (Hopper) changes when a GEMV starts, not what it
    computes: the fused chain's four GEMVs, eagerly and inside a device graph, give the
    same bits with and without it."""
    from vtllm.worker.platform import detect_platform

    platform = detect_platform(0)
    if not platform.has_programmatic_dependent_launch:
        pytest.skip("programmatic dependent launch needs CUDA sm90+")
    torch.manual_seed(0)
    hidden, q_size, width = 1024, 2048, 3072
    dtype, tiles = torch.bfloat16, CANDIDATE_TILES[0]

    def weight(n, k):
        return (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)

    w_qkv, w_o, w_gu, w_down = (
        weight(4096, hidden),
        weight(hidden, q_size),
        weight(2 * width, hidden),
        weight(hidden, width),
    )
    norm1, norm2 = (
        (torch.rand(hidden, device="cuda") + 0.5).to(dtype),
        (torch.rand(hidden, device="cuda") + 0.5).to(dtype),
    )
    x = torch.randn(2, hidden, device="cuda").to(dtype)
    o_in = torch.randn(2, q_size, device="cuda").to(dtype)

    def chain(pdl: bool) -> list[torch.Tensor]:
        qkv = gemv(x, w_qkv, tiles, norm_weight=norm1, pdl=pdl)
        h = gemv(o_in, w_o, tiles, residual=x, pdl=pdl)
        gate_up = gemv(h, w_gu, tiles, norm_weight=norm2, pdl=pdl)
        return [qkv, h, gemv(gate_up, w_down, tiles, silu_and_mul=True, residual=h, pdl=pdl)]

    plain = chain(False)
    for expected, actual in zip(plain, chain(True), strict=True):
        assert torch.equal(expected, actual)
    with platform.capture_graph(platform.new_graph_pool()) as graph:
        captured = chain(True)
    graph.replay()
    platform.synchronize()
    for expected, actual in zip(plain, captured, strict=True):
        assert torch.equal(expected, actual)


def test_a_tile_set_that_fails_at_start_up_is_left_out(monkeypatch, caplog):
    """Start-up timing survives a GEMV tile set this device refuses: it is logged and
    timed as infinite, so another tile set (or the layer's own product) is chosen."""
    import logging
    from types import SimpleNamespace

    from vtllm.worker.distributed import TPGroup
    from vtllm.worker.layers import small_batch
    from vtllm.worker.layers.linear import RowParallelLinear

    refused = CANDIDATE_TILES[0]

    def gemv_refusing_one(x, w, tiles, **kwargs):
        if tiles == refused:
            raise RuntimeError("out of resources: registers")
        return F.linear(x, w)

    monkeypatch.setattr(small_batch, "gemv", gemv_refusing_one)
    times = iter(range(10, 100))
    platform = SimpleNamespace(graph_us=lambda fn, *args: (fn(0), float(next(times)))[1])
    layer = RowParallelLinear(64, 32, False, TPGroup())
    with caplog.at_level(logging.WARNING, logger="vtllm.worker.layers.small_batch"):
        timing = small_batch.time_shape(platform, [layer])
    assert timing.tiles != refused and timing.gemv_us < float("inf")
    assert any("left out" in r.getMessage() for r in caplog.records)
