"""Network for environments, by allow-list only: :func:`connect` is the one way an environment reaches
a host, and in the sandbox it goes through a proxy on the host that admits only the allowed
``host:port`` pairs.

The sandbox has no network at all (an empty network namespace, and a seccomp filter that refuses every
socket but AF_UNIX). With ``SandboxOptions.allow_hosts`` set, a proxy thread on the host listens on a
Unix socket that the sandbox sees read-only at ``/opt/rlpipe/net/net.sock``; ``connect(host, port)``
sends ``host:port``, the proxy checks it against the allow-list (exact match, after nothing is
resolved inside the sandbox), connects, answers ``ok``, and relays bytes both ways until either side
closes. Anything not on the list is refused with the reason. Outside a sandbox (``agent.executor:
local``) ``connect`` is a plain TCP connection: the in-process pool trusts its environments.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Iterable

SOCKET: str | None = None  # set inside a sandbox whose options allow hosts
_MAX_LINE = 512


class NetworkRefused(ConnectionError):
    """The allow-list proxy refused a destination."""


def connect(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    """A connected stream to ``host:port``: through the allow-list proxy inside a sandbox, else direct."""
    if SOCKET is None:
        return socket.create_connection((host, port), timeout=timeout)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(SOCKET)
    s.sendall(f"{host}:{int(port)}\n".encode())
    reply = b""
    while not reply.endswith(b"\n") and len(reply) < _MAX_LINE:
        chunk = s.recv(1)
        if not chunk:
            break
        reply += chunk
    if reply != b"ok\n":
        s.close()
        raise NetworkRefused(reply.decode(errors="replace").strip() or "the network proxy closed the connection")
    return s


class AllowListProxy:
    """The host side: a Unix socket in a fresh folder, one relay thread pair per admitted connection."""

    def __init__(self, allow: Iterable[str]):
        self.allow = frozenset(a.strip().lower() for a in allow)
        self.dir = tempfile.mkdtemp(prefix="rlpipe-net-")
        os.chmod(self.dir, 0o755)
        self.path = os.path.join(self.dir, "net.sock")
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(self.path)
        os.chmod(self.path, 0o666)  # the sandbox's unprivileged uid connects
        self._srv.listen(64)
        self.admitted = self.refused = 0
        threading.Thread(target=self._serve, name="rlpipe-net-proxy", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            up = self._admit(conn)
        except OSError:
            up = None
        if up is None:
            conn.close()
            return
        conn.settimeout(None)
        up.settimeout(None)
        threading.Thread(target=_relay, args=(up, conn), daemon=True).start()
        _relay(conn, up)

    def _admit(self, conn: socket.socket) -> socket.socket | None:
        """Read the destination; connect to it if allowed (answering ok), else answer why not."""
        line = b""
        while not line.endswith(b"\n") and len(line) < _MAX_LINE:
            chunk = conn.recv(1)
            if not chunk:
                return None
            line += chunk
        dest = line.decode(errors="replace").strip().lower()
        host, _, port = dest.rpartition(":")
        if dest not in self.allow or not port.isdigit():
            self.refused += 1
            conn.sendall(f"refused: {dest[:100]!r} is not on the allow-list\n".encode())
            return None
        try:
            up = socket.create_connection((host, int(port)), timeout=10)
        except OSError as e:
            conn.sendall(f"refused: {dest} unreachable ({type(e).__name__}: {e})\n".encode())
            return None
        self.admitted += 1
        conn.sendall(b"ok\n")
        return up

    def close(self) -> None:
        self._srv.close()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


def _relay(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
