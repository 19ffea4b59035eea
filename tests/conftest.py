"""Shared fixtures: one converted copy of the embedded model per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Servers and workers the tests start serve CPU decode steps eagerly: compiling them
# (worker/cpu_compile.py) costs each start-up seconds to a minute. test_cpu_compile.py
# turns it on where it is under test.
os.environ.setdefault("VT_CPU_COMPILE", "off")
# ... and prefill float32 models in float32 whatever the CPU (worker/cpu_precision.py), so
# that comparisons with transformers keep float32 tolerances on AVX-512 BF16 / AMX CI
# machines too. test_cpu_precision.py turns it on where it is under test.
os.environ.setdefault("VT_CPU_BF16_PREFILL", "off")

# `make test` runs the suite in pytest-xdist workers (one a core). Each worker, and every
# server or worker process its tests start, then gets its share of the cores: N workers each
# running torch with as many threads as the machine has cores would oversubscribe them
# (OpenMP threads spin-wait for each other). Set here, before anything imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("VT_CPU_THREADS", str(_share))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

# Modules that share one expensive entry of the session cache (``vt_cache_dir``) run on one
# xdist worker, so that it is built once: both Gemma 3 modules use the converted Gemma 3
# 270M GGUF.
XDIST_SCOPES = {
    "tests/e2e/test_gemma3.py": "gemma3",
    "tests/worker/test_gemma3_gguf.py": "gemma3",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every ``gpu``-marked test skips on a machine without a CUDA or ROCm GPU, so that
    ``pytest -m gpu`` on CPU reports skips instead of running H200-sized tests on the host."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from vtllm.worker.platform import detect_platform

    if detect_platform().is_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook; a run without xdist ignores it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadscope`` by module (``XDIST_SCOPES`` joins some): a module's tests run on
    one worker, so its module-scoped server starts once, as in a serial run.

    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but xdist 3.8 tags
    the groups onto ``item._nodeid``, which pytest 9.2 no longer reads: every test became
    its own unit.)
    """
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return XDIST_SCOPES.get(module, module)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def vt_cache_dir(tmp_path_factory) -> Path:
    """A VT_CACHE_DIR for the whole session (the embedded GGUF is converted once).

    Set VT_TEST_CACHE_DIR to reuse a conversion across runs while developing.
    """
    reuse = os.environ.get("VT_TEST_CACHE_DIR")
    return Path(reuse) if reuse else tmp_path_factory.mktemp("vt-cache")


@pytest.fixture(scope="session")
def smollm2_dir(vt_cache_dir) -> Path:
    from vtllm.worker.loader.gguf_convert import resolve_model_dir

    return resolve_model_dir(None, vt_cache_dir)
