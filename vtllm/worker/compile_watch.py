"""Triton compiles in one worker: what start-up paid, and each one a serving step waits for.

The first launch of a kernel specialisation in a process compiles it (about a second) or
loads it from Triton's on-disk cache (milliseconds). Start-up (the dummy step, decode-graph
capture) meets most of them; a step that meets a new one (e.g. a mixed prefill+decode
batch of a shape class start-up did not run) waits for it, and that wait used to be
silent: on an H100 a fresh engine's first 256-prompt batch ran 14-16 % slower than the
next engine's on the same machine (docs/BENCHMARKS.md, session 39). Now start-up ends with
one line counting its compiles, and each compile after it is logged (INFO; a cache load,
DEBUG) with the kernel, its launch options and its specialisation (constexpr values, the
integer and pointer arguments Triton specialised as divisible by 16), so that the
start-up warm-up can be made to cover it, or the argument kept from specialising. Its
first GPU run named the culprits of that penalty: the attention kernel, specialised on the
step's sequence count and block-table stride; both now fixed (session 40: a cold first run
matches a warm one, and no benchmark engine logs a compile while serving).

``CompileWatch`` is the pure core (counts, lines); ``install`` hooks it into Triton's
compilation listener (Triton >= 3.4; older ones: nothing is watched, and ``install``
says so).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class CompileWatch:
    """Counts of compiles (and on-disk cache loads) before and after ``serving`` is set."""

    serving: bool = False
    startup_compiled: int = 0
    startup_compile_s: float = 0.0
    startup_loaded: int = 0
    serving_compiled: int = 0
    serving_compile_s: float = 0.0
    serving_loaded: int = 0

    def record(self, kernel: str, seconds: float, cache_hit: bool) -> str | None:
        """Count one compile (``cache_hit``: a load from the on-disk cache) of ``kernel``
        (a description) that took ``seconds``. Returns the line to log for one met while
        serving (INFO for a compile, DEBUG for a load), None during start-up."""
        if not self.serving:
            if cache_hit:
                self.startup_loaded += 1
            else:
                self.startup_compiled += 1
                self.startup_compile_s += seconds
            return None
        if cache_hit:
            self.serving_loaded += 1
            what = "loaded from Triton's cache"
        else:
            self.serving_compiled += 1
            self.serving_compile_s += seconds
            what = "compiled"
        return (
            f"a step waited {seconds:.2f}s while Triton {what} {kernel}: a specialisation "
            f"the start-up warm-up did not meet ({self.serving_compiled} compiles, "
            f"{self.serving_compile_s:.1f}s, and {self.serving_loaded} cache loads while "
            "serving so far)"
        )

    def startup_summary(self) -> str:
        """The start-up line: compiles and cache loads before serving."""
        return (
            f"Triton at start-up: {self.startup_compiled} kernel specialisations compiled "
            f"({self.startup_compile_s:.1f}s), {self.startup_loaded} loaded from the on-disk "
            "cache; any met later is logged as a step waits for it"
        )


def describe_specialisation(src: Any, metadata: dict[str, Any]) -> str:
    """``name[num_warps=.., num_stages=..](CONST=value, ..; div16: arg, ..)`` from Triton's
    compile source and metadata (never raises: a best effort, for a log line)."""
    try:
        names = list(getattr(src.fn, "arg_names", []))

        def arg_name(path: Any) -> str:  # Triton keys arguments by (index,) paths
            index = path[0] if isinstance(path, tuple) and path else path
            return names[index] if isinstance(index, int) and index < len(names) else str(path)

        constants = [
            f"{arg_name(path)}={value}"
            for path, value in sorted(getattr(src, "constants", {}).items())
        ]
        divisible = [
            arg_name(path)
            for path, attrs in sorted(getattr(src, "attrs", {}).items())
            if any("divisibility" in str(attr) for attr in attrs)
        ]
        options = f"num_warps={metadata.get('num_warps')}, num_stages={metadata.get('num_stages')}"
        body = ", ".join(constants) + (f"; div16: {', '.join(divisible)}" if divisible else "")
        return f"{metadata.get('name', src.name)}[{options}]({body})"[:1200]
    except Exception as e:  # noqa: BLE001 - a log line must not break a kernel launch
        return f"{getattr(src, 'name', '?')} ({type(e).__name__} describing it)"


def install(watch: CompileWatch) -> bool:
    """Hook ``watch`` into Triton's compilation listener (chaining any listener already
    set). False, with a DEBUG line, where this Triton has no such listener."""
    try:
        from triton import knobs
    except ImportError:
        logger.debug("compile watch off: this Triton has no triton.knobs (Triton < 3.4)")
        return False
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        logger.debug("compile watch off: this Triton has no compilation listener")
        return False
    previous = compilation.listener

    def listener(**kwargs: Any) -> None:  # Triton passes src, metadata, times, cache_hit, ...
        if previous is not None:
            previous(**kwargs)
        try:
            seconds = float(getattr(kwargs.get("times"), "total", 0)) / 1e6  # µs
            cache_hit = bool(kwargs.get("cache_hit"))
            kernel = describe_specialisation(kwargs.get("src"), kwargs.get("metadata") or {})
            line = watch.record(kernel, seconds, cache_hit)
            if line is not None:
                logger.log(logging.DEBUG if cache_hit else logging.INFO, "%s", line)
        except Exception:  # noqa: BLE001 - never fail a compile over its log line
            logger.debug("compile watch: could not record a compile", exc_info=True)

    compilation.listener = listener
    return True
