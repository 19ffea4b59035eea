"""Compile every kernel ahead of time for GPU targets, with no GPU: ``python -m`` this.

Run in a child process with ``TRITON_INTERPRET=0`` (the kernel tests' process has the
interpreter on, and ``triton.compile`` needs real ``JITFunction`` objects). Prints one
JSON document (to ``--out``): per (kernel variant, target) the stages produced, a few facts read from
each, and the first stage that failed with its error.

A failed ``triton.compile`` leaves the stages it finished in its cache directory (each
is stored as soon as it is produced), which is how the failing stage is found.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vtllm.worker.kernels import (
    activation,
    fp8_matmul,
    fp8_quant,
    fused_moe,
    fused_moe_decode,
    gemv,
    kv_splits,
    moe_align,
    moe_routing,
    paged_attention,
    qkv_prep,
    reshape_and_cache,
    rms_norm,
    rotary,
)

TARGETS = {
    "mi300-gfx942": GPUTarget("hip", "gfx942", 64),
    "r9700-gfx1201": GPUTarget("hip", "gfx1201", 32),
    "h100-sm90": GPUTarget("cuda", 90, 32),
}
STAGES = {
    "hip": ["ttir", "ttgir", "llir", "amdgcn", "hsaco"],
    "cuda": ["ttir", "ttgir", "llir", "ptx", "cubin"],
}
# pointer arguments that are not of the activation dtype
_POINTER_TYPES = {
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "block_tables_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "positions_ptr": "*i64",
    "cos_sin_cache_ptr": "*fp32",
    "partial_out_ptr": "*fp32",
    "partial_max_ptr": "*fp32",
    "partial_sum_ptr": "*fp32",
    "row_scale_ptr": "*fp32",
    "pair_weights_ptr": "*fp32",
    "sorted_pair_ids_ptr": "*i32",
    "block_expert_ids_ptr": "*i32",
    "num_padded_ptr": "*i32",
    "pair_expert_ids_ptr": "*i32",
    "ids_ptr": "*i32",
    "arrivals_ptr": "*i32",
    "weights_ptr": "*fp32",
    "scale_ptr": "*fp32",
    "a_scale_ptr": "*fp32",
    "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32",
}
_FLOAT_SCALARS = {"scale_log2", "eps", "input_eps", "norm_eps"}
# e4m3 as each target's hardware has it (vtllm's Platform.fp8_dtype): MI300 (gfx942)
# e4m3fnuz = fp8e4b8; RDNA4 (gfx1201) and Hopper OCP e4m3fn = fp8e4nv
FP8_TYPES = {"mi300-gfx942": "fp8e4b8", "r9700-gfx1201": "fp8e4nv", "h100-sm90": "fp8e4nv"}


@dataclass
class Variant:
    name: str
    kernel: Any  # a JITFunction
    dtype: str  # activation dtype: fp16, bf16, fp32
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2  # what the attention launcher passes
    fp8_pointers: tuple[str, ...] = ()  # pointers to the target's e4m3 (FP8 weights)
    targets: tuple[str, ...] | None = None  # None: every target (else e.g. CUDA-only ops)
    # compile as the JIT does for served shapes: every pointer and every integer not opted
    # out of specialisation divisible by 16 (else all are assumed unaligned, which can
    # split wide loads into single elements; benchmarks/sass_loop.py reads these)
    aligned: bool = False

    def signature(self, target_name: str) -> dict[str, str]:
        unset = [p.name for p in self.kernel.params if p.is_constexpr and not p.has_default]
        unset = [name for name in unset if name not in self.constexprs]
        if unset:  # it would compile as a runtime i32 and leave a branch untested
            raise ValueError(f"{self.name}: constexpr parameters without a value: {unset}")
        signature = {}
        for arg in self.kernel.arg_names:
            if arg in self.constexprs:
                signature[arg] = "constexpr"
            elif arg in self.fp8_pointers:
                signature[arg] = f"*{FP8_TYPES[target_name]}"
            elif arg.endswith("_ptr"):
                signature[arg] = _POINTER_TYPES.get(arg, f"*{self.dtype}")
            else:
                signature[arg] = "fp32" if arg in _FLOAT_SCALARS else "i32"
        return signature

    def source(self, target_name: str) -> ASTSource:
        """What ``triton.compile`` takes for this variant on ``target_name``."""
        signature = self.signature(target_name)
        return ASTSource(
            fn=self.kernel,
            signature=signature,
            constexprs=self.constexprs,
            attrs=self.attrs(signature),
        )

    def attrs(self, signature: dict[str, str]) -> dict[tuple[int, ...], list]:
        """Triton's ``tt.divisibility`` hints for ``aligned`` (else none)."""
        if not self.aligned:
            return {}
        names = self.kernel.arg_names
        opted_out = getattr(self.kernel, "do_not_specialize", ()) or ()
        unaligned = {names[i] if isinstance(i, int) else i for i in opted_out}
        return {
            (i,): [["tt.divisibility", 16]]
            for i, arg in enumerate(names)
            if signature[arg] not in ("constexpr", "fp32") and arg not in unaligned
        }


_ATTENTION = dict(SLIDING_WINDOW=0, NUM_KV_SPLITS=1, KV_FP8=False, ONE_QUERY_A_SEQ=False)
_ATTENTION |= dict(DECODE_PREFETCH=False, FP16_OPERANDS=False)
# the attention kernel without its fused q/k prep (PREP)
_NO_PREP = dict(PREP=False, HALF=1, NORM=0, WEIGHT_OFFSET=1.0, INPUT_RSTD=False, HIDDEN_PAD=1)
_NO_PREP |= dict(FP8_MAX=0.0)
_ATTENTION |= _NO_PREP
_NO_SCALE = dict(W_SCALE=0, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1)
_BLOCK_SCALES = dict(W_SCALE=2, SCALE_BLOCK_N=128, SCALE_BLOCK_K=128)
_PLAIN_OUT = dict(RESIDUAL=False, SCALED_OUT=False)  # the down-sum kernel without its epilogues
_GEMV_PLAIN = dict(NORM=False, SILU_AND_MUL=False, RESIDUAL=False, USE_GDC=False)
VARIANTS = [
    Variant(
        "paged_attention/prefill-bf16-d128",
        paged_attention._paged_attention_kernel,
        "bf16",
        dict(_ATTENTION, HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP_SIZE=4, BLOCK_M=64, BLOCK_Q=16)
        | dict(TILE_N=32, BLOCK_SIZE=16),
    ),
    Variant(  # Gemma 4's full layers: head_dim 512, 16 query heads on 2 KV heads
        "paged_attention/prefill-bf16-d512-gqa8",
        paged_attention._paged_attention_kernel,
        "bf16",
        dict(_ATTENTION, HEAD_DIM=512, HEAD_DIM_PAD=512, GROUP_SIZE=8, BLOCK_M=64, BLOCK_Q=8)
        | dict(TILE_N=32, BLOCK_SIZE=16),
        num_warps=8,
    ),
    Variant(
        "paged_attention/decode-split-fp16-d80-window",
        paged_attention._paged_attention_kernel,
        "fp16",
        dict(HEAD_DIM=80, HEAD_DIM_PAD=128, GROUP_SIZE=8, BLOCK_M=16, BLOCK_Q=2, TILE_N=64)
        | dict(BLOCK_SIZE=32, SLIDING_WINDOW=4096, NUM_KV_SPLITS=8, KV_FP8=False)
        | dict(ONE_QUERY_A_SEQ=True, DECODE_PREFETCH=True, FP16_OPERANDS=False)
        | _NO_PREP,
    ),
    Variant(  # Qwen3-30B-A3B's decode in the MoE chain: q/k norm, the input norm's 1/rms
        "paged_attention/decode-prep-bf16-d128-qk-norm-input-rstd",
        paged_attention._paged_attention_kernel,
        "bf16",
        dict(_ATTENTION, HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP_SIZE=8, BLOCK_M=16, BLOCK_Q=2)
        | dict(TILE_N=128, BLOCK_SIZE=16, ONE_QUERY_A_SEQ=True, DECODE_PREFETCH=True)
        | dict(PREP=True, HALF=64, NORM=1, INPUT_RSTD=True, HIDDEN_PAD=2048),
    ),
    Variant(  # Llama partial rotary into an FP8 cache, split KV
        "paged_attention/decode-prep-split-fp16-fp8kv-d80",
        paged_attention._paged_attention_kernel,
        "fp16",
        dict(_ATTENTION, HEAD_DIM=80, HEAD_DIM_PAD=128, GROUP_SIZE=4, BLOCK_M=16, BLOCK_Q=4)
        | dict(TILE_N=64, BLOCK_SIZE=16, NUM_KV_SPLITS=4, KV_FP8=True, ONE_QUERY_A_SEQ=True)
        | dict(DECODE_PREFETCH=True, PREP=True, HALF=16, FP8_MAX=448.0),
        fp8_pointers=("k_cache_ptr", "v_cache_ptr"),
    ),
    Variant(  # the batch-1 rows' decode: Qwen3-0.6B heads, one pass, the prefetching loop
        "paged_attention/decode-prefetch-bf16-d128",
        paged_attention._paged_attention_kernel,
        "bf16",
        dict(_ATTENTION, HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP_SIZE=2, BLOCK_M=16, BLOCK_Q=8)
        | dict(TILE_N=128, BLOCK_SIZE=16, ONE_QUERY_A_SEQ=True, DECODE_PREFETCH=True),
    ),
    Variant(
        "paged_attention/prefill-bf16-fp8kv-d128",
        paged_attention._paged_attention_kernel,
        "bf16",
        dict(_ATTENTION, HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP_SIZE=4, BLOCK_M=64, BLOCK_Q=16)
        | dict(TILE_N=32, BLOCK_SIZE=16, KV_FP8=True, FP16_OPERANDS=True),  # bf16 q: fp16 dots
        fp8_pointers=("k_cache_ptr", "v_cache_ptr"),
    ),
    Variant(
        "paged_attention/decode-split-bf16-fp8kv-d128",
        paged_attention._paged_attention_kernel,
        "bf16",
        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP_SIZE=8, BLOCK_M=16, BLOCK_Q=2, TILE_N=64)
        | dict(BLOCK_SIZE=16, SLIDING_WINDOW=0, NUM_KV_SPLITS=8, KV_FP8=True)
        | dict(ONE_QUERY_A_SEQ=True, DECODE_PREFETCH=False, FP16_OPERANDS=True)
        | _NO_PREP,
        fp8_pointers=("k_cache_ptr", "v_cache_ptr"),
    ),
    Variant(  # the Llama-3-8B shape's decode over an FP8 cache as served (sass_loop.py)
        "paged_attention/decode-prep-bf16-fp8kv-served-d128",
        paged_attention._paged_attention_kernel,
        "bf16",
        dict(_ATTENTION, HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP_SIZE=4, BLOCK_M=16, BLOCK_Q=4)
        | dict(TILE_N=128, BLOCK_SIZE=16, KV_FP8=True, FP16_OPERANDS=True)
        | dict(ONE_QUERY_A_SEQ=True, DECODE_PREFETCH=True, PREP=True, HALF=64, FP8_MAX=448.0),
        num_stages=3,
        fp8_pointers=("k_cache_ptr", "v_cache_ptr"),
        aligned=True,
        targets=("h100-sm90",),
    ),
    Variant(
        "kv_splits_reduce/fp16-d80",
        kv_splits._reduce_splits_kernel,
        "fp16",
        dict(HEAD_DIM=80, HEAD_DIM_PAD=128, NUM_KV_SPLITS=8),
    ),
    Variant(
        "reshape_and_cache/bf16-d128",
        reshape_and_cache._reshape_and_cache_kernel,
        "bf16",
        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, QUANTIZE=False, FP8_MAX=0.0),
        num_warps=1,
    ),
    Variant(
        "reshape_and_cache/bf16-to-fp8-d128",
        reshape_and_cache._reshape_and_cache_kernel,
        "bf16",
        # FP8_MAX: e4m3fn's; the kernel only clamps with it, so one value compiles both
        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, QUANTIZE=True, FP8_MAX=448.0),
        num_warps=1,
        fp8_pointers=("k_cache_ptr", "v_cache_ptr"),
    ),
    Variant(
        "rms_norm/bf16-residual-gemma",
        rms_norm._rms_norm_kernel,
        "bf16",
        dict(BLOCK=4096, HAS_RESIDUAL=True, GEMMA=True, WEIGHT_OFFSET=1.0),
        num_warps=8,
    ),
    Variant(
        "rms_norm/fp16-plain",
        rms_norm._rms_norm_kernel,
        "fp16",
        dict(BLOCK=128, HAS_RESIDUAL=False, GEMMA=False, WEIGHT_OFFSET=1.0),
        num_warps=1,
    ),
    Variant(
        "rotary/bf16-d128",
        rotary._rotary_kernel,
        "bf16",
        dict(HALF=64, HALF_PAD=64, Q_HEADS_PAD=32, K_HEADS_PAD=8),
    ),
    Variant(
        "act_and_mul/bf16-gelu-tanh",
        activation._act_and_mul_kernel,
        "bf16",
        dict(BLOCK=1024, USE_GELU_TANH=True),
    ),
    Variant(
        "act_and_mul/fp32-silu",
        activation._act_and_mul_kernel,
        "fp32",
        dict(BLOCK=1024, USE_GELU_TANH=False),
    ),
    Variant(
        "fused_moe_gemm/bf16-gate-up-silu",
        fused_moe._fused_moe_gemm_kernel,
        "bf16",
        dict(A_PAIRS_PER_ROW=8, GATED=True, ACTIVATION=0, MUL_WEIGHT=False, A_FP8=False)
        | dict(_NO_SCALE, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32),
    ),
    Variant(
        "fused_moe_gemm/fp16-down-weighted",
        fused_moe._fused_moe_gemm_kernel,
        "fp16",
        dict(A_PAIRS_PER_ROW=1, GATED=False, ACTIVATION=0, MUL_WEIGHT=True, A_FP8=False)
        | dict(_NO_SCALE, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64),
    ),
    Variant(
        "fused_moe_gemv/bf16-gate-up-gelu-tanh",
        fused_moe_decode._fused_moe_gemv_kernel,
        "bf16",
        dict(TOP_K=8, ACTIVATION=1) | dict(_NO_SCALE, BLOCK_N=8, BLOCK_K=1024),
        num_warps=4,
    ),
    Variant(
        "fused_moe_gemv/fp16-fp8-block-gate-up-silu",
        fused_moe_decode._fused_moe_gemv_kernel,
        "fp16",
        dict(TOP_K=8, ACTIVATION=0) | dict(_BLOCK_SCALES, BLOCK_N=64, BLOCK_K=128),
        fp8_pointers=("w_ptr",),
    ),
    Variant(
        "fused_moe_gemm/bf16-fp8-block-gate-up-silu",
        fused_moe._fused_moe_gemm_kernel,
        "bf16",
        dict(A_PAIRS_PER_ROW=8, GATED=True, ACTIVATION=0, MUL_WEIGHT=False, A_FP8=False)
        | dict(_BLOCK_SCALES, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32),
        fp8_pointers=("w_ptr",),
    ),
    # w8a8 (fp8_activations): where Platform.has_fp8_dot enables it (sm89+, gfx942/950)
    Variant(
        "fused_moe_gemm/w8a8-block-gate-up-silu",
        fused_moe._fused_moe_gemm_kernel,
        "bf16",
        dict(A_PAIRS_PER_ROW=8, GATED=True, ACTIVATION=0, MUL_WEIGHT=False, A_FP8=True)
        | dict(_BLOCK_SCALES, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64),
        fp8_pointers=("a_ptr", "w_ptr"),
        targets=("mi300-gfx942", "h100-sm90"),
    ),
    Variant(
        "fused_moe_gemm/w8a8-row-down-weighted",
        fused_moe._fused_moe_gemm_kernel,
        "bf16",
        dict(A_PAIRS_PER_ROW=1, GATED=False, ACTIVATION=0, MUL_WEIGHT=True, A_FP8=True)
        | dict(W_SCALE=1, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64),
        fp8_pointers=("a_ptr", "w_ptr"),
        targets=("mi300-gfx942", "h100-sm90"),
    ),
    Variant(
        "fp8_quant/bf16-group-128",
        fp8_quant._quantize_fp8_kernel,
        "bf16",
        dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448.0, FP8_MIN_NORMAL=2.0**-6, MIN_SCALE_AMAX=1e-12)
        | dict(GROUP=128, BLOCK=128),
        fp8_pointers=("out_ptr",),
        num_warps=1,
    ),
    Variant(
        "fp8_quant/fp16-row-2048",
        fp8_quant._quantize_fp8_kernel,
        "fp16",
        dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448.0, FP8_MIN_NORMAL=2.0**-6, MIN_SCALE_AMAX=1e-12)
        | dict(GROUP=2048, BLOCK=1024),
        fp8_pointers=("out_ptr",),
    ),
    Variant(
        "fused_moe_gemv/bf16-fp8-row-gate-up-silu",
        fused_moe_decode._fused_moe_gemv_kernel,
        "bf16",
        dict(TOP_K=8, ACTIVATION=0, W_SCALE=1, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1)
        | dict(BLOCK_N=8, BLOCK_K=512),
        num_warps=8,
        fp8_pointers=("w_ptr",),
    ),
    Variant(
        "qkv_prep/bf16-qk-norm",
        qkv_prep._qkv_prep_kernel,
        "bf16",
        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, HALF=64, NORM=1, WEIGHT_OFFSET=1.0)
        | dict(BLOCK_SIZE=16, QUANTIZE=False, FP8_MAX=0.0, INPUT_RSTD=False, HIDDEN_PAD=1),
        num_warps=1,
    ),
    Variant(
        "qkv_prep/bf16-qk-norm-input-rstd",
        qkv_prep._qkv_prep_kernel,
        "bf16",
        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, HALF=64, NORM=1, WEIGHT_OFFSET=1.0)
        | dict(BLOCK_SIZE=16, QUANTIZE=False, FP8_MAX=0.0, INPUT_RSTD=True, HIDDEN_PAD=2048),
        num_warps=1,
    ),
    Variant(
        "qkv_prep/fp16-gemma-norm-fp8-cache",
        qkv_prep._qkv_prep_kernel,
        "fp16",
        dict(HEAD_DIM=256, HEAD_DIM_PAD=256, HALF=64, NORM=2, WEIGHT_OFFSET=1.0)
        | dict(BLOCK_SIZE=16, QUANTIZE=True, FP8_MAX=448.0, INPUT_RSTD=False, HIDDEN_PAD=1),
        num_warps=2,
        fp8_pointers=("k_cache_ptr", "v_cache_ptr"),
    ),
    Variant(
        "fused_moe_down_sum/bf16-top8",
        fused_moe_decode._fused_moe_down_sum_kernel,
        "bf16",
        dict(TOP_K=8, BLOCK_TOPK=8, BLOCK_N=8, BLOCK_K=64) | _NO_SCALE | _PLAIN_OUT,
    ),
    Variant(
        "fused_moe_down_sum/bf16-top8-into-stream",
        fused_moe_decode._fused_moe_down_sum_kernel,
        "bf16",
        dict(TOP_K=8, BLOCK_TOPK=8, BLOCK_N=2, BLOCK_K=256, RESIDUAL=True, SCALED_OUT=True)
        | _NO_SCALE,
        num_warps=8,
    ),
    Variant(
        "fused_moe_down_sum/bf16-top8-2-wide",
        fused_moe_decode._fused_moe_down_sum_kernel,
        "bf16",
        dict(TOP_K=8, BLOCK_TOPK=8, BLOCK_N=2, BLOCK_K=256) | _NO_SCALE | _PLAIN_OUT,
        num_warps=8,
    ),
    Variant(
        "fused_moe_down_sum/bf16-fp8-block-top8",
        fused_moe_decode._fused_moe_down_sum_kernel,
        "bf16",
        dict(TOP_K=8, BLOCK_TOPK=8, BLOCK_N=16, BLOCK_K=64) | _BLOCK_SCALES | _PLAIN_OUT,
        fp8_pointers=("w_ptr",),
    ),
    Variant(
        "fused_moe_down_sum/fp16-fp8-row-top6",
        fused_moe_decode._fused_moe_down_sum_kernel,
        "fp16",
        dict(TOP_K=6, BLOCK_TOPK=8, BLOCK_N=32, BLOCK_K=64, W_SCALE=1)
        | dict(SCALE_BLOCK_N=1, SCALE_BLOCK_K=1)
        | _PLAIN_OUT,
        fp8_pointers=("w_ptr",),
    ),
    Variant(
        "gemv/bf16-1-row",
        gemv._gemv_kernel,
        "bf16",
        dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, ROW_SCALE=False) | _GEMV_PLAIN,
    ),
    Variant(
        "gemv/fp16-4-rows",
        gemv._gemv_kernel,
        "fp16",
        dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=256, ROW_SCALE=False) | _GEMV_PLAIN,
    ),
    Variant(  # session 42's 2-output candidate tile at the most rows it serves
        "gemv/bf16-2x2048-4-rows",
        gemv._gemv_kernel,
        "bf16",
        dict(BLOCK_M=4, BLOCK_N=2, BLOCK_K=2048, ROW_SCALE=False) | _GEMV_PLAIN,
    ),
    Variant(
        "gemv/bf16-fp8-row-scales",
        gemv._gemv_kernel,
        "bf16",
        dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, ROW_SCALE=True) | _GEMV_PLAIN,
        fp8_pointers=("w_ptr",),
    ),
    Variant(
        "gemv/bf16-norm-prologue",
        gemv._gemv_kernel,
        "bf16",
        dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, ROW_SCALE=False) | dict(_GEMV_PLAIN, NORM=True),
    ),
    Variant(  # programmatic dependent launch: griddepcontrol exists on sm90+ only
        "gemv/bf16-pdl-norm",
        gemv._gemv_kernel,
        "bf16",
        dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, ROW_SCALE=False)
        | dict(_GEMV_PLAIN, NORM=True, USE_GDC=True),
        targets=("h100-sm90",),
    ),
    Variant(
        "gemv/bf16-silu-and-mul-residual",
        gemv._gemv_kernel,
        "bf16",
        dict(BLOCK_M=2, BLOCK_N=4, BLOCK_K=1024, ROW_SCALE=False)
        | dict(_GEMV_PLAIN, SILU_AND_MUL=True, RESIDUAL=True),
    ),
    Variant("moe_align/count-128", moe_align._count_kernel, "i32", dict(BLOCK_P=64, BLOCK_E=128)),
    Variant("moe_align/layout-128", moe_align._layout_kernel, "i32", dict(BLOCK_E=128, BLOCK_B=64)),
    Variant(
        "moe_align/scatter-128", moe_align._scatter_kernel, "i32", dict(BLOCK_P=64, BLOCK_E=128)
    ),
    Variant(
        "moe_route/bf16-softmax-top8-of-128",
        moe_routing._moe_route_kernel,
        "bf16",
        dict(TOP_K=8, SCORING=0, RENORMALIZE=True, ROUND=True, HAS_EXPERT_SCALE=False)
        | dict(BLOCK_E=128, BLOCK_TOPK=8),
    ),
    Variant(
        "moe_route/fp32-sigmoid-scaled",
        moe_routing._moe_route_kernel,
        "fp32",
        dict(TOP_K=4, SCORING=1, RENORMALIZE=False, ROUND=False, HAS_EXPERT_SCALE=True)
        | dict(BLOCK_E=256, BLOCK_TOPK=4),
    ),
    Variant(
        "moe_router_route/bf16-softmax-top8-of-128-decode-rank",
        moe_routing._moe_router_route_kernel,
        "bf16",
        dict(TOP_K=8, SCORING=0, RENORMALIZE=True, ROUND=True, HAS_EXPERT_SCALE=False)
        | dict(BLOCK_E=128, BLOCK_TOPK=8, BLOCK_T=1, BLOCK_N=2, BLOCK_K=1024)
        | dict(NORM=False, HAS_RESIDUAL=False, PACKED_TOPK=True, RANK_TOPK=True),
    ),
    Variant(
        "moe_router_route/bf16-norm-residual-top8-of-128-decode",
        moe_routing._moe_router_route_kernel,
        "bf16",
        dict(TOP_K=8, SCORING=0, RENORMALIZE=True, ROUND=True, HAS_EXPERT_SCALE=False)
        | dict(BLOCK_E=128, BLOCK_TOPK=8, BLOCK_T=1, BLOCK_N=2, BLOCK_K=1024)
        | dict(NORM=True, HAS_RESIDUAL=True, PACKED_TOPK=True, RANK_TOPK=False),
    ),
    Variant(
        "moe_router_route/fp16-sigmoid-scaled-8-tokens",
        moe_routing._moe_router_route_kernel,
        "fp16",
        dict(TOP_K=4, SCORING=1, RENORMALIZE=False, ROUND=False, HAS_EXPERT_SCALE=True)
        | dict(BLOCK_E=256, BLOCK_TOPK=4, BLOCK_T=8, BLOCK_N=4, BLOCK_K=128)
        | dict(NORM=False, HAS_RESIDUAL=False, PACKED_TOPK=False, RANK_TOPK=False),
    ),
    Variant(
        "fp8_matmul/bf16-block-128",
        fp8_matmul._fp8_matmul_kernel,
        "bf16",
        dict(SCALE_BLOCK_N=128, SCALE_BLOCK_K=128, PER_ROW=False)
        | dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128),
        fp8_pointers=("w_ptr",),
    ),
    Variant(
        "fp8_matmul/fp16-per-row",
        fp8_matmul._fp8_matmul_kernel,
        "fp16",
        dict(SCALE_BLOCK_N=1, SCALE_BLOCK_K=1, PER_ROW=True)
        | dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64),
        fp8_pointers=("w_ptr",),
    ),
]


@dataclass
class Result:
    variant: str
    kernel: str
    target: str
    expected_stages: list[str]
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed_stage: str | None = None
    error: str | None = None
    seconds: float = 0.0


def _facts(stage: str, module: str | bytes) -> dict[str, Any]:
    """A few checkable facts about one stage's output."""
    facts: dict[str, Any] = {"bytes": len(module)}
    if isinstance(module, bytes):
        facts["elf"] = module[:4] == b"\x7fELF"
        return facts
    for line in module.splitlines():
        if stage == "ttgir" and "ttg.threads-per-warp" in line:
            facts["threads_per_warp"] = int(line.split('"ttg.threads-per-warp" = ')[1].split()[0])
        if stage == "amdgcn" and line.strip().startswith(".amdgcn_target"):
            facts["target"] = line.split('"')[1]
        if stage == "ptx" and line.startswith(".target"):
            facts["target"] = line.split()[1]
    if stage == "amdgcn":
        facts["matrix_instructions"] = module.count("v_mfma") + module.count("v_wmma")
        facts["fp8_matrix_instructions"] = module.count("_fp8_fp8")  # v_mfma_f32_*_fp8_fp8
    if stage == "ptx":
        facts["matrix_instructions"] = module.count("mma.")
        facts["fp8_matrix_instructions"] = module.count(".e4m3.e4m3")  # wgmma/mma e4m3 x e4m3
    return facts


def compile_variant(variant: Variant, target_name: str) -> Result:
    target = TARGETS[target_name]
    kernel_name = variant.kernel.fn.__name__
    result = Result(variant.name, kernel_name, target_name, STAGES[target.backend])
    started = time.monotonic()
    source = variant.source(target_name)
    with tempfile.TemporaryDirectory() as cache_dir:
        triton.knobs.cache.dir = cache_dir
        try:
            compiled = triton.compile(
                source,
                target=target,
                options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
            )
            produced = {s: compiled.asm[s] for s in result.expected_stages if s in compiled.asm}
        except Exception as error:  # noqa: BLE001 - recorded, the test decides
            result.error = f"{type(error).__name__}: {error}"[:3000]
            produced = {}
            for path in Path(cache_dir).rglob("*"):
                stage = path.suffix.lstrip(".")
                if stage in result.expected_stages:
                    data = path.read_bytes()
                    binary = stage in ("hsaco", "cubin")
                    produced[stage] = data if binary else data.decode(errors="replace")
    result.stages = {s: _facts(s, m) for s, m in produced.items()}
    missing = [s for s in result.expected_stages if s not in produced]
    if missing:
        result.failed_stage = missing[0]
    result.seconds = round(time.monotonic() - started, 2)
    return result


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), default=[])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    parser.add_argument("variants", nargs="*", help="variant-name prefixes (default: all)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results = [
        compile_variant(variant, target_name)
        for variant in VARIANTS
        if not args.variants or any(variant.name.startswith(v) for v in args.variants)
        for target_name in args.target or TARGETS
        if variant.targets is None or target_name in variant.targets
    ]
    report = {
        "triton": triton.__version__,
        "seconds": round(time.monotonic() - started, 1),
        "results": [r.__dict__ for r in results],
    }
    # a file, not stdout: triton prints tool logs (e.g. a failing ptxas) to stdout
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
