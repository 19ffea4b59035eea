"""This process's host memory while it loads weights: resident set before, and its peak.

On Linux the peak is the kernel's own high-water mark ``VmHWM`` (``/proc/self/status``),
reset at the start of the window by writing ``5`` to ``/proc/self/clear_refs``, so it covers
the window alone. Where that reset is refused (or there is no ``/proc``), the peak is
``getrusage().ru_maxrss``: the whole process lifetime's peak, an upper bound; ``source``
says which one a figure is.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class HostPeak:
    """Resident set (bytes) when a window opened, and its peak within the window."""

    before_bytes: int
    peak_bytes: int
    source: str  # "VmHWM" (reset when the window opened) or "ru_maxrss" (process lifetime)

    @property
    def extra_bytes(self) -> int:
        """How far the peak rose above the resident set at the start."""
        return max(0, self.peak_bytes - self.before_bytes)

    def describe(self) -> str:
        """``host RSS peak 1.23 GiB while loading (+456 MiB over 0.79 GiB before; VmHWM
        reset at the start)``, or ``...; ru_maxrss, the process lifetime's peak)``."""
        how = (
            "VmHWM reset at the start"
            if self.source == "VmHWM"
            else "ru_maxrss, the process lifetime's peak"
        )
        return (
            f"host RSS peak {self.peak_bytes / 2**30:.2f} GiB while loading "
            f"(+{self.extra_bytes / 2**20:.0f} MiB over {self.before_bytes / 2**30:.2f} GiB "
            f"before; {how})"
        )


class HostPeakWindow:
    """Opens on construction (resets the kernel's peak where it can); ``close()`` reads
    the peak. Not nestable: a window opened inside another resets the outer one's peak."""

    def __init__(self) -> None:
        self.source = "VmHWM" if _reset_peak() else "ru_maxrss"
        self.before_bytes = _status_bytes("VmRSS") or 0

    def close(self) -> HostPeak:
        peak = _status_bytes("VmHWM") if self.source == "VmHWM" else _ru_maxrss_bytes()
        return HostPeak(self.before_bytes, max(peak or 0, self.before_bytes), self.source)


def current_rss_bytes() -> int | None:
    """Resident set now (``VmRSS``), None without ``/proc``."""
    return _status_bytes("VmRSS")


def _reset_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


def _status_bytes(field: str) -> int | None:
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # "VmHWM:    123456 kB"
    return None


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS
