"""The paged-attention kernel alone on a GPU, over launch configurations.

Two workloads per model shape (bf16, block size 16, blocks in random order):

* ``prefill``: one sequence's whole ``--prefill-len`` prompt (issue 13's 8k row), read
  as TFLOP/s of causal attention (4 x heads x head_dim FLOP a query-key pair), beside
  torch's ``scaled_dot_product_attention`` (flash, contiguous K/V) on the same tensors
  as a same-run ceiling;
* ``decode``: ``--batch`` sequences of ``--context`` keys each, one query each, read as
  GB/s of K and V streamed.

    python3 benchmarks/attention_kernel.py [--sweep] [--shapes llama3-8b qwen3-0.6b]

Without ``--sweep`` only the launcher's default tiles run. Prints one JSON line a
(workload, configuration); the default configuration carries ``"default": true``.

``--splits`` times decodes instead over KV split counts (1 to 32), in device graphs of 20
calls (no launch cost, as in a decode graph), beside the split count the launcher picks on
its own (``kv_splits.choose_num_kv_splits``):

    python3 benchmarks/attention_kernel.py --splits --decode 1x160 1x1024 1x8192 8x1024

``--split-counts 1`` times the single pass alone (e.g. to compare two trees: the script
imports the ``vtllm`` of the tree it sits in); ``--decode-prefetch both`` times the
kernel's shorter decode chain of loads (``paged_attention.DECODE_PREFETCH``) beside the
default. ``--kv-cache-dtypes bf16 fp8`` times each decode over a bf16 and an e4m3 cache
(``--kv-cache-dtype fp8``: unit scales, the kernel's dequantising loads) with the GB/s of
K and V each moved:

    python3 benchmarks/attention_kernel.py --splits --split-counts 1 8 --kv-cache-dtypes bf16 fp8

``--cold-l2`` evicts L2 before each decode call and subtracts the eviction's own time
(``ColdL2``): a model's attention finds its q, sequence lengths and block table in DRAM,
not in L2 as back-to-back calls do (session 42: the served attention ran 10-20 % slower
than this script's figures).

Without ``--splits`` the same flag times the tiles' decodes over each cache; ``--sweep
--no-prefill --kv-cache-dtypes fp8`` sweeps the FP8 cache's decode tiles (a grid with
256-key tiles and 5 stages, since a tile holds half the bytes); ``--fp8-fp16-operands
both`` times each FP8 configuration with fp16 and with bf16 dots.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtllm.bench import MODEL_SHAPES  # noqa: E402
from vtllm.worker.kernels._triton import max_shared_memory, triton  # noqa: E402
from vtllm.worker.kernels.paged_attention import (  # noqa: E402
    AttentionTiles,
    choose_tiles,
    paged_attention,
)
from vtllm.worker.platform import detect_platform  # noqa: E402

BLOCK_SIZE = 16
# --decode-prefetch and --fp8-fp16-operands: the settings each choice times
BOTH_WAYS = {"off": (False,), "on": (True,), "both": (False, True)}


def _paged(
    seq_lens: list[int],
    q_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype = torch.bfloat16,
):
    """(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables) on the GPU: q bf16,
    the caches ``kv_dtype``, each sequence's blocks scattered over the cache."""
    device = torch.device("cuda")
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[start : start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device).to(kv_dtype)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device).to(kv_dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=torch.bfloat16, device=device)
    loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, loc, lens, table


def decode_contexts(
    batch: int, context: int | tuple[int, int], longest_first: bool = False
) -> list[int]:
    """Each sequence's keys: ``context`` each, or for ``(lo, hi)`` drawn uniformly from
    ``[lo, hi]`` (seed 0: every tree and cache dtype times the same batch), in that draw's
    order or ``longest_first`` (sequence i's programs are launched before i + 1's)."""
    if isinstance(context, int):
        return [context] * batch
    generator = torch.Generator().manual_seed(0)
    drawn = torch.randint(context[0], context[1] + 1, (batch,), generator=generator).tolist()
    return sorted(drawn, reverse=True) if longest_first else drawn


def parse_decode(workload: str) -> tuple[int, int | tuple[int, int]]:
    """``BATCHxCONTEXT`` or ``BATCHxLO-HI`` (contexts uniform in [LO, HI])."""
    batch, context = workload.split("x")
    if "-" in context:
        lo, hi = (int(x) for x in context.split("-"))
        return int(batch), (lo, hi)
    return int(batch), int(context)


def _context_label(context: int | tuple[int, int]) -> int | str:
    return context if isinstance(context, int) else f"{context[0]}-{context[1]}"


def _decode_batch(
    hf: dict,
    batch: int,
    context: int | tuple[int, int],
    kv_cache_dtype: str,
    longest_first: bool = False,
):
    """``batch`` sequences of ``context`` keys (``decode_contexts``), one query each, over
    a ``kv_cache_dtype`` ("bf16" or "fp8": the platform's e4m3) cache: the ``_paged``
    tensors, the keyword scales to pass (unit ones for FP8; none for bf16, the call older
    trees accept: ``h200_run.sh ab-attn`` runs ``--splits`` inside ``$BASE_TREE``), the
    bytes of K and V the cache holds and the longest sequence's keys."""
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    fp8 = kv_cache_dtype == "fp8"
    kv_dtype = detect_platform(0).fp8_dtype if fp8 else torch.bfloat16
    contexts = decode_contexts(batch, context, longest_first)
    tensors = _paged(contexts, [1] * batch, heads, kv_heads, head_dim, kv_dtype)
    unit = torch.ones((), dtype=torch.float32, device=tensors[0].device)
    scales = {"k_scale": unit, "v_scale": unit} if fp8 else {}
    kv_bytes = 2 * sum(contexts) * kv_heads * head_dim * tensors[1].element_size()
    return tensors, scales, kv_bytes, max(contexts)


class ColdL2:
    """An eviction of L2 before each timed call, and what it costs alone (to subtract).

    Repeated back to back, a decode finds q, ``seq_lens`` and the block table in L2; in a
    model the linears between two layers' attention stream their weights through L2, so
    each program's first loads go to DRAM. ``--cold-l2`` times that case: every call
    follows a write of a buffer larger than L2 (256 MiB; H100/H200 L2 is 50/60 MB)."""

    BYTES = 256 << 20

    def __init__(self) -> None:
        self.scratch = torch.empty(self.BYTES, dtype=torch.uint8, device="cuda")
        self._eviction_alone: dict = {}  # timer -> its time of the eviction alone

    def evict(self, *_) -> None:
        self.scratch.zero_()

    def before(self, fn):
        """``fn`` with the eviction first (same arguments)."""

        def evicted_then_fn(*args):
            self.evict()
            return fn(*args)

        return evicted_then_fn

    def timed(self, timer, fn) -> float:
        """``timer`` (``_time_ms`` or ``Platform.graph_us``) of ``fn`` after an eviction,
        less that timer's time of the eviction alone (taken once a timer)."""
        if timer not in self._eviction_alone:
            self._eviction_alone[timer] = timer(self.evict)
        return timer(self.before(fn)) - self._eviction_alone[timer]


def _time_ms(fn, repeats: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` timed calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _default_tiles(decode: bool, group: int, head_dim: int, cache_bytes: int = 2) -> AttentionTiles:
    """What the launcher picks for bf16 queries over a cache of ``cache_bytes``-byte
    elements on this GPU."""
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    smem = max_shared_memory(torch.device("cuda"))
    return choose_tiles(decode, group, head_dim_pad, 2, smem, cache_element_size=cache_bytes)


def _configs(default: AttentionTiles, group: int, decode: bool, sweep: bool, cache_bytes: int = 2):
    """The launch configurations timed: the default alone, or with ``sweep`` a grid (an
    FP8 cache's also with 256-key tiles and 5 stages: half the bytes a tile)."""
    if not sweep:
        return [default]
    rows = [16] if decode else [64, 128]
    stage_counts = [2, 3, 4] if decode else [2, 3]
    tile_ns = [32, 64, 128]
    if cache_bytes == 1:
        tile_ns, stage_counts = [64, 128, 256], [2, 3, 4, 5]
    found = [default]
    grid = itertools.product(rows, tile_ns, [4, 8], stage_counts)
    for block_m, tile_n, warps, stages in grid:
        tiles = AttentionTiles(max(block_m, triton.next_power_of_2(group)), tile_n, warps, stages)
        if tiles not in found:
            found.append(tiles)
    return found


def bench_prefill(shape: str, hf: dict, length: int, sweep: bool) -> None:
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    q, k_cache, v_cache, loc, lens, table = _paged([length], [length], heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    flop = 4 * heads * head_dim * length * (length + 1) // 2
    common = {"kind": "prefill", "model": shape, "tokens": length}
    # the same keys contiguous, for torch's flash attention
    order = table[0, : -(-length // BLOCK_SIZE)].long()
    k = k_cache[order].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1)[None]
    v = v_cache[order].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1)[None]
    q4 = q.transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        ms = _time_ms(lambda: sdpa(q4, k, v, is_causal=True, scale=scale, enable_gqa=True))
        print(json.dumps({**common, "config": "torch sdpa", "ms": round(ms, 3),
                          "tflop_s": round(flop / ms / 1e9, 1)}), flush=True)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a ceiling, not the subject
        print(json.dumps({**common, "config": "torch sdpa", "error": str(e)[:200]}), flush=True)
    default = _default_tiles(False, heads // kv_heads, head_dim)
    for tiles in _configs(default, heads // kv_heads, False, sweep):
        out = torch.empty_like(q)

        def run(tiles=tiles, out=out):
            paged_attention(q, k_cache, v_cache, loc, lens, table, scale, max_seq_len=length,
                            num_kv_splits=1, out=out, tiles=tiles)  # fmt: skip

        _report(common, tiles, tiles == default, run, flop=flop)


def bench_decode(
    shape: str,
    hf: dict,
    batch: int,
    context: int | tuple[int, int],
    sweep: bool,
    kv_cache_dtype: str = "bf16",
    fp16_operands: tuple[bool, ...] = (True,),
    cold: ColdL2 | None = None,
) -> None:
    """JSON lines: a decode batch's ms and GB/s of K/V at each launch configuration (with
    ``sweep``), over a ``kv_cache_dtype`` cache; an FP8 cache's once per
    ``fp16_operands`` (``paged_attention``'s ``fp8_fp16_operands``); with ``cold``, each
    call after an eviction of L2 (its own time subtracted)."""
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    fp8 = kv_cache_dtype == "fp8"
    tensors, scales, kv_bytes, longest = _decode_batch(hf, batch, context, kv_cache_dtype)
    q, k_cache, v_cache, loc, lens, table = tensors
    scale = head_dim**-0.5
    cache_bytes = k_cache.element_size()
    common = {"kind": "decode", "model": shape, "batch": batch, "context": _context_label(context)}
    if cold:
        common["cold_l2"] = True
    if fp8:
        common["kv_cache_dtype"] = kv_cache_dtype
    default = _default_tiles(True, heads // kv_heads, head_dim, cache_bytes)
    configs = _configs(default, heads // kv_heads, True, sweep, cache_bytes)
    for tiles, fp16 in itertools.product(configs, fp16_operands if fp8 else (None,)):
        out = torch.empty_like(q)
        variant = {"fp8_fp16_operands": fp16} if fp8 else {}

        def run(tiles=tiles, out=out, variant=variant):
            paged_attention(q, k_cache, v_cache, loc, lens, table, scale, max_seq_len=longest,
                            out=out, tiles=tiles, **scales, **variant)  # fmt: skip

        _report({**common, **variant}, tiles, tiles == default, run, cold, kv_bytes=kv_bytes)
    # the default tiles with the sequence search of mixed steps (program i is not seq i)
    out = torch.empty_like(q)

    def searched(out=out):
        paged_attention(q, k_cache, v_cache, loc, lens, table, scale, max_seq_len=longest,
                        out=out, tiles=default, search_sequences=True, **scales)  # fmt: skip

    _report({**common, "searched": True}, default, False, searched, cold, kv_bytes=kv_bytes)


def bench_splits(
    shape: str,
    hf: dict,
    batch: int,
    context: int | tuple[int, int],
    counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    prefetch_modes: tuple[bool, ...] = (False,),
    kv_cache_dtype: str = "bf16",
    longest_first: bool = False,
    cold: ColdL2 | None = None,
) -> None:
    """JSON lines: µs a decode call (device graphs) at each split count of ``counts``, for
    each ``decode_prefetch`` of ``prefetch_modes``, over a ``kv_cache_dtype`` ("bf16" or
    "fp8": the platform's e4m3, unit scales) cache, with the GB/s of K and V it moved."""
    from vtllm.worker.kernels.kv_splits import choose_num_kv_splits

    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    platform = detect_platform(0)
    tensors, scales, kv_bytes, longest = _decode_batch(
        hf, batch, context, kv_cache_dtype, longest_first
    )
    q, k_cache, v_cache, loc, lens, table = tensors
    out = torch.empty_like(q)
    picked = choose_num_kv_splits(batch, batch, kv_heads, longest)
    for splits, prefetch in itertools.product(counts, prefetch_modes):

        def run(i, splits=splits, prefetch=prefetch):
            paged_attention(q, k_cache, v_cache, loc, lens, table, head_dim**-0.5,
                            num_kv_splits=splits, out=out, decode_prefetch=prefetch,
                            **scales)  # fmt: skip

        row = {"kind": "decode-splits", "model": shape, "batch": batch,
               "context": _context_label(context),
               "splits": splits, "decode_prefetch": prefetch, "launcher_picks": picked,
               "kv_cache_dtype": kv_cache_dtype, "longest_first": longest_first}  # fmt: skip
        try:
            if cold:
                row["cold_l2"] = True
            us = cold.timed(platform.graph_us, run) if cold else platform.graph_us(run)
            row["us"] = round(us, 2)
            row["gb_s"] = round(kv_bytes / row["us"] / 1e3, 1)
        except Exception as e:  # noqa: BLE001 - report, go on
            row["error"] = f"{type(e).__name__}: {str(e)[:150]}"
        print(json.dumps(row), flush=True)


def _report(
    common: dict,
    tiles: AttentionTiles,
    is_default: bool,
    run,
    cold: ColdL2 | None = None,
    **work,
) -> None:
    config = f"{tiles.block_m}x{tiles.tile_n} w{tiles.num_warps} s{tiles.num_stages}"
    row = {**common, "config": config, "default": is_default}
    try:
        ms = cold.timed(_time_ms, run) if cold else _time_ms(run)
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
        print(json.dumps({**row, "error": f"{type(e).__name__}: {str(e)[:150]}"}), flush=True)
        return
    row["ms"] = round(ms, 4)
    if "flop" in work:
        row["tflop_s"] = round(work["flop"] / ms / 1e9, 1)
    else:
        row["gb_s"] = round(work["kv_bytes"] / ms / 1e6, 1)
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["llama3-8b", "qwen3-0.6b"])
    parser.add_argument("--prefill-len", type=int, default=8000)
    parser.add_argument("--decode", nargs="+", default=["256x1024", "64x4096", "1x8192"],
                        help="BATCHxCONTEXT or BATCHxLO-HI (contexts uniform in "
                        "[LO, HI]) decode workloads")  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="every launch configuration")
    parser.add_argument("--splits", action="store_true", help="decodes over KV split counts")
    parser.add_argument("--split-counts", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32],
                        help="with --splits: the split counts timed")  # fmt: skip
    parser.add_argument("--decode-prefetch", choices=["off", "on", "both"], default="off",
                        help="with --splits: paged_attention's decode_prefetch")  # fmt: skip
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=["bf16", "fp8"],
                        default=["bf16"], help="the caches the decodes are timed over")  # fmt: skip
    parser.add_argument("--longest-first", choices=["off", "on", "both"], default="off",
                        help="with --splits and BATCHxLO-HI: the longest sequences' "
                        "programs first")  # fmt: skip
    parser.add_argument("--cold-l2", action="store_true",
                        help="decodes: evict L2 before each call, as between a model's "
                        "layers (ColdL2)")  # fmt: skip
    parser.add_argument("--no-prefill", action="store_true", help="decodes only")
    parser.add_argument("--fp8-fp16-operands", choices=["off", "on", "both"], default="on",
                        help="FP8-cache decodes: fp16 dots, bf16 dots, or both")  # fmt: skip
    args = parser.parse_args()
    detect_platform(0).set_device()
    cold = ColdL2() if args.cold_l2 else None
    decodes = [parse_decode(workload) for workload in args.decode]
    for shape in args.shapes:
        hf = MODEL_SHAPES[shape]
        if args.splits:
            orders = BOTH_WAYS[args.longest_first]
            for (batch, context), kv, order in itertools.product(
                decodes, args.kv_cache_dtypes, orders
            ):
                bench_splits(shape, hf, batch, context, tuple(args.split_counts),
                             BOTH_WAYS[args.decode_prefetch], kv, order, cold)  # fmt: skip
            continue
        if not args.no_prefill:
            bench_prefill(shape, hf, args.prefill_len, args.sweep)
        fp16 = BOTH_WAYS[args.fp8_fp16_operands]
        for (batch, context), kv in itertools.product(decodes, args.kv_cache_dtypes):
            bench_decode(shape, hf, batch, context, args.sweep, kv, fp16, cold)


if __name__ == "__main__":
    main()
