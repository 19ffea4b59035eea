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

from vtllm.worker.kernels import activation

from .conftest import NEEDS_FRESH_PROCESS, ON_GPU, interpreter_ready
from .kernel_inventory import kernel_functions

KERNELS = list(kernel_functions().values())
assert len(KERNELS) >= 17, "the kernel inventory lost kernels"
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
