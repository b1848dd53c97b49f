"""The archiver through Redis Cluster failovers (docs/design.md §9), on a private local
cluster (3 masters + 3 replicas, node timeout 1 s) and the local-folder cold tier.

Writers append with ``durability="replica"`` and retry with their idempotency key; archivers run
one-shot passes (``keep`` policy: every pass merges the small segment before it, so each commit
replaces an object) in a loop, retrying whatever fails. The master of some sessions' slots is
SIGKILLed inside the archiver's step hook: before the upload, between the upload and the
script, right after the script. After the replica takes over: every acknowledged entry of every
session is read exactly once and in order (whole, windows across the hot/cold boundary, `tail`
from 0), the doctor finds nothing, the sweep takes nothing a header names, and restore gives the
same entries back.

A replica lags by design (replication is asynchronous): the two ``lagging`` tests kill the master
right after an archive (a merge) or a restore whose script the replica never received. The
objects that commit replaced must not be deleted before the commit is on a replica, or the
promoted replica's header names segments that are gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
from redis.exceptions import RedisError

from redis_session import NewEntry, RedisSessionStore, SessionError, SessionHeader
from redis_session.archiver import Archiver, ArchiveWorker, Policy
from redis_session.cold import ColdTier
from redis_session.doctor import doctor
from redis_session.errors import ColdSegmentError
from redis_session.redis.embedded import ServerProcess
from redis_session.testing.localcluster import LocalCluster, command, start_cluster

pytestmark = [pytest.mark.anyio, pytest.mark.cluster]

T = TypeVar("T")
RETRYABLE = (SessionError, RedisError, OSError)


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    c = start_cluster(masters=3, replicas_per_master=1, node_timeout_ms=1000)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
async def cold_store(own_cluster: LocalCluster, tmp_path: Path) -> AsyncIterator[tuple[RedisSessionStore, str]]:
    prefix = f"af{uuid.uuid4().hex[:6]}"
    folder = str(tmp_path / "cold")
    store = RedisSessionStore.from_url(
        own_cluster.url, prefix=prefix, cluster=True, durability="replica", cold=ColdTier(folder, prefix=prefix)
    )
    try:
        yield store, folder
    finally:
        await store.aclose()


def _slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


def mark(m: str) -> NewEntry:
    return NewEntry("custom/mark", {"m": m})


def enc(entries: Any) -> bytes:
    return msgspec.json.encode(list(entries))


async def retrying(fn: Callable[[], Awaitable[T]], within: float = 45.0) -> T:
    """`fn()` until it answers: a failover refuses or cuts calls for a while. A missing or corrupt
    segment is never retried (that is the loss these tests look for)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await fn()
        except ColdSegmentError:
            raise
        except RETRYABLE:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.1)


def alive_ports(cluster: LocalCluster, dead: ServerProcess | None) -> list[int]:
    return [n.port for n in cluster.nodes if n is not dead]


def replica_of(cluster: LocalCluster, master: ServerProcess) -> ServerProcess:
    for node in cluster.nodes:
        if node is master:
            continue
        with contextlib.suppress(OSError, RedisError):
            info = command(node.port, "INFO", "replication")
            if f"master_port:{master.port}\r" in info or f"master_port:{master.port}\n" in info:
                return node
    raise AssertionError(f"no replica follows port {master.port}")


def wait_failed_over(cluster: LocalCluster, slot: int, dead: ServerProcess, timeout: float = 45.0) -> ServerProcess:
    """Until another node serves `slot` and every live node says the cluster is ok."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            now = cluster.master_of_slot(slot)
        except Exception:
            now = dead
        if now is not dead:
            cluster.wait_ok(timeout=max(1.0, deadline - time.monotonic()), ports=alive_ports(cluster, dead))
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"slot {slot} did not fail over from port {dead.port}")
        time.sleep(0.1)


def restart_as_replica(cluster: LocalCluster, dead: ServerProcess, timeout: float = 45.0) -> ServerProcess:
    """The killed master back (the orchestrator restarts it): it rejoins as its successor's
    replica; returns once its replication link is up, so WAIT can count it again."""
    node = cluster.restart(dead)
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, RedisError):
            info = command(node.port, "INFO", "replication")
            if "role:slave" in info and "master_link_status:up" in info:
                cluster.wait_ok(timeout=max(1.0, deadline - time.monotonic()))
                return node
        if time.monotonic() > deadline:
            raise AssertionError(f"restarted node on port {node.port} did not sync as a replica")
        time.sleep(0.1)


@contextlib.contextmanager
def replica_cut_off(cluster: LocalCluster, master: ServerProcess) -> Iterator[ServerProcess]:
    """The master's replica misses what the master runs from here on: it is stopped (SIGSTOP)
    and its replication link cut, so it cannot reconnect and nothing is left in flight for it.
    It runs again (SIGCONT) on leaving the block."""
    replica = replica_of(cluster, master)
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        command(master.port, "CLIENT", "KILL", "TYPE", "replica")
        yield replica
    finally:
        os.kill(replica.pid, signal.SIGCONT)


def victim_ids(store: RedisSessionStore, cluster: LocalCluster, count: int, others: int) -> tuple[list[str], list[str]]:
    """`count` session ids whose slots one master serves (the victim's), `others` elsewhere."""
    first = "v0"
    victim = cluster.master_of_slot(_slot(store.keys.hdr(first)))
    on, off = [first], []
    i = 1
    while len(on) < count or len(off) < others:
        sid = f"v{i}"
        i += 1
        if cluster.master_of_slot(_slot(store.keys.hdr(sid))) is victim:
            if len(on) < count:
                on.append(sid)
        elif len(off) < others:
            off.append(sid)
    return on, off


async def check_session(store: RedisSessionStore, sid: str, expected: list[str]) -> list[Any]:
    """Every entry exactly once and in order, by every reader; the doctor finds nothing."""
    entries = await retrying(lambda: store.read(sid))
    markers = [e.data["m"] for e in entries]
    assert [e.n for e in entries] == list(range(len(entries))), f"{sid}: the log's n are not 0..n-1"
    assert len(markers) == len(set(markers)), f"{sid}: duplicated entries"
    assert markers == expected, (
        f"{sid}: the log is not the acknowledged entries in order: "
        f"missing {sorted(set(expected) - set(markers))[:5]}, extra {sorted(set(markers) - set(expected))[:5]}"
    )
    head = await store.head(sid)
    assert head is not None and head.n == len(entries)
    state = await store.cold_state(sid)
    assert state is not None
    lo = state.own_start
    for seg in state.cold:  # the archived ranges tile [0, hot start): nothing archived twice
        assert seg.lo == lo and seg.hi > seg.lo, f"{sid}: segments {state.cold}"
        lo = seg.hi
    h = state.hot_start
    for a in range(max(0, h - 5), min(h + 2, len(entries)) + 1):
        for width in (1, 3, 8):
            got = await store.read(sid, a, a + width)
            assert enc(got) == enc(entries[a : a + width]), f"{sid}: window [{a}, {a + width}) across {h}"
    got_tail: list[Any] = []
    if entries:
        with anyio.fail_after(30):
            async for e in store.tail(sid, 0):
                got_tail.append(e)
                if e.n == len(entries) - 1:
                    break
    assert enc(got_tail) == enc(entries), f"{sid}: tail from 0"
    report = await doctor(store, sid)
    assert report.problems == [], f"{sid}: doctor: {report.problems}"
    return entries


def fresh(cluster: LocalCluster, prefix: str, folder: str) -> RedisSessionStore:
    """A store with a tier of its own (no segment cached by the processes under test)."""
    seed = next(n for n in cluster.nodes if _alive(n))  # the cluster's first master may be the dead one
    return RedisSessionStore.from_url(seed.url, prefix=prefix, cluster=True, cold=ColdTier(folder, prefix=prefix))


# ------------------------------------------------------------------ writers and archivers, three kills


STEPS = ["before_upload", "after_upload", "after_script"]


async def test_archiving_through_three_failovers_keeps_every_entry_once(
    own_cluster: LocalCluster, cold_store: tuple[RedisSessionStore, str]
) -> None:
    await storm(own_cluster, cold_store, STEPS)


@pytest.mark.slow
async def test_archiving_through_twelve_failovers_keeps_every_entry_once(
    own_cluster: LocalCluster, cold_store: tuple[RedisSessionStore, str]
) -> None:
    await storm(own_cluster, cold_store, STEPS * 4)


async def storm(own_cluster: LocalCluster, cold_store: tuple[RedisSessionStore, str], steps: list[str]) -> None:
    """Writers, two one-shot archiver loops and a worker on 6 sessions (3 on the victim's
    slots); the victim's current master is SIGKILLed at each of `steps` in turn (inside the
    archiver's hook, archiving one of those sessions), failed over, restarted as a replica."""
    store, folder = cold_store
    on, off = victim_ids(store, own_cluster, 3, 3)
    sids = on + off
    slot = _slot(store.keys.hdr(on[0]))
    acked: dict[str, list[str]] = {sid: [f"{sid}-init{j}" for j in range(6)] for sid in sids}
    for sid in sids:
        await retrying(lambda sid=sid: store.create(SessionHeader(id=sid), [mark(m) for m in acked[sid]]))

    plan = list(steps)  # where each kill lands
    kills: list[tuple[str, str]] = []  # (step, session) of each kill done
    armed: dict[str, Any] = {"target": own_cluster.master_of_slot(slot)}
    killed = anyio.Event()
    all_done = anyio.Event()
    stop_writers = anyio.Event()
    outcomes: dict[str, int] = {}

    def make_archiver() -> tuple[Archiver, dict[str, str]]:
        cur = {"sid": ""}

        async def hook(step: str) -> None:
            target = armed.get("target")
            if target is not None and cur["sid"] in on and plan and step == plan[0]:
                armed["target"] = None
                target.kill()  # SIGKILL, mid-archive
                kills.append((plan.pop(0), cur["sid"]))
                killed.set()

        return Archiver(store, hook=hook), cur

    async def writer(sid: str) -> None:
        i = 0
        while not stop_writers.is_set():
            m = f"{sid}-{i}"
            await retrying(lambda m=m: store.put(sid, None, [mark(m)], idempotency_key=f"k-{m}"), within=50)
            acked[sid].append(m)
            i += 1
            await anyio.sleep(0.02)

    async def archiver_loop() -> None:
        archiver, cur = make_archiver()
        while not stop_writers.is_set():
            for sid in sids:
                cur["sid"] = sid
                try:
                    res = await archiver.archive(sid, policy=Policy(keep=3))
                    outcomes[res.status] = outcomes.get(res.status, 0) + 1
                except ColdSegmentError:
                    raise
                except RETRYABLE as e:
                    outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
                    await anyio.sleep(0.05)
            await anyio.sleep(0.01)

    async def worker_loop() -> None:
        # the real worker beside the one-shot passes: change-feed driven, a `keep` policy per hint
        worker = ArchiveWorker(store, Policy(keep=3), consumer="w1", block_ms=200, claim_idle_ms=1_000)
        while not stop_writers.is_set():
            try:
                outcomes["worker-acked"] = outcomes.get("worker-acked", 0) + await worker.run_once()
            except RETRYABLE as e:
                outcomes[f"worker-{type(e).__name__}"] = outcomes.get(f"worker-{type(e).__name__}", 0) + 1
            await anyio.sleep(0.05)
        outcomes["worker-archived"] = int(worker.metrics.value("sessions_total", outcome="archived"))

    async def kill_cycle() -> None:
        nonlocal killed
        while True:
            await killed.wait()
            victim = next(n for n in own_cluster.nodes if not _alive(n))
            await anyio.to_thread.run_sync(wait_failed_over, own_cluster, slot, victim)
            await anyio.to_thread.run_sync(restart_as_replica, own_cluster, victim)
            await anyio.sleep(0.5)  # appends and archives on the new master before the next kill
            if not plan:
                break
            killed = anyio.Event()
            armed["target"] = await anyio.to_thread.run_sync(own_cluster.master_of_slot, slot)
        await anyio.sleep(0.5)
        all_done.set()

    with anyio.fail_after(60 * len(steps)):  # a hang guard only (a failover takes ~5 s here)
        async with anyio.create_task_group() as tg:
            for sid in sids:
                tg.start_soon(writer, sid)
            tg.start_soon(archiver_loop)
            tg.start_soon(archiver_loop)
            tg.start_soon(worker_loop)
            tg.start_soon(kill_cycle)
            await all_done.wait()
            stop_writers.set()
    assert [k[0] for k in kills] == steps, kills
    assert outcomes.get("archived", 0) > 10, outcomes

    # one more pass after the storm: every session has a hot/cold boundary to read across
    final = Archiver(store)
    for sid in sids:
        await retrying(lambda sid=sid: final.archive(sid, policy=Policy(keep=3)))

    prefix = store.prefix
    reader = fresh(own_cluster, prefix, folder)
    try:
        logs = {sid: await check_session(reader, sid, acked[sid]) for sid in sids}
        for sid in sids:
            state = await reader.cold_state(sid)
            assert state is not None and state.cold, f"{sid}: nothing archived"
        # the sweep (no archiver runs now) takes orphans only: every session still reads whole
        await Archiver(reader, grace_ms=0).sweep()
        again = fresh(own_cluster, prefix, folder)
        try:
            for sid in sids:
                assert enc(await again.read(sid)) == enc(logs[sid]), f"{sid}: the sweep took a named segment"
            for sid in sids:
                res = await Archiver(again).restore(sid)
                assert res.status == "restored", res
                assert enc(await again.read(sid)) == enc(logs[sid]), f"{sid}: restore"
                state = await again.cold_state(sid)
                assert state is not None and not state.cold
                assert (await doctor(again, sid)).problems == []
        finally:
            await again.aclose()
    finally:
        await reader.aclose()


def _alive(node: ServerProcess) -> bool:
    try:
        os.kill(node.pid, 0)
    except ProcessLookupError:
        return False
    return node.proc is None or node.proc.poll() is None


# ------------------------------------------------------------------ a replica that lags


async def test_a_merge_the_replica_never_got_loses_nothing_on_failover(
    own_cluster: LocalCluster, cold_store: tuple[RedisSessionStore, str]
) -> None:
    store, folder = cold_store
    (sid,), _ = victim_ids(store, own_cluster, 1, 0)
    slot = _slot(store.keys.hdr(sid))
    ms = [f"e{i}" for i in range(30)]
    await store.create(SessionHeader(id=sid), [mark(m) for m in ms[:20]])
    first = await Archiver(store).archive(sid, upto=10)  # a small segment: the next pass merges it
    assert (first.status, first.lo, first.hi) == ("archived", 0, 10)
    await store.put(sid, 20, [mark(m) for m in ms[20:]])  # acknowledged by a replica
    master = own_cluster.master_of_slot(slot)
    cut: dict[str, Any] = {}

    async def hook(step: str) -> None:
        if step == "after_upload":  # the replica misses the script from here on
            cut["ctx"] = replica_cut_off(own_cluster, master)
            cut["ctx"].__enter__()
        elif step == "after_script":
            master.kill()
            cut.pop("ctx").__exit__(None, None, None)

    try:
        res = await Archiver(store, hook=hook).archive(sid, upto=25)  # [10, 25) merged with [0, 10)
    finally:
        if "ctx" in cut:
            cut.pop("ctx").__exit__(None, None, None)
    assert res.status in ("archived", "slow"), res
    await anyio.to_thread.run_sync(wait_failed_over, own_cluster, slot, master)
    reader = fresh(own_cluster, store.prefix, folder)
    try:
        await check_session(reader, sid, ms)
        await anyio.to_thread.run_sync(restart_as_replica, own_cluster, master)
        # the archiver goes on on the promoted replica: archived again, restored, the same entries
        again = await retrying(lambda: Archiver(store).archive(sid, upto=25))
        assert again.status == "archived", again
        await check_session(reader, sid, ms)
        assert (await Archiver(reader).restore(sid)).status == "restored"
        await check_session(reader, sid, ms)
    finally:
        await reader.aclose()


async def test_a_restore_the_replica_never_got_loses_nothing_on_failover(
    own_cluster: LocalCluster, cold_store: tuple[RedisSessionStore, str]
) -> None:
    store, folder = cold_store
    (sid,), _ = victim_ids(store, own_cluster, 1, 0)
    slot = _slot(store.keys.hdr(sid))
    ms = [f"e{i}" for i in range(30)]
    await store.create(SessionHeader(id=sid), [mark(m) for m in ms])
    assert (await Archiver(store).archive(sid, upto=20)).status == "archived"
    master = own_cluster.master_of_slot(slot)
    with replica_cut_off(own_cluster, master):
        res = await Archiver(store).restore(sid)  # the script runs on the master alone
        master.kill()
    assert res.status == "restored", res
    await anyio.to_thread.run_sync(wait_failed_over, own_cluster, slot, master)
    reader = fresh(own_cluster, store.prefix, folder)
    try:
        await check_session(reader, sid, ms)
        await anyio.to_thread.run_sync(restart_as_replica, own_cluster, master)
        assert (await retrying(lambda: Archiver(reader).restore(sid))).status in ("restored", "nothing")
        await check_session(reader, sid, ms)
    finally:
        await reader.aclose()


def _segments(folder: str) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*.jsonl.zst"))


async def test_a_delete_the_replica_never_got_keeps_the_segments_for_the_promoted_replica(
    own_cluster: LocalCluster, cold_store: tuple[RedisSessionStore, str]
) -> None:
    """A delete is a write like any other: until a replica has it, a failover can bring the
    session back, header and all, so its segment objects may not go yet (the sweep takes them
    once no header names them)."""
    store, folder = cold_store
    (sid,), _ = victim_ids(store, own_cluster, 1, 0)
    slot = _slot(store.keys.hdr(sid))
    ms = [f"e{i}" for i in range(30)]
    await store.create(SessionHeader(id=sid), [mark(m) for m in ms])
    assert (await Archiver(store).archive(sid, upto=20)).status == "archived"
    archived = _segments(folder)
    assert archived
    master = own_cluster.master_of_slot(slot)
    with replica_cut_off(own_cluster, master):
        assert await store.delete(sid) is True  # on the master alone
        assert _segments(folder) == archived  # not confirmed durable: left to the sweep
        master.kill()
    await anyio.to_thread.run_sync(wait_failed_over, own_cluster, slot, master)
    reader = fresh(own_cluster, store.prefix, folder)
    try:
        await check_session(reader, sid, ms)  # the promoted replica's session reads whole
        await anyio.to_thread.run_sync(restart_as_replica, own_cluster, master)
        assert await retrying(lambda: reader.delete(sid)) is True  # confirmed now: the objects go
        assert _segments(folder) == []
    finally:
        await reader.aclose()


async def test_a_purge_the_replica_never_got_keeps_the_parents_segments(
    own_cluster: LocalCluster, cold_store: tuple[RedisSessionStore, str]
) -> None:
    """Deleting the last branch of a deleted, archived parent purges the parent and its
    segments; a failover that loses that purge brings the branch back, and it must still read
    its inherited (archived) prefix."""
    store, folder = cold_store
    (parent, child), _ = victim_ids(store, own_cluster, 2, 0)
    slot = _slot(store.keys.hdr(parent))
    ms = [f"e{i}" for i in range(30)]
    await store.create(SessionHeader(id=parent), [mark(m) for m in ms])
    assert (await Archiver(store).archive(parent, upto=20)).status == "archived"
    await store.create(SessionHeader(id=child, parent=parent, at=25))
    assert await store.delete(parent) is True  # hidden: its branch still reads it
    archived = _segments(folder)
    assert archived
    master = own_cluster.master_of_slot(slot)
    with replica_cut_off(own_cluster, master):
        assert await store.delete(child) is True  # the parent is purged on the master alone
        assert _segments(folder) == archived
        master.kill()
    await anyio.to_thread.run_sync(wait_failed_over, own_cluster, slot, master)
    reader = fresh(own_cluster, store.prefix, folder)
    try:
        await check_session(reader, child, ms[:25])
    finally:
        await reader.aclose()
