"""Projector workers and the cached projection: convergence under concurrent writers, a worker
killed mid-batch, readers that never trust a stale, absent or damaged snapshot, graceful stop."""

from __future__ import annotations

import json
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
    SessionReplacedError,
    Surface,
    SurfaceReplace,
)
from redis_session.cli import main as cli_main
from redis_session.projection import ProjectionState, check_surface, project
from redis_session.projector import (
    BUSY,
    CURRENT,
    DELETED,
    WRITTEN,
    Projector,
    quiescent,
    status,
)
from redis_session.redis.embedded import free_port
from redis_session.snapshots import SnapshotCache, load_messages

from support import wait_for as wait_until

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
        # a batch of chunk rows only sends no feed hint (it changes no projection): the snapshot
        # may stop before a trailing run of them
        entries = await store.read(sid)
        hinted = n
        while hinted > (head.header.at or 0) and entries[hinted - 1].type == "assistant/chunk":
            hinted -= 1
        if hinted > 0 or snap is not None:
            assert snap is not None, f"{sid}: no snapshot at n={n}"
            assert hinted <= snap[0] <= n, f"{sid}: snapshot at {snap[0]}, head at {n}"
            assert snap[1].n == snap[0]
            assert snap[1].messages() == want, sid
        state, n2 = await load_messages(store, sid)
        assert n2 == n == state.n
        assert state.messages() == want, sid


async def drain(store: RedisSessionStore, *workers: Projector) -> None:
    """Run the workers' batches until the feed is fully delivered and acked."""
    with anyio.fail_after(90):
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
    await raw_redis.set(s.keys.plock("hot"), "other-worker", px=10_000)
    p = Projector(s, consumer="w")
    assert await p.run_once() == 0
    assert p.metrics.value("folds_total", outcome=BUSY) == 1
    assert (await status(s))["pending"] == 1  # kept, not acked
    assert await s.get_projection("hot") is None
    await raw_redis.delete(s.keys.plock("hot"))
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


async def test_load_messages_on_any_store(store: Any) -> None:
    await store.create(SessionHeader(id="m"), [*turn(1), *turn(2), cut(4, "s"), *turn(3)])
    n, want = await truth(store, "m")
    state, n2 = await load_messages(store, "m")
    assert n2 == n and state.messages() == want
    await store.put_projection("m", n, state.to_bytes())
    await store.put("m", None, turn(4))
    n, want = await truth(store, "m")
    state, _ = await load_messages(store, "m")
    assert state.n == n and state.messages() == want


# --------------------------------------------------------------------------- convergence


class _Writer:
    """Random writes to a shared pool of sessions: appends, cuts, valid replaces, branches, deletes."""

    def __init__(self, store: RedisSessionStore, pool: list[str], seed: int) -> None:
        self.store = store
        self.pool = pool
        self.rng = random.Random(seed)
        self.seed = seed
        self.branches = 0

    async def run(self, ops: int) -> None:
        for _ in range(ops):
            sid = self.rng.choice(self.pool)
            try:
                await self.step(sid)
            except SessionNotFoundError:
                if sid in self.pool and len(self.pool) > 1:
                    self.pool.remove(sid)
            await anyio.lowlevel.checkpoint()

    async def step(self, sid: str) -> None:
        r = self.rng.random()
        s = self.store
        if r < 0.55:
            k = self.rng.randint(1, 6)
            batch = [self.rng.choice([um, am, chunk, chunk])(f"{sid}-{self.rng.random():.3f}") for _ in range(k)]
            await s.put(sid, None, batch)
        elif r < 0.65:
            head = await s.head(sid)
            if head is None:
                raise SessionNotFoundError(sid)
            await s.put(sid, None, [cut(self.rng.randint(max(0, head.n - 12), head.n), f"c{head.n}")])
        elif r < 0.85:
            await self.replace(sid)
        elif r < 0.97:
            head = await s.head(sid)
            if head is None:
                raise SessionNotFoundError(sid)
            self.branches += 1
            child = f"{sid[:40]}.b{self.seed}x{self.branches}"
            at = self.rng.randint(0, head.n)
            seed_entries = turn(self.branches) if self.rng.random() < 0.5 else []
            await s.create(SessionHeader(id=child, parent=sid, at=at), seed_entries)
            if not seed_entries:
                await s.publish("session-branch", {"parent": sid, "session": child, "at": at})
            self.pool.append(child)
        else:
            if len(self.pool) > 4 and sid in self.pool:
                self.pool.remove(sid)
                await s.delete(sid)

    async def replace(self, sid: str) -> None:
        """A surface replace that the projection's own check accepts, written at expected_n."""
        s = self.store
        head = await s.head(sid)
        if head is None:
            raise SessionNotFoundError(sid)
        state = ProjectionState()
        state.extend(await s.read(sid, 0, head.n))
        nodes = state.surface
        if not nodes:
            return
        for _ in range(4):
            i = self.rng.randrange(len(nodes))
            j = min(len(nodes) - 1, i + self.rng.randint(0, 2))
            surface = Surface(
                op=SurfaceReplace(op="replace", start=nodes[i], end=nodes[j]), source_event_seqs=nodes[i : j + 1]
            )
            entry = Entry(n=head.n, time=0, type="assistant/message", data={"content": f"r{head.n}"}, surface=surface)
            try:
                check_surface(state, [entry], head.n)
            except InvalidEntryError:
                continue  # a hidden node: pick again
            try:
                await s.put(sid, head.n, [NewEntry("assistant/message", {"content": f"r{head.n}"}, surface=surface)])
            except SessionConflictError:
                pass  # another writer moved on: that replace would no longer be checked
            return


async def test_convergence_with_concurrent_writers_and_three_workers(redis_store: RedisSessionStore) -> None:
    s = redis_store
    pool = [f"conv-{i}" for i in range(10)]
    for sid in pool:
        await s.create(SessionHeader(id=sid), turn(0))
    all_ids = set(pool)
    workers = [Projector(s, consumer=f"w{i}", block_ms=100, claim_idle_ms=1_000, batch=16) for i in range(3)]
    writers = [_Writer(s, pool, seed) for seed in range(4)]
    with anyio.fail_after(120):
        async with anyio.create_task_group() as wg:
            for w in workers:
                wg.start_soon(w.run)
            async with anyio.create_task_group() as tg:
                for wr in writers:
                    tg.start_soon(wr.run, 120)
            all_ids.update(pool)

            async def settled() -> bool:
                return await quiescent(s) and not any(w.deferred for w in workers)

            await wait_for(settled, 60, "feed lag 0 and nothing pending")
            for w in workers:
                w.stop()
    all_ids.update(pool)
    assert sum(w.metrics.value("processed_total") for w in workers) > 0
    assert sum(w.metrics.value("rebuilds_total", source="cut") for w in workers) > 0
    assert sum(1 for w in workers if w.metrics.value("folds_total", outcome=WRITTEN) > 0) >= 2
    await assert_converged(s, sorted(all_ids))


# --------------------------------------------------------------------------- crashes and stops


async def test_worker_killed_mid_batch_is_reclaimed(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    s = redis_store
    sids = [f"k{i}" for i in range(8)]
    for sid in sids:
        await s.create(SessionHeader(id=sid), turn(1))
        await s.put(sid, None, turn(2))
    paused = tmp_path / "paused"
    proc = spawn_worker(
        redis_url, prefix, "doomed", 1_500, {"RS_TEST_PAUSE_AT": "3", "RS_TEST_PAUSE_FILE": str(paused)}
    )
    try:

        async def is_paused() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            return paused.exists()

        await wait_for(is_paused, 60, "the worker to pause mid-batch")
        # Two sessions folded and acked, the third half done, five delivered and untouched.
        st = await status(s)
        assert st["lag"] == 0 and st["pending"] == 12
        assert st["counters"]["processed"] == 4
        half_done = paused.read_text()
        assert await s.get_projection(half_done) is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr:
            proc.stderr.close()

    rescuer = Projector(s, consumer="rescuer", claim_idle_ms=300, block_ms=100)
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rescuer.run)
            await wait_for(lambda: quiescent(s), 60, "the dead worker's entries to be reclaimed")
            rescuer.stop()
    assert rescuer.metrics.value("reclaimed_total") == 12
    await assert_converged(s, sids)
    assert (await status(s))["counters"]["reclaimed"] == 12


async def test_stop_during_a_batch_finishes_it(redis_store: RedisSessionStore) -> None:
    s = redis_store
    sids = [f"g{i}" for i in range(6)]
    for sid in sids:
        await s.create(SessionHeader(id=sid), turn(1))
    p: Projector

    async def hook(session_id: str) -> None:
        p.stop()  # mid-batch: the other sessions of the batch must still be folded and acked
        await anyio.sleep(0.1)

    p = Projector(s, consumer="w", block_ms=5_000, on_session=hook)
    with anyio.fail_after(60):
        await p.run()
    assert p.batches == 1
    assert await quiescent(s)
    await assert_converged(s, sids)
    # stop() during an idle read returns promptly, without waiting for block_ms
    p2 = Projector(s, consumer="w2", block_ms=30_000)
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(p2.run)
        await wait_until(lambda: p2._idle_scope is not None)  # in its idle read
        p2.stop()
    assert time.monotonic() - t0 < 15  # not the 30 s block (room for a loaded machine)


async def test_sigterm_finishes_the_batch_in_hand(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    s = redis_store
    sids = [f"t{i}" for i in range(5)]
    for sid in sids:
        await s.create(SessionHeader(id=sid), turn(1))
    paused = tmp_path / "paused"
    proc = spawn_worker(
        redis_url,
        prefix,
        "term",
        10_000,
        {"RS_TEST_PAUSE_AT": "2", "RS_TEST_PAUSE_FILE": str(paused), "RS_TEST_PAUSE_SECONDS": "2"},
    )
    try:

        async def is_paused() -> bool:
            assert proc.poll() is None
            return paused.exists()

        await wait_for(is_paused, 60, "the worker to pause mid-batch")
        proc.send_signal(signal.SIGTERM)
        rc = await anyio.to_thread.run_sync(proc.wait, 60)
        err = proc.stderr.read() if proc.stderr else b""
        assert rc == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr:
            proc.stderr.close()
    assert await quiescent(s)
    await assert_converged(s, sids)


# --------------------------------------------------------------------------- health


async def test_metrics_and_status(
    redis_store: RedisSessionStore, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    s = redis_store
    for i in range(3):
        await s.create(SessionHeader(id=f"h{i}"), turn(i))
    port = free_port()
    p = Projector(s, consumer="metrics", metrics_port=port, metrics_addr="127.0.0.1", block_ms=100)
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        await wait_for(lambda: quiescent(s), 60, "the feed to drain")
        await p.refresh_gauges()
        body = await anyio.to_thread.run_sync(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        )
        p.stop()
    assert "redis_session_projector_processed_total 3.0" in body
    assert 'redis_session_projector_lag{shard="0"} 0.0' in body
    assert "redis_session_projector_pending" in body
    st = await status(s)
    assert st["counters"]["processed"] == 3
    assert [sh["shard"] for sh in st["shards"]] == [0, 1, 2, 3]
    assert any(c["name"] == "metrics" for sh in st["shards"] for c in sh["consumers"])

    # the CLI's --status path (a sync entry that runs its own event loop)
    def cli_status() -> int:
        try:
            cli_main(["projector", "--url", redis_url, "--prefix", s.prefix, "--status"])
        except SystemExit as e:
            return int(e.code or 0)
        return 0

    rc = await anyio.to_thread.run_sync(cli_status)
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["counters"]["processed"] == 3
    assert await p.fold("h0") == CURRENT
    # A consumer gone for consumer_ttl_ms with nothing pending is forgotten; live ones stay.
    feed0 = s.keys.feed(0)
    await s.client.execute_command("XGROUP", "CREATECONSUMER", feed0, "projector", "ghost")
    p.consumer_ttl_ms = 0
    await p.refresh_gauges()
    names = {c["name"] for sh in (await status(s))["shards"] for c in sh["consumers"]}
    assert "ghost" not in names and "metrics" in names


async def test_worker_on_a_cluster(cluster_url: str, prefix: str) -> None:
    s = RedisSessionStore.from_url(cluster_url, prefix=prefix, cluster=True)
    try:
        sids = [f"cl{i}" for i in range(6)]
        for sid in sids:
            await s.create(SessionHeader(id=sid), turn(1))  # a create with entries puts a hint too
            await s.put(sid, None, [cut(2, "x"), *turn(2)])
        await s.create(SessionHeader(id="clb", parent="cl0", at=5))
        await s.publish("session-branch", {"parent": "cl0", "session": "clb", "at": 5})
        p = Projector(s, consumer="c", block_ms=100)
        await drain(s, p)
        await assert_converged(s, [*sids, "clb"])
        st = await status(s)
        # one hint per create, put and branch, but a cluster's hints are coalesced per session
        # while they wait to be sent: between 7 (all coalesced) and 13
        assert 7 <= st["counters"]["processed"] <= 13 and st["pending"] == 0
    finally:
        await s.aclose()


async def test_session_recreated_during_a_fold_keeps_no_foreign_snapshot(
    redis_store: RedisSessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = redis_store
    await s.create(SessionHeader(id="r"), [*turn(1), *turn(2)])
    real_put = s.put_projection

    async def racing_put(session_id: str, n: int, state: bytes, **kw: Any) -> bool:
        # Between the worker's reads and its write the id is deleted and re-created (a longer log;
        # created_at may well be the same ms: the incarnation tells them apart, in proj.lua).
        await s.delete(session_id)
        await s.create(SessionHeader(id=session_id), [um("new") for _ in range(12)])
        return await real_put(session_id, n, state, **kw)

    monkeypatch.setattr(s, "put_projection", racing_put)
    p = Projector(s, consumer="w")
    assert await p.fold("r") == DELETED
    monkeypatch.undo()
    assert await s.get_projection("r") is None
    await drain(s, p)  # the new incarnation's own feed entry
    await assert_converged(s, ["r"])


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


# --------------------------------------------------------------------------- incarnations


async def test_a_fold_overlapping_delete_and_create_never_lands_in_the_new_session(
    redis_store: RedisSessionStore,
) -> None:
    s = redis_store
    await s.create(SessionHeader(id="x"), [*turn(0), *turn(1)])
    old = await s.head("x")
    assert old is not None
    # the projector's fold of the old log ...
    state, n = await load_messages(s, "x")
    # ... overlaps a delete + create of the id with a log of the same length
    await s.delete("x")
    await s.create(SessionHeader(id="x"), [*turn(7), *turn(8)])
    with pytest.raises(SessionReplacedError):  # proj.lua refuses it: a distinct return code
        await s.put_projection("x", n, state.to_bytes(), incarnation=old.header.incarnation)
    assert await s.get_projection("x") is None
    got, _ = await load_messages(s, "x")
    assert got.messages() == (await truth(s, "x"))[1]
    assert [m.text for m in got.messages()] == ["q7", "a7", "q8", "a8"]
    # the worker itself folds the new one
    p = Projector(s, consumer="w")
    assert await p.fold("x") == WRITTEN
    snap = await s.get_projection("x", incarnation=(await s.head("x")).header.incarnation)  # type: ignore[union-attr]
    assert snap is not None and ProjectionState.from_bytes(snap[1]).messages() == got.messages()


async def test_snapshot_cache_never_serves_another_incarnation(store: Any) -> None:
    born = (await store.create(SessionHeader(id="c"), [um("secret"), am("a0")])).header.created_at
    cache = SnapshotCache()
    state, n = await load_messages(store, "c", cache=cache)
    await store.put_projection("c", n, state.to_bytes())
    await load_messages(store, "c", cache=cache)
    assert "c" in cache
    await store.delete("c")
    # as a replace-import does: the same created_at and n, another log
    await store.create(SessionHeader(id="c", created_at=born), [um("clean"), am("a0")])
    got, n2 = await load_messages(store, "c", cache=cache)
    assert n2 == n and [m.text for m in got.messages()] == ["clean", "a0"]
    await store.put("c", None, [um("more")])
    got, _ = await load_messages(store, "c", cache=cache)
    assert [m.text for m in got.messages()] == ["clean", "a0", "more"]


async def test_snapshot_cache_counts_what_it_holds_as_it_grows() -> None:
    from redis_session import MemorySessionStore

    store = MemorySessionStore()
    cache = SnapshotCache(max_bytes=64 << 10, max_tail=10_000)
    for sid in ("a", "b"):
        await store.create(SessionHeader(id=sid), [um("hi")])
        state, n = await load_messages(store, sid)
        await store.put_projection(sid, n, state.to_bytes())  # a tiny snapshot (~100 B)
        await load_messages(store, sid, cache=cache)
    assert len(cache) == 2
    big = "x" * 4000
    for i in range(10):  # ~40 kB folded onto "a"'s cached state, never re-snapshotted
        await store.put("a", None, [am(big + str(i))])
        await load_messages(store, "a", cache=cache)
    assert cache.extended >= 10 and len(cache) == 2
    for i in range(10):  # "b" grows as much: together past the cap, "a" (least recently used) goes
        await store.put("b", None, [am(big + str(i))])
        await load_messages(store, "b", cache=cache)
    assert "a" not in cache and "b" in cache
    for i in range(10, 20):  # past the cap on its own: not kept at all
        await store.put("b", None, [am(big + str(i))])
        await load_messages(store, "b", cache=cache)
    assert len(cache) == 0


async def test_a_worker_starting_while_the_server_drops_its_connections_retries(
    redis_store: RedisSessionStore, redis_url: str
) -> None:
    """A projector started while the server closes client connections (CLIENT KILL every ms) died
    with "Connection closed by server" when that hit the creation of its groups, the server up
    all along: the groups are made inside the retried part of the loop now."""
    import redis.asyncio as aioredis

    s = redis_store
    await s.create(SessionHeader(id="dropped-start"), turn(0))
    killer = aioredis.Redis.from_url(redis_url)
    await killer.client_setname("killer")
    try:
        for attempt in range(5):
            p = Projector(s, consumer=f"drop-{attempt}", group=f"drop{attempt}", block_ms=50)
            failed: list[BaseException] = []

            async def run(p: Projector = p, failed: list[BaseException] = failed) -> None:
                try:
                    await p.run()
                except BaseException as e:  # what the CLI would print and exit on
                    failed.append(e)
                    raise

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run)
                    for _ in range(300):  # ~0.3 s of connections closed under the worker's start
                        await killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                        await anyio.sleep(0.001)
                    await wait_until(lambda p=p: p._groups_ready, within=60)
                    p.stop()
            assert not failed, failed
    finally:
        await killer.aclose()
