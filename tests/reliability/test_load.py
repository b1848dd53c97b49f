"""Load: many writers over many sessions, and writers contending on one session.

After a bounded run: no entry lost or duplicated, n contiguous everywhere, and every session's raw
storage consistent (header n == XLEN, stream IDs ``<n>-1`` contiguous), checked with raw
HGET/XLEN/XRANGE. Also the memory cost of 1 000 sessions of 100 entries (INFO used_memory delta).

A private server per test: the numbers are not disturbed by other tests, and nothing shared is
loaded. CI runs a few seconds; ``-m slow`` runs longer.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis

from redis_session import (
    Entry,
    NewEntry,
    RedisSessionStore,
    SessionConflictError,
    SessionHeader,
)
from redis_session.redis.embedded import ServerProcess

from ._util import assert_batches_whole, batch

pytestmark = pytest.mark.anyio

SESSIONS = 1_000
WRITERS = 64
CONTENDERS = 8


async def _load(url: str, seconds: float, seed: int) -> dict[str, Any]:
    store = RedisSessionStore.from_url(url, prefix="load", client_options={"max_connections": 128})
    raw = aioredis.Redis.from_url(url)
    sids = [f"s{i:04d}" for i in range(SESSIONS)]
    try:
        for chunk in range(0, SESSIONS, 100):
            async with anyio.create_task_group() as tg:
                for sid in sids[chunk : chunk + 100]:
                    tg.start_soon(store.create, SessionHeader(id=sid))
        await store.create(SessionHeader(id="hot"))
        acked: dict[str, list[list[Entry]]] = defaultdict(list)
        known_n: dict[str, int] = dict.fromkeys(sids, 0)
        stats = {"appends": 0, "conflicts": 0, "hot_appends": 0, "hot_conflicts": 0}
        until = time.monotonic() + seconds

        async def writer(w: int) -> None:
            rng = random.Random(seed * 1000 + w)
            j = 0
            while time.monotonic() < until:
                sid = rng.choice(sids)
                key = f"w{w}-{j}"
                entries = batch(key, rng.randint(1, 4))
                while True:
                    try:
                        if rng.random() < 0.2:
                            got = await store.put(sid, None, entries)
                        else:
                            got = await store.put(sid, known_n[sid], entries)
                        break
                    except SessionConflictError as e:
                        stats["conflicts"] += 1
                        known_n[sid] = e.actual_n
                known_n[sid] = max(known_n[sid], got[-1].n + 1)
                acked[sid].append(got)
                stats["appends"] += 1
                j += 1

        async def contender(c: int) -> None:
            rng = random.Random(seed * 7 + c)
            n = 0
            j = 0
            while time.monotonic() < until:
                key = f"h{c}-{j}"
                entries = batch(key, rng.randint(1, 3))
                while True:
                    try:
                        got = await store.put("hot", None if c % 4 == 0 else n, entries, idempotency_key=key)
                        break
                    except SessionConflictError as e:
                        stats["hot_conflicts"] += 1
                        n = e.actual_n
                n = got[-1].n + 1
                acked["hot"].append(got)
                stats["hot_appends"] += 1
                j += 1

        t0 = time.monotonic()
        with anyio.fail_after(seconds + 120):
            async with anyio.create_task_group() as tg:
                for w in range(WRITERS):
                    tg.start_soon(writer, w)
                for c in range(CONTENDERS):
                    tg.start_soon(contender, c)
        elapsed = time.monotonic() - t0

        # Every log holds exactly what was acknowledged: no writer failed, so nothing else.
        checked_entries = 0
        for sid in [*sids, "hot"]:
            entries = await store.read(sid)
            expected = sorted((e.n, e.data["k"], e.data["i"]) for got in acked.get(sid, []) for e in got)
            assert [(e.n, e.data["k"], e.data["i"]) for e in entries] == expected, f"{sid}: lost or duplicated"
            assert_batches_whole(entries)
            checked_entries += len(entries)
        # Raw storage, pipelined: header n == XLEN, and stream IDs 0-1 .. (n-1)-1.
        for chunk in range(0, SESSIONS + 1, 200):
            group = [*sids, "hot"][chunk : chunk + 200]
            pipe = raw.pipeline(transaction=False)
            for sid in group:
                pipe.hget(store.keys.hdr(sid), "n")
                pipe.xlen(store.keys.log(sid))
                pipe.xrange(store.keys.log(sid), "-", "+")
            replies = await pipe.execute()
            for i, sid in enumerate(group):
                n_raw, xlen, rows = replies[3 * i : 3 * i + 3]
                n = int(n_raw)
                assert xlen == n, f"{sid}: header n={n}, XLEN={xlen}"
                assert [rid.decode() for rid, _ in rows] == [f"{k}-1" for k in range(n)], f"{sid}: IDs not contiguous"
        stats.update(elapsed=round(elapsed, 2), entries=checked_entries)
        stats["appends_per_s"] = round((stats["appends"] + stats["hot_appends"]) / elapsed)
        assert stats["appends"] > WRITERS and stats["hot_appends"] > CONTENDERS
        return stats
    finally:
        await store.aclose()
        await raw.aclose()


async def test_load_64_writers_1000_sessions_and_8_contenders(private_server: ServerProcess) -> None:
    stats = await _load(private_server.url, seconds=3.0, seed=1)
    print("load:", stats)


@pytest.mark.slow
async def test_load_soak(private_server: ServerProcess) -> None:
    stats = await _load(private_server.url, seconds=60.0, seed=2)
    print("load soak:", stats)


async def test_memory_per_1000_sessions_of_100_entries(private_server: ServerProcess) -> None:
    """INFO memory used_memory before and after 1 000 sessions of 100 chat-sized entries."""
    store = RedisSessionStore.from_url(private_server.url, prefix="mem", feed=False)
    raw = aioredis.Redis.from_url(private_server.url, decode_responses=True)
    try:
        before = int((await raw.info("memory"))["used_memory"])
        rng = random.Random(3)

        def entry(i: int) -> NewEntry:
            text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "tool", "call"]) for _ in range(15))
            if i % 2 == 0:
                return NewEntry("user/message", {"content": text})
            return NewEntry("assistant/message", {"content": text}, {"turn": i // 2, "usage": {"input": 100}})

        payload = 0
        for chunk in range(0, 1_000, 50):
            async with anyio.create_task_group() as tg:
                for s in range(chunk, chunk + 50):
                    entries = [entry(i) for i in range(100)]
                    payload += sum(len(msgspec.json.encode(e.data)) for e in entries)
                    tg.start_soon(store.create, SessionHeader(id=f"m{s:04d}"), entries)
        after = int((await raw.info("memory"))["used_memory"])
        delta = after - before
        per_session = delta / 1_000
        per_entry = delta / 100_000
        print(
            f"memory: 1000 sessions x 100 entries: used_memory +{delta / 1e6:.1f} MB "
            f"({per_session / 1e3:.1f} kB per session, {per_entry:.0f} B per entry; "
            f"~{payload / 100_000:.0f} B of JSON payload per entry)"
        )
        assert 0 < delta < 200 * 1024 * 1024, "1 000 sessions of 100 entries must fit in well under 200 MB"
        assert per_entry < 4 * payload / 100_000 + 200, "storage overhead per entry is out of proportion"
    finally:
        await store.aclose()
        await raw.aclose()
