"""How much device memory a GPU worker gives its KV cache: a pure function of measured
numbers, so every term can be checked on CPU.

``--gpu-memory-utilization`` caps the whole device, every process on it counted::

    limit              = gpu_memory_utilization × total
    − in use at start    total − free before the worker loads anything: other
                         processes and this worker's CUDA/HIP context
    − non-torch growth   what appeared outside torch's allocator since: NCCL/RCCL
                         buffers, loaded kernels, library workspaces
    − weights            torch-allocated after loading
    − peak activation    torch's peak over a max-size dummy step, beyond the weights
                         and the dummy step's own small KV cache
    − decode graphs      device memory the largest graph took × the number of graphs
    − sampler state      penalties' per-slot statistics, max_num_seqs × vocab
    = KV cache

(CPU workers take ``--kv-cache-memory`` as it is; nothing here applies.)
"""

from __future__ import annotations

from dataclasses import dataclass

from vtllm.worker.platform import MemorySnapshot

GiB = 1024**3
MiB = 1024**2


class NoMemoryForKVCache(RuntimeError):
    """Nothing is left for the KV cache; the message names every term and the flags."""


@dataclass(frozen=True)
class MemoryBudget:
    """The terms of one worker's KV budget, in bytes (see the module docstring)."""

    utilization: float
    total: int
    in_use_at_start: int
    non_torch_growth: int
    weights: int
    peak_activation: int
    graphs: int
    sampler_state: int

    @property
    def limit(self) -> int:
        return int(self.utilization * self.total)

    @property
    def kv_cache(self) -> int:
        """Bytes left for the KV cache; zero or negative when nothing is left."""
        return self.limit - (
            self.in_use_at_start
            + self.non_torch_growth
            + self.weights
            + self.peak_activation
            + self.graphs
            + self.sampler_state
        )

    def describe(self) -> str:
        """Every term on one line, for the start-up log."""
        return (
            f"limit {self.utilization:.2f} × {_size(self.total)} = {_size(self.limit)}"
            f" − in use at start {_size(self.in_use_at_start)} (other processes, CUDA context)"
            f" − non-torch growth {_size(self.non_torch_growth)} (communication buffers,"
            f" kernels, workspaces) − weights {_size(self.weights)}"
            f" − peak activation {_size(self.peak_activation)}"
            f" − decode graphs {_size(self.graphs)} − sampler state {_size(self.sampler_state)}"
            f" → KV cache {_size(self.kv_cache)}"
        )

    def kv_cache_bytes(self) -> int:
        """``kv_cache``, or ``NoMemoryForKVCache`` naming the numbers and the flags when
        nothing is left."""
        if self.kv_cache > 0:
            return self.kv_cache
        raise NoMemoryForKVCache(
            f"no device memory is left for the KV cache: {self.describe()}. Raise "
            f"--gpu-memory-utilization (now {self.utilization:.2f}; it caps the whole device, "
            "other processes included), free the device memory other processes hold, lower "
            "--max-num-batched-tokens (peak activation) or --max-num-seqs (sampler state, "
            "decode graphs), pass --enforce-eager (no graphs), or use more "
            "--tensor-parallel-size"
        )


def memory_budget(
    utilization: float,
    at_start: MemorySnapshot,
    profiled: MemorySnapshot,
    weights: int,
    peak_activation: int,
    graphs: int,
    sampler_state: int,
) -> MemoryBudget:
    """The budget from a snapshot taken before the worker loaded anything (``at_start``)
    and one after loading and profiling with every profiling tensor freed and torch's
    cache emptied (``profiled``). Memory outside torch counts at its larger reading, so
    a process that frees memory meanwhile never makes room that may come back."""
    return MemoryBudget(
        utilization=utilization,
        total=profiled.total,
        in_use_at_start=at_start.non_torch,
        non_torch_growth=max(0, profiled.non_torch - at_start.non_torch),
        weights=weights,
        peak_activation=peak_activation,
        graphs=graphs,
        sampler_state=sampler_state,
    )


def _size(num_bytes: int) -> str:
    """``1.25 GiB`` from 1 GiB up, ``312 MiB`` below (either sign)."""
    if abs(num_bytes) >= GiB:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / MiB:.0f} MiB"
