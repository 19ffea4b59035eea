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


# -- security: CurveZMQ for tcp:// endpoints --------------------------------------------

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


class CurveKeys:
    """One CurveZMQ key pair shared by an engine core and its authorised clients: the
    engine serves with it, clients authenticate with it, and the engine admits only
    clients presenting its public key (anyone without the file cannot connect)."""

    def __init__(self, public: bytes, secret: bytes) -> None:
        self.public = public
        self.secret = secret

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def save(self, path: Path) -> None:
        import json

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"public": self.public.decode(), "secret": self.secret.decode()}, f)

    @classmethod
    def load(cls, path: str | Path) -> CurveKeys:
        import json

        path = Path(path)
        if path.stat().st_mode & 0o077:
            raise PermissionError(
                f"{path} is readable by other users; run chmod 600 {path} (it holds a secret key)"
            )
        data = json.loads(path.read_text())
        return cls(data["public"].encode(), data["secret"].encode())


def tcp_host(address: str) -> str | None:
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://") :].rsplit(":", 1)[0]


def check_bind_security(address: str, keys: CurveKeys | None) -> None:
    """Refuse to expose the engine on a non-loopback TCP address without CurveZMQ."""
    host = tcp_host(address)
    if host is not None and host not in LOOPBACK_HOSTS and keys is None:
        raise PermissionError(
            f"refusing to bind {address} without encryption: anyone who can reach it could "
            "submit requests. Pass --engine-curve-key-file (make one with `vtllm keygen "
            "--out FILE`), or bind ipc:// or a loopback tcp:// address."
        )


def secure_server(sock: zmq.Socket, keys: CurveKeys | None):
    """Make ``sock`` a CurveZMQ server that admits only holders of ``keys``. Returns the
    ZAP authenticator thread (the caller stops it when closing), or None without keys."""
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    class _OnlyOurKey:
        def callback(self, domain: str, client_key: bytes) -> bool:
            return client_key == keys.public

    authenticator = ThreadAuthenticator(zmq.Context.instance())
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_OnlyOurKey())
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    return authenticator


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is None:
        return
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
