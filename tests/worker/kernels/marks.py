"""Markers and tolerances shared by the kernel tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from vtllm.worker.platform import detect_platform

F = TypeVar("F", bound=Callable)


def gpu(test: F) -> F:
    """A GPU test: deselected by default (pyproject: -m 'not gpu'), run with -m gpu."""
    skip = pytest.mark.skipif(not detect_platform().is_gpu, reason="needs a CUDA or ROCm GPU")
    return pytest.mark.gpu(skip(test))


# Kernel vs fp32 reference. bf16 is never run in the interpreter (it computes bf16
# tl.dot wrongly and truncates fp32 -> bf16 casts).
TOLERANCES = {
    torch.float32: {"atol": 2e-4, "rtol": 2e-4},
    torch.float16: {"atol": 5e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Kernel output vs reference at the tolerance of the actual tensor's dtype."""
    torch.testing.assert_close(
        actual.float(), expected.float(), **TOLERANCES[actual.dtype], msg=lambda m: f"{what}: {m}"
    )
