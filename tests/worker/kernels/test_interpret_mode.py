"""The kernel tests really run under Triton's interpreter on CPU (see conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from vtllm.worker.kernels import (
    activation,
    fp8_matmul,
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

from .conftest import NEEDS_FRESH_PROCESS, ON_GPU, interpreter_ready

KERNELS = [
    activation._act_and_mul_kernel,
    fp8_matmul._fp8_matmul_kernel,
    fused_moe._fused_moe_gemm_kernel,
    fused_moe_decode._fused_moe_gemv_kernel,
    fused_moe_decode._fused_moe_down_sum_kernel,
    gemv._gemv_kernel,
    moe_align._count_kernel,
    moe_align._layout_kernel,
    moe_align._scatter_kernel,
    moe_routing._moe_route_kernel,
    paged_attention._paged_attention_kernel,
    kv_splits._reduce_splits_kernel,
    qkv_prep._qkv_prep_kernel,
    reshape_and_cache._reshape_and_cache_kernel,
    rms_norm._rms_norm_kernel,
    rotary._rotary_kernel,
]
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernels are compiled")
def test_kernels_and_triton_library_are_interpreted_on_cpu():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert all(isinstance(k, InterpretedFunction) for k in KERNELS), KERNELS
    assert interpreter_ready()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_kernels_are_compiled_on_gpu():
    assert all(isinstance(k, JITFunction) for k in KERNELS), KERNELS


def test_a_kernel_runs_on_this_device(device):
    x = torch.ones(2, 8, device=device)
    out = activation.silu_and_mul(x)
    torch.testing.assert_close(out, activation.silu_and_mul_ref(x))


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the interpreter works in this process")
def test_kernel_tests_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(Path(__file__).parent),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    print(result.stdout[-2000:])
