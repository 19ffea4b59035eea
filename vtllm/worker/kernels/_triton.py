"""Triton, or a stand-in when it is not installed.

Triton comes with torch on CUDA/ROCm hosts; a CPU install leaves it out (it is a test
extra there, for the interpreter-mode kernel tests). The kernel modules import
``triton`` and ``tl`` from here, so that they import on CPU without it: their torch
references (``*_ref``), which CPU runs, need no Triton. Launching a kernel without
Triton raises ImportError naming the fix.
"""

from __future__ import annotations

import functools
from typing import Any

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # a CPU install
    HAVE_TRITON = False

    _MISSING = (
        "Triton is not installed: GPU kernels need it (it comes with torch's CUDA and ROCm "
        "builds; on CPU: pip install triton, or VT_ATTENTION_BACKEND=torch)"
    )

    class _Unavailable:
        """Any attribute of the stand-in: usable in annotations, fails when used."""

        def __init__(self, name: str) -> None:
            self._name = name

        def __getattr__(self, name: str) -> _Unavailable:
            return _Unavailable(f"{self._name}.{name}")

        def __getitem__(self, key: Any) -> Any:
            raise ImportError(f"{self._name}: {_MISSING}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise ImportError(f"{self._name}: {_MISSING}")

    class _TritonStandIn(_Unavailable):
        def jit(self, fn: Any = None, **kwargs: Any) -> Any:
            """``@triton.jit`` and ``@triton.jit(...)``: the kernel, unlaunchable."""
            if fn is None:
                return lambda f: _Unavailable(f"kernel {f.__name__}")
            return _Unavailable(f"kernel {fn.__name__}")

    triton = _TritonStandIn("triton")  # type: ignore[assignment]
    tl = _Unavailable("triton.language")  # type: ignore[assignment]


def _device_property(device: Any, key: str) -> int:
    """A property of a GPU ``torch.device`` from Triton's active driver (vendor-neutral)."""
    from triton.runtime import driver as triton_driver

    driver = triton_driver.active
    index = device.index if device.index is not None else driver.get_current_device()
    return int(driver.utils.get_device_properties(index)[key])


@functools.cache
def num_sms(device: Any) -> int:
    """Streaming multiprocessors (CUDA) / compute units (ROCm) of a ``torch.device``; 1 off
    a GPU."""
    return _device_property(device, "multiprocessor_count") if device.type == "cuda" else 1


@functools.cache
def max_shared_memory(device: Any) -> int:
    """Bytes of shared memory (LDS on ROCm) one program may use on a ``torch.device``
    (H200: 232,448; MI300: 65,536); unbounded off a GPU."""
    return _device_property(device, "max_shared_mem") if device.type == "cuda" else 1 << 40


_ARRIVAL_COUNTERS: dict[tuple[Any, int], Any] = {}


def arrival_counters(device: Any, count: int) -> Any:
    """``count`` zeroed int32 counters on ``device`` for kernels whose programs count
    themselves in (``tl.atomic_add``) so that the last to arrive finishes the work; that
    program resets its counter, so they are zero again between launches and graph
    replays. One buffer per (device, count), made on first use: before any graph capture
    (warm-up runs eagerly)."""
    import torch

    counters = _ARRIVAL_COUNTERS.get((device, count))
    if counters is None:
        counters = torch.zeros(count, dtype=torch.int32, device=device)
        _ARRIVAL_COUNTERS[(device, count)] = counters
    return counters


__all__ = [
    "HAVE_TRITON", "arrival_counters", "max_shared_memory", "num_sms", "tl", "triton",
]  # fmt: skip
