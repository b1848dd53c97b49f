"""Cluster writes follow the topology (failover, slot migration, a lost reply: docs/design.md, "Redis
Cluster"), each on a private local cluster.

The stores here only write (no read before the assertions): reads go through redis-py's own
routing, which repairs its slot table by itself, so a read in between would hide a write path that
does not follow the cluster. Covered: a SIGKILL failover, a completed slot migration (MOVED), a
migration in progress (ASK, and TRYAGAIN while the slot is split), and a reply lost after the
write (never resent without an idempotency key; the next call works).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import redis
from redis.exceptions import RedisError

from redis_session import NewEntry, RedisSessionStore, SessionError, SessionHeader, StoreUnavailableError
from redis_session.projection.chunks import LiveRecord
from redis_session.redis.embedded import ServerProcess
from redis_session.testing.localcluster import LocalCluster, command, start_cluster

from support import wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.cluster]


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    c = start_cluster(masters=3, replicas_per_master=1, node_timeout_ms=1000)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def two_replica_cluster() -> Iterator[LocalCluster]:
    """Two replicas per master: after a failover the shard still has a replica, so appends with
    ``durability="replica"`` are acknowledged again as soon as the new master takes over."""
    c = start_cluster(masters=3, replicas_per_master=2, node_timeout_ms=1000)
    try:
        yield c
    finally:
        c.stop()


def _slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


def _mark(m: str) -> NewEntry:
    return NewEntry("custom/mark", {"m": m})


def _node(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=5)


def _asking(port: int, *args: Any) -> Any:
    """One command on the importing node of a migration (it serves the slot only after ASKING)."""
    pipe = _node(port).pipeline(transaction=False)
    pipe.execute_command("ASKING")
    pipe.execute_command(*args)
    return pipe.execute()[1]


def _replicas_of(cluster: LocalCluster, master: ServerProcess) -> list[ServerProcess]:
    out = []
    for r in cluster.replicas:
        info = command(r.port, "INFO", "replication")
        if f"master_port:{master.port}" in info:
            out.append(r)
    return out


def _wait_promoted(replicas: list[ServerProcess], timeout: float = 30.0) -> float:
    """Poll ROLE on `replicas` until one reports itself master; the monotonic time it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in replicas:
            try:
                if _is_master(r.port):
                    return time.monotonic()
            except (OSError, RedisError):
                pass
        time.sleep(0.02)
    raise AssertionError("no replica was promoted")


def _is_master(port: int) -> bool:
    return "role:master" in command(port, "INFO", "replication", timeout=0.5)


def _other_master(cluster: LocalCluster, node: ServerProcess) -> ServerProcess:
    return next(m for m in cluster.masters if m is not node)


async def test_writer_only_process_resumes_after_a_failover(two_replica_cluster: LocalCluster) -> None:
    cluster = two_replica_cluster
    prefix = f"t{uuid.uuid4().hex[:6]}"
    opts: dict[str, Any] = {"prefix": prefix, "cluster": True, "durability": "replica", "wait_timeout_ms": 500}
    # Used for put only, and without change-feed hints: those go through redis-py's pipeline,
    # whose own error handling reloads the topology and would hide a script path that does not.
    writer = RedisSessionStore.from_url(cluster.url, feed=False, **opts)
    checker = RedisSessionStore.from_url(cluster.url, **opts)
    sids = [f"w{i}" for i in range(6)]
    acked: dict[str, list[tuple[str, float]]] = {sid: [] for sid in sids}
    try:
        for sid in sids:
            await checker.create(SessionHeader(id=sid))
        victim = cluster.master_of_slot(_slot(writer.keys.hdr(sids[0])))
        affected = [sid for sid in sids if cluster.master_of_slot(_slot(writer.keys.hdr(sid))) is victim]
        replicas = _replicas_of(cluster, victim)
        assert len(replicas) == 2
        times: dict[str, float] = {}
        hard_stop = time.monotonic() + 50.0

        def writing() -> bool:  # until 5 s after the promotion (a loaded machine promotes late)
            promoted = times.get("promoted")
            return time.monotonic() < (hard_stop if promoted is None else min(hard_stop, promoted + 5.0))

        async def write(sid: str) -> None:
            i = 0
            while writing():
                marker, key = f"{sid}-{i}", f"k-{sid}-{i}"
                while time.monotonic() < hard_stop:  # retry with the same key until acknowledged
                    try:
                        await writer.put(sid, None, [_mark(marker)], idempotency_key=key)
                    except (SessionError, RedisError, OSError):
                        await anyio.sleep(0.05)
                        continue
                    acked[sid].append((marker, time.monotonic()))
                    break
                i += 1

        async def kill() -> None:
            await anyio.sleep(1.5)
            times["kill"] = time.monotonic()
            victim.kill()
            times["promoted"] = await anyio.to_thread.run_sync(_wait_promoted, replicas)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for sid in sids:
                    tg.start_soon(write, sid)
                tg.start_soon(kill)
        failover = times["promoted"] - times["kill"]
        for sid in affected:
            after = [t for _, t in acked[sid] if t > times["promoted"]]
            assert after, f"{sid}: no append acknowledged after the failover"
            resumed = after[0] - times["promoted"]
            print(f"{sid}: failover {failover:.2f}s, first append {resumed:.2f}s after promotion")
            # promptly (a writer that never reloads its topology would not resume at all), with room
            # for a loaded machine
            assert resumed <= 4.0, f"{sid}: first append {resumed:.2f}s after promotion (failover {failover:.2f}s)"
        for sid in sids:
            markers = [e.data["m"] for e in await checker.read(sid)]
            assert len(markers) == len(set(markers)), f"{sid}: duplicated entries"
            missing = {m for m, _ in acked[sid]} - set(markers)
            assert not missing, f"{sid}: acknowledged appends lost: {sorted(missing)[:5]}"
    finally:
        await writer.aclose()
        await checker.aclose()


async def test_writes_follow_a_completed_slot_migration(own_cluster: LocalCluster) -> None:
    store = RedisSessionStore.from_url(own_cluster.url, prefix=f"m{uuid.uuid4().hex[:6]}", cluster=True)
    try:
        await store.create(SessionHeader(id="mig"))
        await store.put("mig", 0, [_mark("a")], idempotency_key="ka")
        slot = _slot(store.keys.hdr("mig"))
        source = own_cluster.master_of_slot(slot)
        target = _other_master(own_cluster, source)
        await anyio.to_thread.run_sync(own_cluster.migrate_slot, slot, target)

        t0 = time.monotonic()
        [b] = await store.put("mig", 1, [_mark("b")])  # no read since the migration
        assert time.monotonic() - t0 < 5.0  # at once, not after a topology refresh (room for load)
        [c] = await store.put("mig", None, [_mark("c")])
        assert (b.n, c.n) == (1, 2)
        # the writes landed on the new owner, and redis-py's table (which reads use) agrees
        assert _node(target.port).xlen(store.keys.log("mig")) == 3
        assert command(source.port, "CLUSTER", "COUNTKEYSINSLOT", str(slot)) == "0"
        owner = store.client.nodes_manager.slots_cache[slot][0]
        assert owner.port == target.port
        assert [e.data["m"] for e in await store.read("mig")] == ["a", "b", "c"]
    finally:
        await store.aclose()


async def test_writes_during_a_slot_migration(own_cluster: LocalCluster) -> None:
    store = RedisSessionStore.from_url(own_cluster.url, prefix=f"a{uuid.uuid4().hex[:6]}", cluster=True)
    try:
        # "full" has every key its append names (hdr, log, idem, proj, draft, kids, lease, live), so
        # the importing node runs the append after ASKING; "lean" has only hdr and log.
        await store.create(SessionHeader(id="full"))
        await store.put("full", 0, [_mark("a")], idempotency_key="ka")
        await store.set_draft("full", {"text": "draft 1"})
        assert await store.put_projection("full", 1, b"{}")
        assert await store.acquire_lease("full", "tok", 60_000)
        await store.live_add("full", [LiveRecord(answer="a1", kind="begin")], expire_ms=60_000)
        await store.create(SessionHeader(id="full-kid", parent="full", at=1))
        await store.create(SessionHeader(id="lean"))
        await store.put("lean", 0, [_mark("a")])
        slot = _slot(store.keys.hdr("full"))
        assert _slot(store.keys.hdr("lean")) != slot
        source = own_cluster.master_of_slot(slot)
        target = _other_master(own_cluster, source)
        await anyio.to_thread.run_sync(own_cluster.begin_migration, slot, target)
        moved = await anyio.to_thread.run_sync(own_cluster.move_keys, slot, source, target)
        assert moved >= 8

        # ASK: ASKING + the script in one write to the importing node, at once
        t0 = time.monotonic()
        await store.set_draft("full", {"text": "draft 2"})
        [b] = await store.put("full", 1, [_mark("b")])
        assert b.n == 1
        assert time.monotonic() - t0 < 5.0  # at once (room for a loaded machine)
        assert _asking(target.port, "XLEN", store.keys.log("full")) == 2
        assert b"draft 2" in _asking(target.port, "GET", store.keys.draft("full"))
        # the source still owns the slot until the migration is finished: the table is unchanged
        assert store.client.nodes_manager.slots_cache[slot][0].port == source.port

        # A session whose keys are split mid-migration (its header already moved, its log not
        # yet): the source answers TRYAGAIN to a multi-key script until every key is on one side;
        # the append waits for that, then lands.
        lean_slot = _slot(store.keys.hdr("lean"))
        lean_source = own_cluster.master_of_slot(lean_slot)
        lean_target = _other_master(own_cluster, lean_source)
        await anyio.to_thread.run_sync(own_cluster.begin_migration, lean_slot, lean_target)
        moved = await anyio.to_thread.run_sync(
            lambda: own_cluster.move_keys(lean_slot, lean_source, lean_target, [store.keys.hdr("lean")])
        )
        assert moved == 1
        done: dict[str, Any] = {}

        async def append() -> None:
            done["entries"] = await store.put("lean", 1, [_mark("b")])
            done["at"] = time.monotonic()

        async with anyio.create_task_group() as tg:
            tg.start_soon(append)
            await anyio.sleep(1.0)
            assert "entries" not in done
            finished = time.monotonic()
            await anyio.to_thread.run_sync(own_cluster.move_keys, lean_slot, lean_source, lean_target)
            await anyio.to_thread.run_sync(own_cluster.finish_migration, lean_slot, lean_target)
        assert done["entries"][0].n == 1
        assert done["at"] - finished < 5.0  # soon after the slot settles (room for a loaded machine)
        assert _node(lean_target.port).xlen(store.keys.log("lean")) == 2

        await anyio.to_thread.run_sync(own_cluster.finish_migration, slot, target)
        [c] = await store.put("full", None, [_mark("c")])
        assert c.n == 2
        assert [e.data["m"] for e in await store.read("full")] == ["a", "b", "c"]
    finally:
        await store.aclose()


async def test_a_lost_reply_is_not_resent_and_the_next_put_works(own_cluster: LocalCluster) -> None:
    store = RedisSessionStore.from_url(own_cluster.url, prefix=f"l{uuid.uuid4().hex[:6]}", cluster=True)
    try:
        await store.create(SessionHeader(id="lost"))
        # several pooled connections to the owner, all of which the kill below closes
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(store.put, "lost", None, [_mark(f"warm{i}")])
        owner = own_cluster.master_of_slot(_slot(store.keys.hdr("lost")))
        admin = _node(owner.port)
        admin.execute_command("CLIENT", "PAUSE", "60000", "WRITE")  # until UNPAUSE below
        try:
            failure: dict[str, BaseException] = {}

            async def doomed() -> None:
                try:
                    await store.put("lost", None, [_mark("doomed")])
                except BaseException as e:
                    failure["e"] = e

            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed)
                with anyio.fail_after(30):
                    while True:  # until the put's EVALSHA is held by the pause
                        if b"cmd=evalsha" in admin.execute_command("CLIENT", "LIST", "TYPE", "normal"):
                            break
                        await anyio.sleep(0.02)
                # the script was sent and is held by the pause: drop every client connection
                admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                # the put fails with its connection; one resent instead would be held by the pause
                await wait_for(lambda: "e" in failure, within=30)
            assert isinstance(failure["e"], StoreUnavailableError)
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        await anyio.sleep(0.2)
        [after] = await store.put("lost", None, [_mark("after")])  # no read in between
        assert after.n == 4
        markers = [e.data["m"] for e in await store.read("lost")]
        assert "doomed" not in markers
        assert markers[-1] == "after" and len(markers) == 5
    finally:
        await store.aclose()
