"""Shared fixtures: one converted copy of the embedded model per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Servers and workers the tests start serve CPU decode steps eagerly: compiling them
# (worker/cpu_compile.py) costs each start-up seconds to a minute. test_cpu_compile.py
# turns it on where it is under test.
os.environ.setdefault("VT_CPU_COMPILE", "off")


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
