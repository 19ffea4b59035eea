"""Every VT_* variable is read in vtllm/envs.py only, and documented in docs/ENVIRONMENT.md."""

from __future__ import annotations

import re
from pathlib import Path

from vtllm import envs

ROOT = Path(__file__).resolve().parents[1]


def test_every_variable_read_is_declared_in_envs():
    used = set()
    for path in (ROOT / "vtllm").rglob("*.py"):
        used |= set(re.findall(r"\bVT_[A-Z0-9_]+\b", path.read_text()))
    assert used <= set(envs.names()), sorted(used - set(envs.names()))


def test_os_environ_vt_reads_only_in_envs():
    offenders = []
    for path in (ROOT / "vtllm").rglob("*.py"):
        if path.name == "envs.py":
            continue
        if re.search(r"(environ|getenv)\S*\(?\s*[\[(]?\s*['\"]VT_", path.read_text()):
            offenders.append(str(path))
    assert not offenders, offenders


def test_every_variable_is_documented():
    doc = (ROOT / "docs" / "ENVIRONMENT.md").read_text()
    documented = set(re.findall(r"^\|\s*`(VT_[A-Z0-9_]+)`", doc, flags=re.M))
    assert set(envs.names()) == documented, (
        f"undocumented: {sorted(set(envs.names()) - documented)}, "
        f"documented but unknown: {sorted(documented - set(envs.names()))}"
    )


def test_durations_accept_units(monkeypatch):
    monkeypatch.setenv("VT_SSE_KEEPALIVE_S", "500ms")
    monkeypatch.setenv("VT_ENGINE_STEP_LOG", "2m")
    assert envs.VT_SSE_KEEPALIVE_S == 0.5
    assert envs.VT_ENGINE_STEP_LOG == 120.0
    monkeypatch.setenv("VT_HEARTBEAT_TIMEOUT_S", "soon")
    import pytest

    with pytest.raises(ValueError, match="VT_HEARTBEAT_TIMEOUT_S"):
        _ = envs.VT_HEARTBEAT_TIMEOUT_S
