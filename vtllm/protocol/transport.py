"""Socket helpers shared by every process: addresses, runtime dirs, socket options."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import zmq


def make_runtime_dir() -> Path:
    """A private directory (mode 0700) for ipc sockets: only this user can connect."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    parent = base if base and os.access(base, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="vtllm-", dir=parent))
    path.chmod(0o700)
    return path


def remove_runtime_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ipc_address(runtime_dir: Path, name: str) -> str:
    return f"ipc://{runtime_dir / name}"


def ipc_path(address: str) -> Path | None:
    return Path(address[len("ipc://") :]) if address.startswith("ipc://") else None


def unlink_ipc(address: str) -> None:
    """Remove the socket file of an ``ipc://`` address (no stale sockets after exit)."""
    path = ipc_path(address)
    if path is not None:
        path.unlink(missing_ok=True)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def configure(sock: zmq.Socket, *, identity: bytes | None = None) -> zmq.Socket:
    """Options every vtllm socket gets: no lingering on close, no silent drops on the
    way out, and a bounded incoming frame size (garbage peers cannot exhaust memory)."""
    from vtllm.protocol.codec import MAX_FRAME_BYTES

    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock
