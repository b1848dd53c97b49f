"""Appends/s over many sessions: a 3-master local Redis Cluster vs one node, same client count.

    python bench/cluster.py [--seconds 6] [--clients 32] [--sessions 600]

Both servers are valkey-server processes started here (the cluster from the embedded binary, see
`redis_session.testing.localcluster`). Each client task appends one ~300-byte entry at a time with
`expected_n=None` to sessions drawn round-robin from its own share; rounds alternate between the
two targets so machine noise hits both. On a 2-core machine the client, not the servers, is the
bottleneck, so expect the cluster to cost a little (routing) rather than scale: the point of the
cluster is capacity and failover, measured here for overhead.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import unique_prefix

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.redis.embedded import start_server
from redis_session.testing.localcluster import start_cluster

ENTRY = NewEntry("user/message", {"content": "x" * 280})


async def setup(store: RedisSessionStore, sessions: int) -> list[str]:
    ids = [f"s{i}" for i in range(sessions)]
    for sid in ids:
        await store.create(SessionHeader(id=sid))
    return ids


async def run(store: RedisSessionStore, ids: list[str], clients: int, seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal done
        mine = ids[k::clients]
        i = 0
        while time.perf_counter() < deadline:
            await store.put(mine[i % len(mine)], None, [ENTRY])
            i += 1
        done += i

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(clients):
            tg.start_soon(client, k)
    return done / (time.perf_counter() - start)


async def main(args: argparse.Namespace, single_url: str, cluster_url: str) -> None:
    prefix = unique_prefix()
    single = RedisSessionStore.from_url(single_url, prefix=prefix, client_options={"max_connections": 256})
    cluster = RedisSessionStore.from_url(cluster_url, prefix=prefix, cluster=True)
    try:
        ids_single = await setup(single, args.sessions)
        ids_cluster = await setup(cluster, args.sessions)
        rounds = 3
        per = args.seconds / (2 * rounds)
        totals = {"one node": [], "3-master cluster": []}
        for _ in range(rounds):
            totals["one node"].append(await run(single, ids_single, args.clients, per))
            totals["3-master cluster"].append(await run(cluster, ids_cluster, args.clients, per))
        base = sum(totals["one node"]) / rounds
        print(f"{args.clients} clients, {args.sessions} sessions, 1 entry per append, {rounds} interleaved rounds")
        print(f"{'target':<20}{'appends/s':>12}{'ratio':>8}")
        for name, vals in totals.items():
            avg = sum(vals) / rounds
            print(f"{name:<20}{avg:>12,.0f}{avg / base:>7.2f}x")
    finally:
        await single.aclose()
        await cluster.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--sessions", type=int, default=600)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rs-bench-") as d:
        one = start_server(d, appendonly=False)
        cl = start_cluster(masters=3, replicas_per_master=0)
        try:
            anyio.run(main, a, one.url, cl.url)
        finally:
            one.stop()
            cl.stop()
