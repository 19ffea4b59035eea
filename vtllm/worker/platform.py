"""The one place in vtllm that knows which accelerator it runs on.

CUDA, ROCm (a CUDA build of torch with ``torch.version.hip`` set) and CPU differ in
device strings, the ``torch.distributed`` backend, the default dtype and how memory is
queried. Everything else in vtllm asks this module and never calls ``torch.cuda.*``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# A kernel chosen by timing at start-up (``graph_us``) replaces the default only where it
# takes under this share of the default's time: graph-timed noise is ~1-2 %, and a near
# tie is not worth a second code path.
TIMED_WIN = 0.95


class PlatformKind(enum.Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of device memory, in bytes. ``total`` and ``free`` are the device's,
    every process on it counted; ``torch_*`` are this process's caching allocator."""

    total: int
    free: int
    torch_reserved: int  # held by the caching allocator (live tensors + its cache)
    torch_allocated: int  # live tensors
    torch_peak_allocated: int  # most live tensors since the last ``reset_peak_memory``

    @property
    def non_torch(self) -> int:
        """Device memory in use that this process's torch does not hold: other processes,
        this process's CUDA/HIP context, NCCL/RCCL buffers, loaded kernels, library
        workspaces."""
        return max(0, self.total - self.free - self.torch_reserved)


@dataclass(frozen=True)
class Platform:
    """What the worker of one rank runs on. Build it with ``detect_platform(rank)``."""

    kind: PlatformKind
    device: torch.device

    @property
    def is_gpu(self) -> bool:
        return self.kind is not PlatformKind.CPU

    @property
    def dist_backend(self) -> str:
        """``nccl`` on CUDA and ROCm (RCCL answers to the same name), ``gloo`` on CPU."""
        return "nccl" if self.is_gpu else "gloo"

    def resolve_dtype(self, name: str) -> torch.dtype:
        """``--dtype`` → torch dtype. ``auto`` is bfloat16 on GPU and float32 on CPU."""
        if name == "auto":
            return torch.bfloat16 if self.is_gpu else torch.float32
        if name not in _DTYPES:
            raise ValueError(
                f"--dtype {name!r} is not supported; use auto, float32, float16 or bfloat16"
            )
        return _DTYPES[name]

    def set_device(self) -> None:
        if self.is_gpu:
            torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        if self.is_gpu:
            torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        if self.is_gpu:
            torch.cuda.empty_cache()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory. On CPU: available and total RAM."""
        if self.is_gpu:
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free), int(total)
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")

    def memory_snapshot(self) -> MemorySnapshot:
        """Device and torch memory now (after a synchronize, so pending frees count).
        On CPU: available and total RAM, torch numbers 0 (not tracked)."""
        if not self.is_gpu:
            free, total = self.memory_info()
            return MemorySnapshot(total, free, 0, 0, 0)
        torch.cuda.synchronize(self.device)
        free, total = self.memory_info()
        return MemorySnapshot(
            total=total,
            free=free,
            torch_reserved=int(torch.cuda.memory_reserved(self.device)),
            torch_allocated=int(torch.cuda.memory_allocated(self.device)),
            torch_peak_allocated=int(torch.cuda.max_memory_allocated(self.device)),
        )

    def reset_peak_memory(self) -> None:
        if self.is_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_allocated(self) -> int:
        if self.is_gpu:
            return int(torch.cuda.memory_allocated(self.device))
        return 0

    @property
    def supports_graphs(self) -> bool:
        """CUDA graphs on NVIDIA, HIP graphs on ROCm (same torch API); none on CPU."""
        return self.is_gpu

    @property
    def pin_memory(self) -> bool:
        """Whether host staging buffers should be page-locked (fast async copies)."""
        return self.is_gpu

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The e4m3 FP8 format of this device's hardware: ``float8_e4m3fnuz`` on MI300
        (gfx94x: bias 8, no negative zero, max 240), OCP ``float8_e4m3fn`` elsewhere
        (NVIDIA, RDNA4 gfx12, MI350 gfx950, CPU; max 448). Checkpoints are e4m3fn."""
        return fp8_e4m3_dtype_for(self.kind, self._rocm_arch)

    @property
    def _rocm_arch(self) -> str:
        """The AMD GPU's architecture name (``gfx942``, ...); "" off ROCm."""
        if self.kind is not PlatformKind.ROCM:
            return ""
        return torch.cuda.get_device_properties(self.device).gcnArchName

    @property
    def has_fp8_scaled_mm(self) -> bool:
        """Whether ``torch._scaled_mm`` with row-wise scales runs here: NVIDIA compute
        capability 8.9+ (Ada, Hopper and later). ROCm is left to the Triton FP8 kernels
        (untested on ROCm hardware)."""
        if self.kind is not PlatformKind.CUDA:
            return False
        return torch.cuda.get_device_capability(self.device) >= (8, 9)

    @property
    def has_fp8_dot(self) -> bool:
        """Whether Triton's ``tl.dot`` multiplies e4m3 by e4m3 on the tensor cores here:
        NVIDIA compute capability 8.9+, MI300 / MI350 (gfx942 / gfx950 MFMA). Elsewhere
        Triton upcasts fp8 operands, which saves nothing."""
        if self.kind is PlatformKind.CUDA:
            return torch.cuda.get_device_capability(self.device) >= (8, 9)
        return self._rocm_arch.startswith(("gfx942", "gfx950"))

    @property
    def has_programmatic_dependent_launch(self) -> bool:
        """Whether kernels may be launched with programmatic dependent launch
        (``griddepcontrol``): NVIDIA compute capability 9.0+ (Hopper and later)."""
        if self.kind is not PlatformKind.CUDA:
            return False
        return torch.cuda.get_device_capability(self.device) >= (9, 0)

    def record_event(self) -> Any | None:
        """An event recorded now on the current stream (``query()`` is True once the work
        queued before it is done, ``synchronize()`` waits for it); None on CPU, where that
        work is done when the call that queued it returns."""
        if not self.is_gpu:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a device graph (no host syncs then)."""
        return self.is_gpu and torch.cuda.is_current_stream_capturing()

    def new_graph_pool(self) -> Any:
        """A memory pool that several graphs captured one after another can share."""
        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capture_graph(self, pool: Any) -> Iterator[Any]:
        """Capture the device work issued inside the block into a graph (yielded; call
        ``replay()`` on it), allocating its intermediates from ``pool``."""
        if not self.supports_graphs:
            raise RuntimeError(f"{self.kind.value} has no device graphs")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            yield graph

    def graph_us(self, fn: Any, calls: int = 20, replays: int = 20) -> float:
        """Microseconds per ``fn(i)`` call, from a device graph of calls ``i = 0 ..
        calls-1`` (no launch cost, as in a decode graph) replayed ``replays`` times;
        ``fn(0)`` runs once first, outside the capture (compiles, warms up). ``fn`` picks
        its operands by ``i`` so that a replay does not find them in L2."""
        fn(0)
        with self.capture_graph(self.new_graph_pool()) as graph:
            for i in range(calls):
                fn(i)
        graph.replay()
        self.synchronize()
        started = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        self.synchronize()
        return (time.perf_counter() - started) / (calls * replays) * 1e6

    def new_generator(self, seed: int) -> torch.Generator:
        """A random generator on this device, seeded once."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator


def fp8_e4m3_dtype_for(kind: PlatformKind, gcn_arch: str = "") -> torch.dtype:
    """``float8_e4m3fnuz`` (bias 8, max 240) on ROCm gfx940-942 (MI300: the only e4m3 its
    hardware converts), else the OCP ``float8_e4m3fn`` (max 448): NVIDIA, ROCm gfx950 and
    gfx12 (RDNA4), and CPU. ``gcn_arch`` as ROCm names it (``gfx942:sramecc+:xnack-``)."""
    if kind is PlatformKind.ROCM and gcn_arch.startswith("gfx94"):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def detect_platform(local_rank: int = 0) -> Platform:
    """The platform of this process: GPU ``local_rank`` when one is visible, else CPU."""
    if torch.cuda.is_available():
        kind = PlatformKind.ROCM if torch.version.hip else PlatformKind.CUDA
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"rank {local_rank} needs GPU {local_rank} but only {count} are visible; "
                "lower --tensor-parallel-size or expose more GPUs"
            )
        return Platform(kind, torch.device("cuda", local_rank))
    return Platform(PlatformKind.CPU, torch.device("cpu"))


def platform_of(device: torch.device) -> Platform:
    """The platform a tensor's ``device`` belongs to (no device query on CPU)."""
    if device.type == "cpu":
        return cpu_platform()
    kind = PlatformKind.ROCM if torch.version.hip else PlatformKind.CUDA
    return Platform(kind, device)


def cpu_platform() -> Platform:
    return Platform(PlatformKind.CPU, torch.device("cpu"))
