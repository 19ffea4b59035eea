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


def test_gemv_refuses_more_rows_or_other_k(device):
    w = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv(torch.zeros(MAX_GEMV_ROWS + 1, 16, device=device), w, CANDIDATE_TILES[0])
    with pytest.raises(ValueError, match="matching K"):
        gemv(torch.zeros(1, 12, device=device), w, CANDIDATE_TILES[0])


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
        assert timing.library_us > 0 and timing.gemv_us > 0
    for layer in model:
        for rows in (1, 8):
            x = torch.randn(rows, layer.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(
                layer(x).float(), F.linear(x, layer.weight).float(), atol=2e-2, rtol=1.6e-2
            )
