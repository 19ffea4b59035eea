"""Kernel tests: compiled on a GPU, run by Triton's interpreter on CPU.

Triton (3.9) picks interpreter or compiler when ``@triton.jit`` decorates a function
(``runtime/jit.py::jit`` reads ``TRITON_INTERPRET`` then). That happens for our kernels
when their modules are imported, but also for triton's own library (``tl.sum``,
``tl.max``, ``tl.sigmoid``, ...) when ``triton.language`` is first imported; a kernel
interpreted with a compiled ``tl.sum`` fails ("Cannot call @triton.jit'd outside of the
scope of a kernel"). So:

* this conftest sets ``TRITON_INTERPRET=1`` on CPU before anything here imports triton,
  and reloads any ``vtllm.worker.kernels`` module imported before it;
* if another test module of the session imported triton first, triton's library is
  compiled-mode for good: the kernel tests here are then skipped in this process and
  ``test_interpret_mode.py::test_kernel_tests_in_a_fresh_process`` runs this whole
  directory in a fresh pytest process with the flag set from the start.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from vtllm.worker.platform import detect_platform

ON_GPU = detect_platform().is_gpu
HERE = Path(__file__).resolve().parent
FRESH_PROCESS_TEST = "test_kernel_tests_in_a_fresh_process"

if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for _name in sorted(m for m in sys.modules if m.startswith("vtllm.worker.kernels.")):
        importlib.reload(sys.modules[_name])


def interpreter_ready() -> bool:
    """Whether triton's own library was decorated for the interpreter (CPU only)."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


NEEDS_FRESH_PROCESS = not ON_GPU and not interpreter_ready()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not NEEDS_FRESH_PROCESS:
        return
    skip = pytest.mark.skip(
        reason="triton was imported before TRITON_INTERPRET=1 was set; these tests run "
        f"in {FRESH_PROCESS_TEST} instead"
    )
    for item in items:
        if HERE in Path(item.path).parents and item.name != FRESH_PROCESS_TEST:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """Where the kernel tests run: the GPU when there is one, else CPU (interpreter)."""
    return detect_platform().device


@pytest.fixture
def generator() -> torch.Generator:
    """A CPU generator with a fixed seed; tensors are drawn on CPU, then moved."""
    return torch.Generator().manual_seed(0)
