"""deploy/vtllm.service is a valid unit (systemd-analyze verify), with the settings a
GPU inference service needs, and deploy/vtllm.env documents every VT_* variable."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vtllm import envs
from vtllm.config import VtllmConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _unit() -> str:
    return (DEPLOY / "vtllm.service").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs Debian's systemd")
def test_unit_verifies(tmp_path):
    vtllm = Path(sys.executable).with_name("vtllm")
    assert vtllm.exists(), "install vtllm (make install) first"
    unit = (
        _unit()
        .replace("/opt/vtllm/.venv/bin/vtllm", str(vtllm))
        .replace("/etc/vtllm/vtllm.env", str(DEPLOY / "vtllm.env"))
        .replace("WorkingDirectory=/opt/vtllm", f"WorkingDirectory={tmp_path}")
    )
    path = tmp_path / "vtllm.service"
    path.write_text(unit)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vtllm.service" not in result.stderr, result.stderr  # no warnings about our unit


def test_unit_settings():
    unit = _unit()
    for setting in (
        "Restart=on-failure",
        "KillMode=mixed",  # SIGTERM to vtllm serve only; it stops its children itself
        "KillSignal=SIGTERM",
        "TimeoutStopSec=",
        "EnvironmentFile=",
        "ExecStart=/opt/vtllm/.venv/bin/vtllm serve",
    ):
        assert setting in unit, setting
    # systemd must not SIGKILL a drain that --shutdown-timeout allows
    stop_timeout = int(unit.split("TimeoutStopSec=", 1)[1].split()[0])
    assert stop_timeout >= VtllmConfig().engine.shutdown_timeout + 15, stop_timeout
    # hardening that would hide GPU device nodes must not be there
    for forbidden in ("PrivateDevices=true", "DevicePolicy=closed", "DevicePolicy=strict"):
        assert forbidden not in unit


def test_env_file_documents_devices_and_variables():
    env = (DEPLOY / "vtllm.env").read_text()
    assert "CUDA_VISIBLE_DEVICES" in env and "HIP_VISIBLE_DEVICES" in env
    for name in envs.names():
        if not name.startswith("VT_TEST_"):
            assert name in env, f"{name} missing from deploy/vtllm.env"
