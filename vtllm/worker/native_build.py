"""The native CPU kernels (``worker/native/cpu_kernels.c`` and the headers beside it:
``attention.h``, ``simd.h``): built at first use with the system's C compiler, cached,
loaded through ctypes.

``cc -O3 -march=native -fopenmp`` (the compiler ``torch.compile`` needs anyway). The
library is cached under ``VT_CACHE_DIR/native`` by a hash of the sources, the flags and
the CPU's flags (``-march=native``: a cache directory shared between machines must not
hand one CPU's build to another), written atomically so concurrent workers see all or
nothing. Its OpenMP runtime is torch's own: torch's wheels ship ``libgomp.so.1`` under
that soname and load it first, so the dynamic linker hands the kernels the same runtime,
threads and thread count (``torch.set_num_threads``).

``library()`` is None where there is no compiler or the build fails (logged once); each
caller then runs its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from vtllm import envs
from vtllm.worker.cpu_precision import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "cpu_kernels.c"
HEADERS = ("attention.h", "simd.h")  # included by SOURCE, part of the cache key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_state: dict[str, ctypes.CDLL | None] = {}


def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernels built (or found in the cache) with ``FLAGS`` and ``extra_flags`` (e.g.
    ``-mno-avx2`` for the plain-C paths, in tests); None without a compiler or when the
    build fails (logged). ``library()`` keeps the default build loaded."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler: the native CPU kernels are off (torch paths instead)")
        return None
    source_text = "".join((SOURCE.parent / name).read_text() for name in (SOURCE.name, *HEADERS))
    cpu = " ".join(sorted(cpu_flags()))
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256((source_text + " ".join(flags) + cpu).encode()).hexdigest()[:16]
    directory = envs.VT_CACHE_DIR / "native"
    library = directory / f"cpu_kernels_{key}.so"
    if not library.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / library.name
            result = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode != 0:
                logger.warning(
                    "building the native CPU kernels failed (torch paths instead): %s",
                    result.stderr.strip().splitlines()[-1:] or result.returncode,
                )
                return None
            os.replace(built, library)
    return ctypes.CDLL(str(library))


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None where they cannot be built."""
    if "lib" not in _state:
        try:
            _state["lib"] = build()
        except (OSError, subprocess.SubprocessError) as e:
            logger.warning("the native CPU kernels are unavailable (%s): torch paths", e)
            _state["lib"] = None
    return _state["lib"]
