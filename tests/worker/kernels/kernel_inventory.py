"""Every Triton kernel vtllm ships: the ``_*_kernel`` functions of the modules in
``vtllm.worker.kernels``, found by walking the package, so that a new module's kernels
are covered by the interpreter and AOT checks without anyone listing them."""

from __future__ import annotations

import importlib
import pkgutil

import vtllm.worker.kernels


def kernel_functions() -> dict[str, object]:
    """``{name: kernel}`` (a JITFunction, or an InterpretedFunction under the interpreter)."""
    package = vtllm.worker.kernels
    kernels = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel"):
                kernels[name] = value
    return kernels
