"""Process boundary = import boundary: the frontend, the engine core and the protocol load
no torch; frontend / engine_core / worker never import each other; torch.cuda is touched
only in worker/platform.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vtllm"


@pytest.mark.parametrize(
    "module",
    [
        "vtllm.protocol.messages",
        "vtllm.protocol.codec",
        "vtllm.protocol.transport",
        "vtllm.engine_core.core_proc",
        "vtllm.engine_core.executor",
        "vtllm.frontend.app",
        "vtllm.launch",
        "vtllm.cli",
        "vtllm.worker.loader.gguf_convert",
    ],
)
def test_module_loads_no_torch(module):
    code = f"import sys, {module}; bad = [m for m in ('torch', 'triton') if m in sys.modules]; assert not bad, bad"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def _imports(path: Path) -> set[str]:
    found = set()
    for line in path.read_text().splitlines():
        match = re.match(r"\s*(?:from|import)\s+(vtllm\.\w+)", line)
        if match:
            found.add(match.group(1))
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("frontend", {"vtllm.engine_core", "vtllm.worker"}),
        ("engine_core", {"vtllm.frontend", "vtllm.worker"}),
        ("worker", {"vtllm.frontend", "vtllm.engine_core"}),
        ("protocol", {"vtllm.frontend", "vtllm.engine_core", "vtllm.worker"}),
    ],
)
def test_packages_share_only_protocol(package, forbidden):
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & forbidden)
        for path in (PACKAGE / package).rglob("*.py")
        if _imports(path) & forbidden
    }
    assert not offenders, offenders


VENDOR_ONLY = re.compile(
    r"torch\.cuda\b|torch\.version\.(cuda|hip)\b|torch\.backends\.(cuda|cudnn)\b"
    r"|\bimport (pycuda|cupy|hip)\b|\bnvml\b|\bamdsmi\b"
)


def test_vendor_apis_only_in_platform():
    """CUDA vs ROCm vs CPU is decided in worker/platform.py alone."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if path.name != "platform.py" and VENDOR_ONLY.search(path.read_text())
    ]
    assert not offenders, offenders
