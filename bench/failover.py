"""Write unavailability across SIGKILL failovers, and what happens to acknowledged appends.

    python bench/failover.py [--rounds 5] [--sessions 24] [--node-timeout-ms 1000]

A private local cluster (3 masters, 2 replicas each, ``cluster-node-timeout`` as given) takes
continuous appends: one writer task per session, each appending one entry at a time with
``durability="replica"`` and an idempotency key, retrying the same key until it is acknowledged.
Each round SIGKILLs the master of one session's slot, waits for a replica to take over (ROLE
polled every 20 ms), lets every writer on the killed shard resume, then restarts the killed node
(it rejoins as a replica of its successor) before the next round.

Per failover it reports: the cluster's own failover time (kill until the replica reports itself
master), the write unavailability window (kill until the first acknowledged append, among appends
called after the kill, on the killed shard) and the time until every writer of that shard was
acknowledged again. At the end every log is read back: acknowledged appends missing (lost) or
present twice (duplicated) are counted; both must be 0. Two replicas per shard so that WAIT still
has a replica right after the promotion.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
from redis.exceptions import RedisError

sys.path.insert(0, str(Path(__file__).resolve().parent))

from redis_session import NewEntry, RedisSessionStore, SessionError, SessionHeader
from redis_session.testing.localcluster import LocalCluster, command, start_cluster


def slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


def replicas_of(cluster: LocalCluster, port: int) -> list[Any]:
    out = []
    for node in cluster.nodes:
        if node.port == port:
            continue
        try:
            if f"master_port:{port}\r" in command(node.port, "INFO", "replication", timeout=1):
                out.append(node)
        except (OSError, RedisError):
            pass
    return out


def wait_promoted(replicas: list[Any], timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in replicas:
            try:
                if "role:master" in command(r.port, "INFO", "replication", timeout=0.5):
                    return time.monotonic()
            except (OSError, RedisError):
                pass
        time.sleep(0.02)
    raise RuntimeError("no replica was promoted")


def wait_synced(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while "master_link_status:up" not in command(port, "INFO", "replication"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"restarted node {port} did not sync")
        time.sleep(0.05)


async def main(args: argparse.Namespace, cluster: LocalCluster) -> None:
    prefix = f"fo{uuid.uuid4().hex[:6]}"
    opts: dict[str, Any] = {"prefix": prefix, "cluster": True, "durability": "replica", "wait_timeout_ms": 500}
    store = RedisSessionStore.from_url(cluster.url, feed=not args.no_feed, **opts)
    ids = [f"s{i}" for i in range(args.sessions)]
    for sid in ids:
        await store.create(SessionHeader(id=sid))
    # per session: (marker, when the acknowledged put call started, when it returned)
    acked: dict[str, list[tuple[str, float, float]]] = {sid: [] for sid in ids}
    errors = 0
    stop = anyio.Event()

    async def writer(sid: str) -> None:
        nonlocal errors
        i = 0
        while not stop.is_set():
            marker = f"{sid}-{i}"
            while True:
                t0 = time.monotonic()
                try:
                    await store.put(sid, None, [NewEntry("custom/mark", {"m": marker})], idempotency_key=f"k-{marker}")
                except (SessionError, RedisError, OSError):
                    errors += 1
                    await anyio.sleep(0.05)
                    continue
                acked[sid].append((marker, t0, time.monotonic()))
                break
            i += 1

    rows: list[tuple[float, float, float, float]] = []
    async with anyio.create_task_group() as tg:
        for sid in ids:
            tg.start_soon(writer, sid)
        for rnd in range(args.rounds):
            await anyio.sleep(args.gap)
            target = ids[rnd % len(ids)]
            victim = await anyio.to_thread.run_sync(cluster.master_of_slot, slot(store.keys.hdr(target)))
            replicas = await anyio.to_thread.run_sync(replicas_of, cluster, victim.port)
            affected = []
            for sid in ids:
                owner = await anyio.to_thread.run_sync(cluster.master_of_slot, slot(store.keys.hdr(sid)))
                if owner is victim:
                    affected.append(sid)
            t_kill = time.monotonic()
            victim.kill()
            t_promoted = await anyio.to_thread.run_sync(wait_promoted, replicas)
            resumed: dict[str, float] = {}
            with anyio.fail_after(60):
                while len(resumed) < len(affected):
                    for sid in affected:
                        # an append called after the kill (a reply already on its way does not count)
                        after = [t for _, start, t in acked[sid] if start > t_kill]
                        if after and sid not in resumed:
                            resumed[sid] = after[0]
                    await anyio.sleep(0.02)
            first, last = min(resumed.values()) - t_kill, max(resumed.values()) - t_kill
            rows.append((t_promoted - t_kill, first, last, first - (t_promoted - t_kill)))
            print(
                f"round {rnd + 1}: killed :{victim.port} ({len(affected)} sessions on it), failover "
                f"{t_promoted - t_kill:.2f}s, first ack {first:.2f}s, all resumed {last:.2f}s after the kill",
                flush=True,
            )
            new = await anyio.to_thread.run_sync(cluster.restart, victim)
            await anyio.to_thread.run_sync(cluster.wait_ok)
            await anyio.to_thread.run_sync(wait_synced, new.port)
        await anyio.sleep(1.0)
        stop.set()

    checker = RedisSessionStore.from_url(cluster.url, **opts)
    lost = dup = total = 0
    try:
        for sid in ids:
            markers = [e.data["m"] for e in await checker.read(sid)]
            dup += len(markers) - len(set(markers))
            present = set(markers)
            lost += sum(1 for m, _, _ in acked[sid] if m not in present)
            total += len(acked[sid])
    finally:
        await checker.aclose()
        await store.aclose()

    def med_max(i: int) -> str:
        vals = [r[i] for r in rows]
        return f"median {statistics.median(vals):.2f}s, max {max(vals):.2f}s"

    print()
    print(f"{args.rounds} SIGKILL failovers, cluster-node-timeout {args.node_timeout_ms} ms, {len(ids)} writers")
    print(f"cluster failover time (kill -> replica is master):   {med_max(0)}")
    print(f"write unavailability (kill -> first ack on shard):   {med_max(1)}")
    print(f"every writer of the shard acknowledged again:        {med_max(2)}")
    print(f"first ack after the promotion:                       {med_max(3)}")
    print(f"acknowledged appends: {total}, lost {lost}, duplicated {dup}; failed attempts retried: {errors}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--gap", type=float, default=2.0, help="seconds of steady writing before each kill")
    p.add_argument("--node-timeout-ms", type=int, default=1000)
    p.add_argument("--no-feed", action="store_true", help="no change-feed hints (the writers' only traffic is scripts)")
    a = p.parse_args()
    cl = start_cluster(masters=3, replicas_per_master=2, node_timeout_ms=a.node_timeout_ms)
    try:
        anyio.run(main, a, cl)
    finally:
        cl.stop()
