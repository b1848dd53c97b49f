"""Many writers, one session: nothing lost, nothing duplicated, nothing interleaved.

Writers use their own connections (one `RedisSessionStore` each), then their own OS processes.
With `expected_n` they conflict and retry with jittered backoff; with `expected_n=None` they never
conflict. Either way the log ends with every entry exactly once, `n` contiguous, and each writer's
own entries in the order it wrote them. Last, a server that is down or silent fails fast.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from redis_session import (
    Entry,
    NewEntry,
    RedisSessionStore,
    SessionConflictError,
    SessionHeader,
    StoreUnavailableError,
)
from redis_session.redis.embedded import free_port

pytestmark = pytest.mark.anyio

_HERE = Path(__file__).resolve().parent
WRITERS = 8
PER_WRITER = 200
SID = "busy"


def entry(w: int, i: int) -> NewEntry:
    return NewEntry("user/message", {"content": f"writer {w} says {i}", "w": w, "i": i})


async def write_with_retry(store: RedisSessionStore, w: int, count: int) -> int:
    """Append `count` entries one by one at the n this writer believes in; on a conflict take the
    actual n from the error, back off a jittered moment and retry. Returns the conflicts seen."""
    head = await store.head(SID)
    assert head is not None
    n, conflicts = head.n, 0
    for i in range(count):
        attempt = 0
        while True:
            try:
                [e] = await store.put(SID, n, [entry(w, i)])
            except SessionConflictError as c:
                assert c.expected_n == n and c.actual_n > n
                n, attempt, conflicts = c.actual_n, attempt + 1, conflicts + 1
                await anyio.sleep(random.uniform(0, min(0.004, 0.0001 * 2**attempt)))
                continue
            assert e.n == n
            n += 1
            break
    return conflicts


def check_log(entries: Sequence[Entry], writers: Sequence[int], per_writer: int) -> None:
    total = len(writers) * per_writer
    assert [e.n for e in entries] == list(range(total))
    seen = [(e.data["w"], e.data["i"]) for e in entries]
    assert len(set(seen)) == total, "an entry was duplicated"
    for w in writers:
        assert [i for ww, i in seen if ww == w] == list(range(per_writer)), f"writer {w} lost or reordered"


def _stores(url: str, prefix: str, k: int) -> list[RedisSessionStore]:
    return [RedisSessionStore.from_url(url, prefix=prefix) for _ in range(k)]


async def test_writers_on_separate_connections_conflict_and_retry(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    await redis_store.create(SessionHeader(id=SID))
    stores = _stores(redis_url, prefix, WRITERS)
    conflicts: list[int] = []

    async def run(w: int) -> None:
        conflicts.append(await write_with_retry(stores[w], w, PER_WRITER))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for w in range(WRITERS):
                    tg.start_soon(run, w)
    finally:
        for s in stores:
            await s.aclose()
    assert sum(conflicts) > 0, "the writers never met: the test proved nothing"
    head = await redis_store.head(SID)
    assert head is not None and head.n == WRITERS * PER_WRITER
    check_log(await redis_store.read(SID), range(WRITERS), PER_WRITER)


async def test_writers_appending_at_the_end_never_conflict(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """`expected_n=None`: no conflict, no retry loop; odd writers append batches of 4, and a batch
    is never split by another writer's entries."""
    await redis_store.create(SessionHeader(id=SID))
    stores = _stores(redis_url, prefix, WRITERS)

    async def run(w: int) -> None:
        batch = 4 if w % 2 else 1
        for i in range(0, PER_WRITER, batch):
            stored = await stores[w].put(SID, None, [entry(w, j) for j in range(i, i + batch)])
            assert [e.n for e in stored] == list(range(stored[0].n, stored[0].n + batch))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:  # any SessionConflictError fails the test
                for w in range(WRITERS):
                    tg.start_soon(run, w)
    finally:
        for s in stores:
            await s.aclose()
    entries = await redis_store.read(SID)
    check_log(entries, range(WRITERS), PER_WRITER)
    pos = {(e.data["w"], e.data["i"]): e.n for e in entries}
    for w in range(1, WRITERS, 2):
        for i in range(0, PER_WRITER, 4):
            assert [pos[w, j] for j in range(i, i + 4)] == list(range(pos[w, i], pos[w, i] + 4))


# --------------------------------------------------------------------------- two OS processes

_WORKER = """
import json, sys, time
import anyio, redis.asyncio as aioredis
url, prefix, first, count, per_writer, here = sys.argv[1:7]
sys.path.insert(0, here)
from test_concurrency import write_with_retry
from redis_session import RedisSessionStore

async def main():
    r = aioredis.Redis.from_url(url)
    await r.incr(prefix + ":ready")
    deadline = time.monotonic() + 150  # the other process may take long to start on a busy machine
    while not await r.exists(prefix + ":go"):  # start together, so the processes really contend
        assert time.monotonic() < deadline, "never told to go"
        await anyio.sleep(0.005)
    await r.aclose()
    stores = [RedisSessionStore.from_url(url, prefix=prefix) for _ in range(int(count))]
    conflicts = []
    async def run(k):
        conflicts.append(await write_with_retry(stores[k], int(first) + k, int(per_writer)))
    async with anyio.create_task_group() as tg:
        for k in range(int(count)):
            tg.start_soon(run, k)
    for s in stores:
        await s.aclose()
    print(json.dumps({"conflicts": sum(conflicts)}))

anyio.run(main)
"""


async def test_two_processes_conflict_and_retry(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, raw_redis: aioredis.Redis
) -> None:
    await redis_store.create(SessionHeader(id=SID))
    here = str(_HERE)
    per_process = WRITERS // 2
    done: dict[int, subprocess.CompletedProcess[bytes]] = {}

    async def worker(p: int) -> None:
        args = [redis_url, prefix, str(p * per_process), str(per_process), str(PER_WRITER), here]
        done[p] = await anyio.run_process([sys.executable, "-c", _WORKER, *args], check=False)

    with anyio.fail_after(180):
        async with anyio.create_task_group() as tg:
            for p in range(2):
                tg.start_soon(worker, p)
            while int(await raw_redis.get(f"{prefix}:ready") or 0) < 2:
                assert not done, {p: r.stderr.decode()[-2000:] for p, r in done.items()}
                await anyio.sleep(0.01)
            await raw_redis.set(f"{prefix}:go", "1")
    for r in done.values():
        assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert sum(json.loads(r.stdout.decode().splitlines()[-1])["conflicts"] for r in done.values()) > 0
    head = await redis_store.head(SID)
    assert head is not None and head.n == WRITERS * PER_WRITER
    check_log(await redis_store.read(SID), range(WRITERS), PER_WRITER)


# --------------------------------------------------------------------------- a server that is not there


async def _fails_fast(store: RedisSessionStore, limit_s: float) -> None:
    ops: list[Any] = [
        lambda: store.head("s"),
        lambda: store.read("s"),
        lambda: store.put("s", 0, [entry(0, 0)]),
        lambda: store.put("s", None, [entry(0, 0)]),
    ]
    try:
        for op in ops:
            t0 = time.monotonic()
            with anyio.fail_after(limit_s + 5), pytest.raises(StoreUnavailableError):
                await op()
            assert time.monotonic() - t0 < limit_s
    finally:
        await store.aclose()


async def test_closed_port_raises_store_unavailable_quickly() -> None:
    store = RedisSessionStore.from_url(f"redis://127.0.0.1:{free_port()}/0", prefix="dead")
    await _fails_fast(store, 3.0)


async def test_silent_server_times_out_without_retrying() -> None:
    """A peer that accepts connections but never answers: the client's socket timeout applies
    once (a write whose reply was lost is not re-sent behind the caller's back)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel completes handshakes; nobody ever reads or replies
        port = listener.getsockname()[1]
        store = RedisSessionStore.from_url(
            f"redis://127.0.0.1:{port}/0",
            prefix="silent",
            client_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
        )
        await _fails_fast(store, 3.0)
