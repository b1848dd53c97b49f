"""Redis Cluster failover and durability, on a private local cluster (3 masters + 3 replicas).

A master is SIGKILLed during appends. Writers use `durability="replica"` (WAIT for one replica)
and retry with their idempotency key on connection errors, so after the replica takes over every
acknowledged append is present exactly once and appends continue.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from redis.exceptions import RedisError

from redis_session import NewEntry, RedisSessionStore, SessionError, SessionHeader
from redis_session.testing.localcluster import LocalCluster, start_cluster

from support import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.cluster]


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    c = start_cluster(masters=3, replicas_per_master=1, node_timeout_ms=1000)
    try:
        yield c
    finally:
        c.stop()


def _slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


async def _put_retrying(store: RedisSessionStore, sid: str, entry: NewEntry, key: str, deadline: float) -> bool:
    """Retry one append with its idempotency key until it is acknowledged (or time runs out)."""
    while time.monotonic() < deadline:
        try:
            await store.put(sid, None, [entry], idempotency_key=key)
            return True
        except (SessionError, RedisError, OSError):
            await anyio.sleep(0.1)
    return False


async def test_failover_keeps_every_acknowledged_append_exactly_once(own_cluster: LocalCluster) -> None:
    prefix = f"f{uuid.uuid4().hex[:6]}"
    store = RedisSessionStore.from_url(own_cluster.url, prefix=prefix, cluster=True, durability="replica")
    sids = [f"s{i}" for i in range(6)]
    acked: dict[str, list[str]] = {sid: [] for sid in sids}
    try:
        for sid in sids:
            await store.create(SessionHeader(id=sid))
        slot = _slot(store.keys.hdr(sids[0]))
        victim = own_cluster.master_of_slot(slot)
        stop_at = time.monotonic() + 50.0  # moved up to 3 s after the restart, below

        def promoted() -> bool:
            try:
                return own_cluster.master_of_slot(slot) is not victim
            except Exception:  # no master serves the slot yet
                return False

        async def writer(sid: str) -> None:
            i = 0
            while time.monotonic() < stop_at:
                marker = f"{sid}-{i}"
                ok = await _put_retrying(
                    store, sid, NewEntry("custom/mark", {"m": marker}), f"k-{marker}", time.monotonic() + 20
                )
                if ok:
                    acked[sid].append(marker)
                i += 1

        async def killer() -> None:
            nonlocal stop_at
            await anyio.sleep(1.0)  # a pace: appends are flowing
            victim.kill()
            # once a replica took over, the orchestrator restarts the pod: the old master rejoins
            # as the new master's replica, so the shard has a replica to WAIT for again
            await anyio.to_thread.run_sync(lambda: wait_until(promoted, within=45, what="the failover"))
            await anyio.to_thread.run_sync(own_cluster.restart, victim)
            stop_at = min(stop_at, time.monotonic() + 3.0)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for sid in sids:
                    tg.start_soon(writer, sid)
                tg.start_soon(killer)
        own_cluster.wait_ok()
        # appends continue on the promoted replica
        [after] = await store.put(sids[0], None, [NewEntry("custom/mark", {"m": "after"})])
        for sid in sids:
            entries = await store.read(sid)
            markers = [e.data["m"] for e in entries]
            assert [e.n for e in entries] == list(range(len(entries)))
            assert len(markers) == len(set(markers)), f"{sid}: duplicated entries"
            missing = set(acked[sid]) - set(markers)
            assert not missing, f"{sid}: acknowledged appends lost: {sorted(missing)[:5]}"
            assert acked[sid], f"{sid}: no append was acknowledged at all"
        assert after.data["m"] == "after"
        assert len(acked[sids[0]]) > 5
    finally:
        await store.aclose()


async def test_durability_replica_waits_for_a_replica(local_cluster: Any) -> None:
    prefix = f"d{uuid.uuid4().hex[:6]}"
    store = RedisSessionStore.from_url(local_cluster.url, prefix=prefix, cluster=True, durability="replica")
    try:
        await store.create(SessionHeader(id="d"))
        out = await store.put("d", 0, [NewEntry("custom/mark", {"x": 1})])
        assert out[0].n == 0
        # the entry is on the replica of the slot's master by the time put returned
        master = local_cluster.master_of_slot(_slot(store.keys.log("d")))
        replica = next(r for r in local_cluster.replicas if _replica_of(local_cluster, r.port) == master.port)
        import redis.asyncio as aioredis

        r = aioredis.Redis(port=replica.port)
        try:
            await r.execute_command("READONLY")
            assert await r.xlen(store.keys.log("d")) == 1
        finally:
            await r.aclose()
    finally:
        await store.aclose()


def _replica_of(cluster: LocalCluster, port: int) -> int | None:
    from redis_session.testing.localcluster import command

    info = command(port, "INFO", "replication")
    for line in info.splitlines():
        if line.startswith("master_port:"):
            return int(line.split(":")[1])
    return None
