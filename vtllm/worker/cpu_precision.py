"""bf16 arithmetic for prompt steps of float32 models on CPUs that multiply bf16 natively:
``VT_CPU_BF16_PREFILL``.

A prefill chunk on a CPU is compute-bound: its float32 products and its attention over
the chunk's keys. On a CPU with AVX-512 BF16 or AMX, oneDNN multiplies bf16 several times
faster than float32, so a step that computes prompt tokens runs

* every float32 matmul with its inputs rounded to bf16, accumulated and returned in
  float32 (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, inside
  ``bf16_products``): weights, norms, residuals and the KV cache stay float32;
* each prefill chunk's attention in bf16 (``AttentionMetadata``'s ``chunk_dtype``: q, k
  and v cast, the output cast back to float32), which SDPA's CPU flash kernel runs on
  the bf16 units.

Decode steps keep their own arithmetic (int4/int8 weight-only products on the embedded
model, float32 otherwise; attention float32). Measured on a 2-vCPU Xeon with AMX
(``docs/BENCHMARKS.md``): a 2,048-token prompt prefilled at 1,530 tok/s instead of 730,
and the README's question and two more answered with the same 24 greedy tokens as
float32 (first-token log-probabilities within 0.06).

``VT_CPU_BF16_PREFILL``: ``auto`` (on where ``/proc/cpuinfo`` lists ``avx512_bf16`` or
``amx_bf16`` and the model runs in float32), ``on`` (any CPU with a float32 model; where
bf16 is emulated it is slower), ``off``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from vtllm import envs

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` of ``/proc/cpuinfo`` (or of ``cpuinfo``, that file's text); empty
    where there is no such file or line (other systems, other architectures)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def bf16_prefill_enabled(
    setting: str, is_gpu: bool, dtype: torch.dtype, flags: frozenset[str]
) -> bool:
    """``VT_CPU_BF16_PREFILL`` resolved for one worker (see the module docstring)."""
    if is_gpu or dtype != torch.float32 or setting == "off":
        return False
    return setting == "on" or bool(flags & NATIVE_BF16_FLAGS)


def choose_bf16_prefill(is_gpu: bool, dtype: torch.dtype) -> bool:
    """``bf16_prefill_enabled`` for this process's environment and CPU."""
    if is_gpu:
        return False
    return bf16_prefill_enabled(envs.VT_CPU_BF16_PREFILL, is_gpu, dtype, cpu_flags())


@contextlib.contextmanager
def bf16_products(active: bool) -> Iterator[None]:
    """Inside, when ``active``: float32 matmuls on the CPU take bf16-rounded inputs and
    accumulate in float32 (oneDNN; a no-op on a torch without the setting)."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if not active or matmul is None or not hasattr(matmul, "fp32_precision"):
        yield
        return
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = previous
