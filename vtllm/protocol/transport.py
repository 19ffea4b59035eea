"""Socket helpers shared by every process: addresses, runtime dirs, socket options, and
the security of the engine core's client endpoint (see docs/PROTOCOL.md, "Security").

Who may connect to an engine core:

* ``ipc://``: the socket file is mode 0600 (and the default one lives in a 0700 runtime
  directory), so only the same user.
* ``tcp://``: only CurveZMQ clients whose public key is in the engine's key file
  (``ServerKeys``, checked by a ZAP handler on every connection); traffic is encrypted.
  A loopback ``tcp://`` address without keys only with ``--engine-allow-insecure-loopback``
  (then any local user can connect); any other ``tcp://`` address without keys is refused.

Key files (``vtllm keygen``, JSON, mode 0600): the engine's holds its key pair and the
allow-list of client public keys; a client's holds its own key pair and the engine's
*public* key. No client file ever holds the engine's secret key.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq

# -- runtime directories and ipc sockets --------------------------------------------------

_RUNTIME_PREFIX = "vtllm-"
_OWNER_FILE = "owner"  # "<pid> <start time>" of the process that made the directory


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a live owner from a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(owner: str) -> bool:
    try:
        pid_text, started = owner.split()
        pid = int(pid_text)
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return _start_time(pid) in (started, None)


def runtime_parent() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base if base and os.access(base, os.W_OK) else tempfile.gettempdir())


def remove_stale_runtime_dirs(parent: Path | None = None) -> list[Path]:
    """Remove this user's ``vtllm-*`` runtime directories whose owner process is dead
    (a SIGKILLed ``serve`` or engine core). Returns what was removed."""
    parent = parent or runtime_parent()
    removed = []
    for path in parent.glob(f"{_RUNTIME_PREFIX}*"):
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            owner = (path / _OWNER_FILE).read_text()
        except OSError:
            continue  # no owner record (another tool's directory, or still being made)
        if not _owner_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_runtime_dir() -> Path:
    """A private directory (mode 0700) for ipc sockets: only this user can connect. Stale
    ones left by dead processes are removed first; this one records its owner process."""
    remove_stale_runtime_dirs()
    path = Path(tempfile.mkdtemp(prefix=_RUNTIME_PREFIX, dir=runtime_parent()))
    path.chmod(0o700)
    pid = os.getpid()
    (path / _OWNER_FILE).write_text(f"{pid} {_start_time(pid) or 0}")
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


def bind(sock: zmq.Socket, address: str) -> None:
    """Bind; an ``ipc://`` socket file becomes owner-only (0600), at any path."""
    sock.bind(address)
    path = ipc_path(address)
    if path is not None:
        path.chmod(0o600)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def configure(
    sock: zmq.Socket, *, identity: bytes | None = None, max_frame_bytes: int | None = None
) -> zmq.Socket:
    """Options every vtllm socket gets: no lingering on close, no silent drops on the
    way out, and a bounded incoming frame size: libzmq drops the connection of a peer
    that announces a longer frame, before allocating it."""
    from vtllm.protocol.codec import MAX_FRAME_BYTES

    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes or MAX_FRAME_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


# -- key files ------------------------------------------------------------------------

SERVER_KIND = "vtllm-engine-key"
CLIENT_KIND = "vtllm-client-key"


def _read_private(path: Path) -> dict:
    if path.stat().st_mode & 0o077:
        raise PermissionError(
            f"{path} is readable by other users; run chmod 600 {path} (it holds a secret key)"
        )
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not a vtllm key file: {e}") from None


def _write_private(path: Path, data: dict, *, replace: bool = False) -> None:
    """Write ``data`` as JSON, mode 0600 from the start (never readable by others)."""
    target = path
    if replace:
        path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    if replace:
        os.replace(path, target)


def _kind_error(path: Path, data: dict, expected: str) -> ValueError:
    kind = data.get("kind")
    if kind is None and "secret" in data:
        return ValueError(
            f"{path} is an old shared key file (it gave every client the engine's secret "
            "key); make new ones: `vtllm keygen server --out engine.key`, then "
            "`vtllm keygen client --server engine.key --out client.key` per client"
        )
    return ValueError(f"{path} holds a {kind!r} key, not a {expected!r} one")


@dataclass
class ServerKeys:
    """The engine core's key pair and the client public keys it admits (name → z85).

    ``path``: the file they came from; ``allows`` reads it again when it changed, so a
    client added or removed with ``vtllm keygen`` counts from its next connection."""

    public: bytes
    secret: bytes
    clients: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    _mtime: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def generate(cls) -> ServerKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def save(self, path: Path, *, replace: bool = False) -> None:
        data = {
            "kind": SERVER_KIND,
            "public": self.public.decode(),
            "secret": self.secret.decode(),
            "clients": self.clients,
        }
        _write_private(path, data, replace=replace)

    @classmethod
    def load(cls, path: str | Path) -> ServerKeys:
        path = Path(path)
        data = _read_private(path)
        if data.get("kind") != SERVER_KIND:
            raise _kind_error(path, data, SERVER_KIND)
        keys = cls(data["public"].encode(), data["secret"].encode(), dict(data["clients"]))
        keys.path, keys._mtime = path, path.stat().st_mtime
        return keys

    def allow(self, name: str, client_public: bytes) -> None:
        if name in self.clients:
            raise ValueError(f"a client named {name!r} is already allowed; pick another name")
        self.clients[name] = client_public.decode()

    def client_name(self, client_public: str) -> str | None:
        """The allow-list name of a z85 public key (None: not allowed)."""
        self._reload()
        with self._lock:
            for name, key in self.clients.items():
                if key == client_public:
                    return name
        return None

    def _reload(self) -> None:
        if self.path is None:
            return
        with contextlib.suppress(OSError, ValueError, KeyError):
            mtime = self.path.stat().st_mtime
            if mtime != self._mtime:
                fresh = ServerKeys.load(self.path)
                with self._lock:
                    self.clients, self._mtime = fresh.clients, mtime


@dataclass
class ClientKeys:
    """A client's key pair and the public key of the engine core it talks to."""

    public: bytes
    secret: bytes
    server_public: bytes
    name: str = ""

    @classmethod
    def generate(cls, server_public: bytes, name: str) -> ClientKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret, server_public, name)

    def save(self, path: Path) -> None:
        data = {
            "kind": CLIENT_KIND,
            "name": self.name,
            "public": self.public.decode(),
            "secret": self.secret.decode(),
            "server_public": self.server_public.decode(),
        }
        _write_private(path, data)

    @classmethod
    def load(cls, path: str | Path) -> ClientKeys:
        path = Path(path)
        data = _read_private(path)
        if data.get("kind") != CLIENT_KIND:
            raise _kind_error(path, data, CLIENT_KIND)
        return cls(
            data["public"].encode(),
            data["secret"].encode(),
            data["server_public"].encode(),
            data.get("name", ""),
        )


# -- endpoint security ----------------------------------------------------------------

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def tcp_host(address: str) -> str | None:
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://") :].rsplit(":", 1)[0]


def check_bind_security(
    address: str, keys: ServerKeys | None, *, allow_insecure_loopback: bool = False
) -> None:
    """Refuse to serve a ``tcp://`` address without CurveZMQ keys, unless it is loopback
    and the operator opted in (``--engine-allow-insecure-loopback``)."""
    host = tcp_host(address)
    if host is None or keys is not None:
        return
    if host not in LOOPBACK_HOSTS:
        raise PermissionError(
            f"refusing to bind {address} without CurveZMQ keys: anyone who can reach it "
            "could submit requests. Pass --engine-curve-key-file (make one with `vtllm "
            "keygen server --out engine.key`), or bind an ipc:// address"
        )
    if not allow_insecure_loopback:
        raise PermissionError(
            f"refusing to bind {address} without CurveZMQ keys: every local user could "
            "connect and submit requests (bypassing --api-key). Bind an ipc:// address "
            "(owner-only), pass --engine-curve-key-file (`vtllm keygen server --out "
            "engine.key`), or accept the risk with --engine-allow-insecure-loopback"
        )


def secure_server(sock: zmq.Socket, keys: ServerKeys | None):
    """Make ``sock`` a CurveZMQ server that admits only the clients in ``keys``'s
    allow-list; each admitted frame then carries the client's z85 public key as its
    ``User-Id`` property. Returns the ZAP authenticator thread (the caller stops it when
    closing), or None without keys."""
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    class _AllowList:
        def callback(self, domain: str, client_key: bytes) -> bool:
            return keys.client_name(client_key.decode()) is not None

    authenticator = ThreadAuthenticator(sock.context)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_AllowList())
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    return authenticator


def secure_client(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
