"""The embedded server: one per data directory, found again by every later caller and process.

Each test starts its own valkey-server in a temporary directory and stops it at the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis

from redis_session import Entry, NewEntry, RedisSessionStore, SessionHead, SessionHeader
from redis_session.redis.embedded import (
    ServerProcess,
    _alive,
    ensure_server,
    free_port,
    ping,
    running_server,
    stop_server,
)

_ENSURE = (
    "import json, sys\n"
    "from redis_session.redis.embedded import ensure_server\n"
    "s = ensure_server(sys.argv[1])\n"
    "print(json.dumps([s.port, s.pid]))\n"
)


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "rs-data"
    try:
        yield d
    finally:
        stop_server(d)


def ensure_in_subprocess(d: Path, k: int = 1) -> list[tuple[int, int]]:
    """`ensure_server(d)` in `k` fresh Python processes at once; their (port, pid) answers."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _ENSURE, str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(k)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr.decode()
        port, pid = json.loads(stdout)
        out.append((port, pid))
    return out


def servers_of(d: Path) -> list[int]:
    """Pids of every process working in `d` (a server chdirs to its --dir; Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "cwd") == str(d.resolve()):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def config(server: ServerProcess, name: str) -> str:
    r = redis.Redis(port=server.port, decode_responses=True)
    try:
        return str(r.config_get(name)[name])
    finally:
        r.close()


def test_ensure_starts_then_everyone_attaches(data_dir: Path) -> None:
    first = ensure_server(data_dir)
    assert ping(first.port) and _alive(first.pid)
    again = ensure_server(data_dir)
    assert (again.port, again.pid) == (first.port, first.pid)
    assert ensure_in_subprocess(data_dir) == [(first.port, first.pid)]
    found = running_server(data_dir)
    assert found is not None and found.port == first.port
    state = json.loads((data_dir / "server.json").read_text())
    assert state == {"port": first.port, "pid": first.pid, "url": first.url}
    if Path("/proc").is_dir():
        assert servers_of(data_dir) == [first.pid]


def test_aof_is_on(data_dir: Path) -> None:
    server = ensure_server(data_dir)
    assert config(server, "appendonly") == "yes"
    assert config(server, "dir") == str(data_dir.resolve())


def test_stop_server(data_dir: Path) -> None:
    server = ensure_server(data_dir)
    assert stop_server(data_dir) is True
    assert not _alive(server.pid)
    assert not ping(server.port)
    assert not (data_dir / "server.json").exists()
    assert running_server(data_dir) is None
    assert stop_server(data_dir) is False


def test_data_survives_stop_and_start(data_dir: Path) -> None:
    async def write(url: str) -> list[Entry]:
        store = RedisSessionStore.from_url(url, prefix="keep")
        try:
            await store.create(SessionHeader(id="chat-1", title="kept"), [NewEntry("user/message", {"content": "a"})])
            await store.put("chat-1", 1, [NewEntry("assistant/message", {"content": f"b{i}"}) for i in range(5)])
            return list(await store.read("chat-1"))
        finally:
            await store.aclose()

    async def read(url: str) -> tuple[SessionHead | None, list[Entry]]:
        store = RedisSessionStore.from_url(url, prefix="keep")
        try:
            return await store.head("chat-1"), list(await store.read("chat-1"))
        finally:
            await store.aclose()

    first = ensure_server(data_dir)
    written = anyio.run(write, first.url)
    assert stop_server(data_dir)
    second = ensure_server(data_dir)
    assert second.pid != first.pid
    head, entries = anyio.run(read, second.url)
    assert entries == written
    assert head is not None and head.n == 6 and head.header.title == "kept"


def test_stale_state_file_is_replaced(data_dir: Path) -> None:
    dead_pid = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid.wait()  # exited and reaped: its pid names no process now
    data_dir.mkdir(parents=True)
    stale_port = free_port()
    (data_dir / "server.json").write_text(json.dumps({"port": stale_port, "pid": dead_pid.pid, "url": "x"}))
    assert running_server(data_dir) is None
    server = ensure_server(data_dir)
    assert server.pid != dead_pid.pid and _alive(server.pid) and ping(server.port)
    assert json.loads((data_dir / "server.json").read_text())["pid"] == server.pid


def test_unreadable_state_file_is_replaced(data_dir: Path) -> None:
    data_dir.mkdir(parents=True)
    (data_dir / "server.json").write_text("{not json")
    server = ensure_server(data_dir)
    assert ping(server.port)
    assert json.loads((data_dir / "server.json").read_text())["port"] == server.port


def test_concurrent_ensure_from_three_processes_yields_one_server(data_dir: Path) -> None:
    answers = ensure_in_subprocess(data_dir, k=3)
    assert len(set(answers)) == 1, answers
    port, pid = answers[0]
    assert ping(port) and _alive(pid)
    if Path("/proc").is_dir():
        assert servers_of(data_dir) == [pid]
    assert ensure_server(data_dir).pid == pid
    assert os.getpid() != pid


def _time_wait_sockets(port: int) -> int:
    """TIME-WAIT TCP sockets whose local port is `port` (Linux /proc/net/tcp: state 06)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "06":
            count += 1
    return count


def test_a_port_held_only_by_time_wait_is_free() -> None:
    """After `server stop` with clients connected, ~130 TIME-WAIT sockets made the
    port look taken with nothing listening."""
    from redis_session.redis.embedded import port_free

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    for _ in clients:
        conn, _ = listener.accept()
        conn.close()  # the server side closes first: its socket stays in TIME-WAIT on `port`
    for c in clients:
        c.close()
    assert not port_free(port)  # still listening
    listener.close()
    assert _time_wait_sockets(port) >= 1
    assert port_free(port)


def test_server_stop_then_start_keeps_the_port(tmp_path: Path) -> None:
    """The user's sequence, through the CLI: start, clients come and go (the server closes their
    connections: TIME-WAIT on its port), stop, start: the same URL, no "port is taken"."""
    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(REDIS_SESSION_HOME=str(home), REDIS_SESSION_PORT=str(port))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "redis_session.cli", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

    try:
        r = cli("server", "start")
        assert r.returncode == 0 and r.stdout.strip() == f"redis://127.0.0.1:{port}/0", r.stdout + r.stderr
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"*1\r\n$4\r\nQUIT\r\n")  # the server closes first
                s.recv(16)
                s.recv(16)
        assert cli("server", "stop").returncode == 0
        assert _time_wait_sockets(port) >= 1
        r = cli("server", "start")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"redis://127.0.0.1:{port}/0" and "taken" not in r.stderr, r.stdout + r.stderr
        assert ping(port)
    finally:
        stop_server(home)
