"""Start-up mistakes are one line on stderr and exit 2, never a traceback: a model missing
offline, a bad path, an unknown architecture, a --max-model-len above the model's context,
a taken port (reported within a second, before any model work). Models by Hugging Face
name resolve from a pre-populated hub cache with HF_HUB_OFFLINE=1 (no network)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.server import free_port
from tests.hf_cache import COMMIT, populate_hf_cache
from vtllm.hub import ModelNotFound, looks_like_repo_id, resolve_model_name
from vtllm.startup import SUPPORTED_ARCHITECTURES, StartupError, check_model_config


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "vtllm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return result, time.monotonic() - started


def assert_one_line_exit_2(result) -> str:
    err = result.stderr.strip()
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory, smollm2_dir) -> Path:
    cache = tmp_path_factory.mktemp("hf-cache")
    populate_hf_cache(cache, "testorg/smollm2", smollm2_dir)
    return cache


def test_repo_id_shapes():
    assert looks_like_repo_id("Qwen/Qwen3-0.6B")
    assert looks_like_repo_id("meta-llama/Llama-3.1-8B-Instruct")
    for not_id in ("/models/x", "./a/b", "~/m/x", "a/b/c", "model.gguf", "org/x.gguf", "x"):
        assert not looks_like_repo_id(not_id), not_id


def test_offline_hub_cache_resolves(hf_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = Path(resolve_model_name("testorg/smollm2", None, str(hf_cache)))
    assert snapshot == hf_cache / "models--testorg--smollm2" / "snapshots" / COMMIT
    assert (snapshot / "config.json").is_file() and (snapshot / "tokenizer.json").is_file()
    assert resolve_model_name("testorg/smollm2", COMMIT, str(hf_cache)) == str(snapshot)
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE"):
        resolve_model_name("testorg/smollm2", "v9", str(hf_cache))
    with pytest.raises(ModelNotFound, match="'testorg/absent' is not in"):
        resolve_model_name("testorg/absent", None, str(hf_cache))
    # an existing local path is never looked up on the hub
    assert resolve_model_name(str(snapshot), None, str(hf_cache)) == str(snapshot)


def test_supported_architectures_match_the_worker_registry():
    from vtllm.worker.models import _MODELS

    assert set(SUPPORTED_ARCHITECTURES) == set(_MODELS)


def test_max_model_len_above_context(monkeypatch):
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192}
    check_model_config(config, "m", 8192)
    monkeypatch.delenv("VT_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(StartupError, match="VT_ALLOW_LONG_MAX_MODEL_LEN"):
        check_model_config(config, "m", 16384)
    monkeypatch.setenv("VT_ALLOW_LONG_MAX_MODEL_LEN", "1")
    check_model_config(config, "m", 16384)
    nested = {
        "architectures": ["Gemma3ForCausalLM"],
        "text_config": {"max_position_embeddings": 32},
    }
    monkeypatch.delenv("VT_ALLOW_LONG_MAX_MODEL_LEN")
    with pytest.raises(StartupError, match="context of 32 tokens"):
        check_model_config(nested, "m", 64)


def test_cli_mistakes_are_one_line_exit_2(hf_cache, smollm2_dir, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1"}
    port = str(free_port())
    result, _ = run_cli(
        "serve", "testorg/absent", "--download-dir", str(hf_cache), "--port", port, env=offline
    )
    assert "testorg/absent" in assert_one_line_exit_2(result)

    result, _ = run_cli("serve", "/no/such/model/dir", "--port", port)
    assert "/no/such/model/dir" in assert_one_line_exit_2(result)

    alien = tmp_path / "alien"
    shutil.copytree(smollm2_dir, alien, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(
        json.dumps({**config, "architectures": ["FalconForCausalLM"]})
    )
    (alien / "model.safetensors").symlink_to(Path(smollm2_dir) / "model.safetensors")
    result, _ = run_cli("serve", str(alien), "--port", port)
    assert "'FalconForCausalLM' is not supported" in assert_one_line_exit_2(result)

    context = json.loads((Path(smollm2_dir) / "config.json").read_text())["max_position_embeddings"]
    result, _ = run_cli(
        "serve", "testorg/smollm2", "--download-dir", str(hf_cache), "--port", port,
        "--max-model-len", str(2 * context), env=offline,
    )  # fmt: skip
    err = assert_one_line_exit_2(result)
    assert f"context of {context} tokens" in err and "VT_ALLOW_LONG_MAX_MODEL_LEN" in err


def test_taken_port_reported_within_a_second():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, elapsed = run_cli("serve", "--port", str(port))
    assert f"port {port} on 127.0.0.1 is already in use" in assert_one_line_exit_2(result)
    assert elapsed < 2.0, f"{elapsed:.2f}s (interpreter start included; loading takes far longer)"


def test_api_server_sockets_share_one_port_and_refuse_a_taken_one():
    from vtllm.startup import bind_http_sockets

    sockets = bind_http_sockets("127.0.0.1", 0, 3)  # port 0: the system's choice, for all
    try:
        ports = {s.getsockname()[1] for s in sockets}
        assert len(sockets) == 3 and len(ports) == 1
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in sockets)
        for s in sockets:
            s.listen()
        # a server that shares its port is still "in use" for another vtllm serve
        with pytest.raises(StartupError, match="already in use"):
            bind_http_sockets("127.0.0.1", ports.pop(), 2)
    finally:
        for s in sockets:
            s.close()
