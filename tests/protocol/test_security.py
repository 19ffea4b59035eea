"""Who may reach an engine core (transport.py, `vtllm keygen`): separate server and client
key files, no client file holding the engine's secret, tcp:// without keys refused (loopback
only with its opt-in flag), owner-only ipc sockets and runtime dirs, stale runtime dirs of
dead processes removed; and the frame peek that answers an oversized message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from vtllm.cli import main as vtllm_main
from vtllm.engine_core.client_channel import frame_limit, peek_head
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m
from vtllm.protocol.transport import ClientKeys, ServerKeys


def _keygen(*args: str) -> None:
    assert vtllm_main(["keygen", *args]) == 0


def test_keygen_makes_separate_files_and_no_client_holds_the_server_secret(tmp_path: Path):
    server_file, client_file = tmp_path / "engine.key", tmp_path / "frontend.key"
    _keygen("server", "--out", str(server_file))
    _keygen("client", "--server", str(server_file), "--name", "fe", "--out", str(client_file))
    for path in (server_file, client_file):
        assert path.stat().st_mode & 0o777 == 0o600
    server, client = ServerKeys.load(server_file), ClientKeys.load(client_file)
    raw_client = client_file.read_text()
    assert server.secret.decode() not in raw_client  # the engine's secret stays on its host
    assert client.server_public == server.public and client.secret != server.secret
    assert server.clients == {"fe": client.public.decode()}
    assert server.client_name(client.public.decode()) == "fe"
    assert client.secret.decode() not in server_file.read_text()  # nor a client's in it
    with pytest.raises(ValueError, match="not a 'vtllm-engine-key'"):
        ServerKeys.load(client_file)  # each side refuses the other's file
    with pytest.raises(ValueError, match="not a 'vtllm-client-key'"):
        ClientKeys.load(server_file)
    with pytest.raises(SystemExit):  # never overwrites a key file
        vtllm_main(["keygen", "server", "--out", str(server_file)])


def test_old_shared_key_files_and_readable_key_files_are_refused(tmp_path: Path):
    old = tmp_path / "old.key"
    public, secret = zmq.curve_keypair()
    old.write_text(json.dumps({"public": public.decode(), "secret": secret.decode()}))
    old.chmod(0o600)
    with pytest.raises(ValueError, match="old shared key file"):
        ClientKeys.load(old)
    old.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        ServerKeys.load(old)


def test_an_allow_list_change_counts_without_a_restart(tmp_path: Path):
    server_file = tmp_path / "engine.key"
    _keygen("server", "--out", str(server_file))
    running = ServerKeys.load(server_file)  # what an engine core holds
    _keygen("client", "--server", str(server_file), "--name", "late", "--out", str(tmp_path / "c"))
    late = ClientKeys.load(tmp_path / "c").public.decode()
    os.utime(server_file, (0, 1))  # a distinct mtime even within the clock's resolution
    assert running.client_name(late) == "late"


@pytest.mark.parametrize(
    ("address", "allow", "refused"),
    [
        ("tcp://0.0.0.0:5555", False, "--engine-curve-key-file"),
        ("tcp://0.0.0.0:5555", True, "--engine-curve-key-file"),  # the flag is loopback only
        ("tcp://10.1.2.3:5555", True, "--engine-curve-key-file"),
        ("tcp://127.0.0.1:5555", False, "--engine-allow-insecure-loopback"),
        ("tcp://127.0.0.1:5555", True, None),
        ("ipc:///tmp/x.sock", False, None),
    ],
)
def test_tcp_without_keys(address: str, allow: bool, refused: str | None):
    if refused is None:
        transport.check_bind_security(address, None, allow_insecure_loopback=allow)
    else:
        with pytest.raises(PermissionError, match=refused):
            transport.check_bind_security(address, None, allow_insecure_loopback=allow)
    transport.check_bind_security(address, ServerKeys.generate())  # keys: always fine


def test_ipc_socket_at_an_explicit_path_is_owner_only(tmp_path: Path):
    previous_umask = os.umask(0o022)  # the usual umask makes sockets 0755
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        transport.bind(sock, f"ipc://{tmp_path}/explicit.sock")
        assert (tmp_path / "explicit.sock").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(previous_umask)
        sock.close(0)
        ctx.term()


def test_runtime_dirs_are_private_and_stale_ones_are_removed(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "vtllm-stale"
    stale.mkdir()
    (stale / "owner").write_text(f"{dead.pid} 1")
    (stale / "engine.sock").touch()
    reused = tmp_path / "vtllm-reused-pid"  # our pid, but another process's start time
    reused.mkdir()
    (reused / "owner").write_text(f"{os.getpid()} 1")
    foreign = tmp_path / "vtllm-no-owner-record"  # not ours to judge
    foreign.mkdir()
    live = transport.make_runtime_dir()
    try:
        assert live.stat().st_mode & 0o777 == 0o700
        assert not stale.exists() and not reused.exists() and foreign.exists()
        assert transport.remove_stale_runtime_dirs(tmp_path) == []  # the live one stays
        assert live.exists()
    finally:
        transport.remove_runtime_dir(live)


def test_peek_head_reads_the_tag_and_first_field_only():
    add = codec.encode(m.AddRequest("req-" + "x" * 300, [7] * 1000, m.SamplingParams()))
    assert peek_head(add) == ("add", "req-" + "x" * 300)
    util = codec.encode(m.UtilityRequest(70000, "get_stats"))
    assert peek_head(util) == ("util", 70000)
    assert peek_head(codec.encode(m.UtilityRequest(5, "x"))) == ("util", 5)
    assert peek_head(b"\xc0garbage") is None and peek_head(b"") is None
    assert peek_head(msgspec.msgpack.encode(["add"])) is None  # no first field


def test_default_frame_limit_holds_a_full_context_prompt():
    assert frame_limit(0, 512) == 4 * 2**20 and frame_limit(0, 1_000_000) == 16_000_000
    assert frame_limit(123, 1_000_000) == 123
    full = m.AddRequest("r", [2**31] * 1_000_000, m.SamplingParams())  # 5-byte ids
    assert len(codec.encode(full)) < frame_limit(0, 1_000_000)
