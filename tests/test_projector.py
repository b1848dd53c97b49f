"""Projector workers and the cached projection: convergence under concurrent writers, a worker
killed mid-batch, readers that never trust a stale, absent or damaged snapshot, graceful stop."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from redis_session import (
    Entry,
    InvalidEntryError,
    NewEntry,
    RedisSessionStore,
    SessionConflictError,
    SessionHeader,
    SessionNotFoundError,
    Surface,
    SurfaceReplace,
)
from redis_session.embedded import free_port
from redis_session.projection import ProjectionState, check_surface, project
from redis_session.projector import (
    BUSY,
    CURRENT,
    DELETED,
    WRITTEN,
    Projector,
    SnapshotCache,
    load_messages,
    lock_key,
    main,
    quiescent,
    status,
)

pytestmark = pytest.mark.anyio

WORKER = Path(__file__).with_name("_projector_worker.py")


# --------------------------------------------------------------------------- helpers


def um(t: str) -> NewEntry:
    return NewEntry("user/message", {"content": t})


def am(t: str) -> NewEntry:
    return NewEntry("assistant/message", {"content": [{"type": "text", "text": t}]})


def chunk(t: str) -> NewEntry:
    return NewEntry("assistant/chunk", {"chunk": t})


def cut(before: int, summary: str) -> NewEntry:
    return NewEntry("cut", {"before": before, "summary": [{"role": "user", "content": summary}], "reason": "t"})


def turn(i: int) -> list[NewEntry]:
    return [um(f"q{i}"), chunk("a"), chunk("b"), am(f"a{i}")]


async def truth(store: Any, sid: str) -> tuple[int, list[Any]]:
    head = await store.head(sid)
    assert head is not None
    return head.n, project(await store.read(sid, 0, head.n))


async def snapshot(store: Any, sid: str) -> tuple[int, ProjectionState] | None:
    got = await store.get_projection(sid)
    if got is None:
        return None
    return got[0], ProjectionState.from_bytes(got[1])


async def assert_converged(store: RedisSessionStore, sids: list[str]) -> None:
    for sid in sids:
        head = await store.head(sid)
        if head is None:
            continue
        n, want = await truth(store, sid)
        snap = await snapshot(store, sid)
        if n > 0 or snap is not None:
            assert snap is not None, f"{sid}: no snapshot at n={n}"
            assert snap[0] == n, f"{sid}: snapshot at {snap[0]}, head at {n}"
            assert snap[1].n == n
            assert snap[1].messages() == want, sid
        state, n2 = await load_messages(store, sid)
        assert n2 == n == state.n
        assert state.messages() == want, sid


async def drain(store: RedisSessionStore, *workers: Projector) -> None:
    """Run the workers' batches until the feed is fully delivered and acked."""
    with anyio.fail_after(20):
        while True:
            for w in workers:
                await w.run_once()
            if await quiescent(store) and not any(w.deferred for w in workers):
                return
            await anyio.sleep(0.02)


async def wait_for(cond: Callable[[], Awaitable[bool]], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.05)


def spawn_worker(
    redis_url: str, prefix: str, consumer: str, lock_ms: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), redis_url, prefix, consumer, str(lock_ms)],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


# --------------------------------------------------------------------------- basics


async def test_worker_folds_feed_into_snapshots(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await s.create(SessionHeader(id="a"), turn(1))
    await s.put("a", None, turn(2))
    await s.create(SessionHeader(id="b"), [um("hi"), chunk("x")])
    p = Projector(s, consumer="w1")
    acked = await p.run_once()
    assert acked == 3  # three feed entries, two sessions: two folds
    assert p.metrics.value("folds_total", outcome=WRITTEN) == 2
    await assert_converged(s, ["a", "b"])
    assert await quiescent(s)
    st = await status(s)
    assert st["counters"]["processed"] == 3 and st["counters"]["written"] == 2
    assert {sh["pending"] for sh in st["shards"]} == {0} and st["lag"] == 0
    # Appends extend the snapshot; an old hint is acked without a fold.
    await s.put("a", None, [*turn(3), cut(4, "summary"), um("after")])
    await drain(s, p)
    await assert_converged(s, ["a", "b"])


async def test_group_starts_at_zero_so_history_is_caught_up(redis_store: RedisSessionStore) -> None:
    s = redis_store
    # Appends land before any worker (or group) exists: a group created at `$` would skip them.
    for i in range(5):
        await s.create(SessionHeader(id=f"s{i}"), turn(i))
    st = await status(s)
    assert st["lag"] == 5 and not any(sh["group"] for sh in st["shards"])
    p = Projector(s, consumer="late")
    await drain(s, p)
    await assert_converged(s, [f"s{i}" for i in range(5)])


async def test_deleted_session_is_skipped_and_acked(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await s.create(SessionHeader(id="gone"), turn(1))
    await s.create(SessionHeader(id="kept"), turn(1))
    assert await s.delete("gone")
    p = Projector(s, consumer="w")
    await drain(s, p)
    assert p.metrics.value("folds_total", outcome=DELETED) == 1
    assert await s.get_projection("kept") is not None
    assert await quiescent(s)
    assert (await status(s))["counters"]["deleted"] == 1


async def test_branches_fold_the_stitched_log(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await s.create(SessionHeader(id="p"), [*turn(1), cut(2, "sum"), *turn(2)])
    # a branch with entries of its own, and an empty one announced by the session-branch event
    await s.create(SessionHeader(id="c1", parent="p", at=6), turn(3))
    await s.create(SessionHeader(id="c2", parent="p", at=9))
    await s.publish("session-branch", {"parent": "p", "session": "c2", "at": 9})
    await s.create(SessionHeader(id="g", parent="c1", at=8), [cut(7, "again"), *turn(4)])
    p = Projector(s, consumer="w")
    await drain(s, p)
    await assert_converged(s, ["p", "c1", "c2", "g"])
    assert (await s.get_projection("c2")) is not None


async def test_new_branch_starts_from_the_parents_snapshot(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await s.create(SessionHeader(id="root"), [e for i in range(30) for e in turn(i)])
    p = Projector(s, consumer="w")
    await drain(s, p)
    await s.put("root", None, turn(30))  # the parent's snapshot is now behind the branch point
    await s.create(SessionHeader(id="kid", parent="root", at=122), [um("own")])
    await s.create(SessionHeader(id="kid0", parent="root", at=100))  # before the snapshot: no use
    assert await p.fold("kid") == WRITTEN
    assert await p.fold("kid0") == WRITTEN
    assert p.metrics.value("rebuilds_total", source="parent") == 1
    assert p.metrics.value("rebuilds_total", source="full") == 2  # root's first fold, and kid0
    await drain(s, p)
    await assert_converged(s, ["root", "kid", "kid0"])
    # readers take the same path when the branch has no snapshot of its own
    await s.create(SessionHeader(id="kid2", parent="root", at=124), [um("x")])
    state, _ = await load_messages(s, "kid2")
    assert state.messages() == (await truth(s, "kid2"))[1]


async def test_busy_lock_defers_without_losing_the_update(redis_store: RedisSessionStore, raw_redis: Any) -> None:
    s = redis_store
    await s.create(SessionHeader(id="hot"), turn(1))
    await raw_redis.set(lock_key(s.prefix, "hot"), "other-worker", px=10_000)
    p = Projector(s, consumer="w")
    assert await p.run_once() == 0
    assert p.metrics.value("folds_total", outcome=BUSY) == 1
    assert (await status(s))["pending"] == 1  # kept, not acked
    assert await s.get_projection("hot") is None
    await raw_redis.delete(lock_key(s.prefix, "hot"))
    assert await p.run_once() == 1  # the deferred session is retried on the next loop
    await assert_converged(s, ["hot"])
    assert await quiescent(s)


async def test_cut_compacts_the_snapshot(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await s.create(SessionHeader(id="long"), [e for i in range(150) for e in turn(i)])
    p = Projector(s, consumer="w")
    await drain(s, p)
    big = await s.get_projection("long")
    assert big is not None
    head = await s.head("long")
    assert head is not None
    # The cut keeps the last two turns: the rebuilt snapshot drops the 148 hidden ones.
    await s.put("long", None, [cut(head.n - 8, "old turns"), *turn(999)])
    await drain(s, p)
    assert p.metrics.value("rebuilds_total", source="cut") == 1
    small = await s.get_projection("long")
    assert small is not None
    assert len(small[1]) < len(big[1]) / 10
    await assert_converged(s, ["long"])
    # A later cut that shows older entries than the compacted snapshot holds: rebuilt, still right.
    head = await s.head("long")
    assert head is not None
    await s.put("long", None, [cut(100, "wider"), um("x")])
    await drain(s, p)
    await assert_converged(s, ["long"])


# --------------------------------------------------------------------------- readers


async def test_readers_with_stale_absent_and_corrupt_snapshots(redis_store: RedisSessionStore, raw_redis: Any) -> None:
    s = redis_store
    proj = s.keys.proj("s")
    await s.create(SessionHeader(id="s"), [e for i in range(20) for e in turn(i)])

    async def check() -> None:
        n, want = await truth(s, "s")
        state, n2 = await load_messages(s, "s")
        assert (n2, state.n) == (n, n) and state.messages() == want

    await check()  # absent, no cut: a full fold
    await s.put("s", None, [cut(70, "sum"), *turn(50)])
    await check()  # absent, with a cut: rebuilt from the cut
    p = Projector(s, consumer="w")
    await drain(s, p)
    fresh = await s.get_projection("s")
    assert fresh is not None
    await check()  # fresh
    await s.put("s", None, [*turn(51), cut(60, "sum2"), *turn(52)])
    await check()  # stale by a batch holding a cut

    good_n, good_state = fresh
    await raw_redis.hset(proj, mapping={"n": good_n, "state": "garbage \x00\xff"})
    await check()  # undecodable state
    await raw_redis.hset(proj, mapping={"n": "12x", "state": good_state})
    await check()  # undecodable n
    assert await p.fold("s") == WRITTEN  # the worker drops it (proj.lua cannot compare with it)
    await assert_converged(s, ["s"])
    await raw_redis.hset(proj, mapping={"n": 999_999, "state": good_state})
    await check()  # ahead of the head
    await raw_redis.hset(proj, mapping={"n": good_n - 1, "state": good_state})
    await check()  # n disagrees with the state's own n
    flipped = bytearray(good_state)
    flipped[-5] ^= 0x01
    await raw_redis.hset(proj, mapping={"n": good_n, "state": bytes(flipped)})
    await check()  # a flipped bit (CRC)

    # A well-formed snapshot of another log (without this log's last cut) under this session's
    # key: the header's last_cut gives it away.
    await s.create(SessionHeader(id="other"), [e for i in range(30) for e in turn(i)])
    head = await s.head("s")
    assert head is not None and head.last_cut is not None
    other = ProjectionState()
    other.extend(await s.read("other", 0, head.n))
    await raw_redis.hset(proj, mapping={"n": head.n, "state": other.to_bytes()})
    await check()

    # The worker repairs what it can: a snapshot ahead of the head is dropped and rewritten.
    await raw_redis.hset(proj, mapping={"n": 999_999, "state": good_state})
    assert await p.fold("s") == WRITTEN
    await assert_converged(s, ["s"])
    with pytest.raises(SessionNotFoundError):
        await load_messages(s, "missing")


async def test_snapshot_cache_is_transparent(redis_store: RedisSessionStore, raw_redis: Any) -> None:
    s = redis_store
    await s.create(SessionHeader(id="c"), [e for i in range(10) for e in turn(i)])
    p = Projector(s, consumer="w")
    await drain(s, p)
    cache = SnapshotCache()
    first, n = await load_messages(s, "c", cache=cache)
    assert (cache.hits, cache.misses, len(cache)) == (0, 1, 1)  # decoded once
    await s.put("c", None, turn(10))  # the snapshot is stale now
    first.extend(await s.read("c", n))  # the caller moves its own state on ...
    assert first.n == n + 4
    blob = (await s.get_projection("c") or (0, b""))[1]
    cached = cache.get("c", blob)  # ... and the cached decode stays where the snapshot is
    assert cached is not None and cached.n == n
    second, n2 = await load_messages(s, "c", cache=cache)  # the cached state plus the new tail
    assert cache.extended == 1 and second.n == n2 == n + 4
    assert second.messages() == first.messages() == (await truth(s, "c"))[1]
    await drain(s, p)  # a new snapshot: other bytes, never decoded
    third, _ = await load_messages(s, "c", cache=cache)
    assert cache.extended == 2 and cache.misses == 1 and third.messages() == second.messages()
    # Damaged snapshot bytes do not matter to a reader that holds the state.
    await raw_redis.hset(s.keys.proj("c"), "state", "garbage")
    assert (await load_messages(s, "c", cache=cache))[0].messages() == third.messages()
    assert len(cache) == 1
    # With no tail allowed, a hit needs the exact bytes; garbage is never cached.
    strict = SnapshotCache(max_tail=0)
    assert (await load_messages(s, "c", cache=strict))[0].messages() == third.messages()
    assert len(strict) == 0 and strict.misses == 1
    await drain(s, p)
    await s.put("c", None, turn(11))
    await drain(s, p)
    await load_messages(s, "c", cache=strict)  # decoded and kept
    await s.put("c", None, turn(12))  # 4 behind: not extended (max_tail=0); the same bytes: a hit
    again, _ = await load_messages(s, "c", cache=strict)
    assert strict.hits == 1 and strict.extended == 0 and again.messages() == (await truth(s, "c"))[1]
    # Bounded by the bytes it holds.
    small = SnapshotCache(max_bytes=1)
    await load_messages(s, "c", cache=small)
    assert len(small) == 0


async def test_snapshot_cache_extends_its_state_instead_of_decoding(redis_store: RedisSessionStore) -> None:
    """Once the projector rewrote the snapshot, a cached state is extended with the log's tail (no
    decode); a session re-created under the same id never borrows the old incarnation's state."""
    s = redis_store
    await s.create(SessionHeader(id="x"), [e for i in range(5) for e in turn(i)])
    p = Projector(s, consumer="w")
    await drain(s, p)
    cache = SnapshotCache()
    await load_messages(s, "x", cache=cache)
    for i in range(5, 8):
        await s.put("x", None, [*turn(i), cut(2, f"summary {i}")])
        await drain(s, p)  # a new snapshot each time: other bytes
        state, n = await load_messages(s, "x", cache=cache)
        assert state.messages() == (await truth(s, "x"))[1] and state.n == n
    assert cache.extended == 3
    # no snapshot at all (deleted hash): the cached state still serves, extended
    await s.put("x", None, turn(8))
    await s.client.execute_command("DEL", s.keys.proj("x"))
    state, _ = await load_messages(s, "x", cache=cache)
    assert state.messages() == (await truth(s, "x"))[1] and cache.extended == 4
    # a new incarnation of the id: its own log, whatever the cache holds
    await s.delete("x")
    await s.create(SessionHeader(id="x", created_at=1), turn(0))
    state, _ = await load_messages(s, "x", cache=cache)
    assert state.messages() == (await truth(s, "x"))[1] and cache.extended == 4
