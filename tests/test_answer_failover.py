"""A streamed answer through a Redis Cluster failover (a master killed mid-answer on the local cluster):
3 masters + 3 replicas (node timeout 1 s), ``durability="replica"``. The master of the session's
slot is SIGKILLed mid-answer and restarted 3 s later (it rejoins as its successor's replica).
The writer goes on throughout; afterwards the log holds every delta once and in order (no row
duplicated or lost), the closing ``assistant/message`` and the live end record are written, and
a reader that followed the answer got each delta at most once and in order, with an explicit
`DeltaGap` for any the live stream lost (live records are not WAITed for: the rows are)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import anyio
import pytest

from redis_session import Delta, DeltaGap, DurabilityError, RedisSessionStore, SessionHeader, Sessions
from redis_session.live import follow_deltas
from redis_session.projection.chunks import CHUNK, replay
from redis_session.testing.localcluster import LocalCluster, command, start_cluster

pytestmark = [pytest.mark.anyio, pytest.mark.cluster]

DELTAS = 150


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    c = start_cluster(masters=3, replicas_per_master=1, node_timeout_ms=1000)
    try:
        yield c
    finally:
        c.stop()


def _replicas_synced(cluster: LocalCluster, timeout: float = 30.0) -> None:
    """Until every node that is a replica now (after failovers too) has its link to its master up."""
    deadline = time.monotonic() + timeout
    for node in cluster.nodes:
        while True:
            info = command(node.port, "INFO", "replication")
            if "role:master" in info or "master_link_status:up" in info:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the replica on port {node.port} did not sync")
            time.sleep(0.05)


def _slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


async def _one_round(cluster: LocalCluster, store: RedisSessionStore, sid: str) -> None:
    await store.create(
        SessionHeader(id=sid),
        [("turn/start", {"turn": 1}), ("user/message", {"content": "hi"}), ("step/start", {"turn": 1, "step": 1})],
    )
    s = await Sessions(store).open(sid)
    slot = _slot(store.keys.hdr(sid))
    victim = cluster.master_of_slot(slot)
    killed_mid_answer: list[bool] = []
    sent = [f"d{i} " for i in range(DELTAS)]
    got: list[Delta | DeltaGap] = []
    logged_some = anyio.Event()
    w = s.stream(turn=1, step=1, flush_interval=0.05, max_chunks=8)

    async def reader() -> None:
        async for item in follow_deltas(store, sid, 3):
            if isinstance(item, (Delta, DeltaGap)):
                got.append(item)
            elif item.type == CHUNK:
                logged_some.set()
            elif item.type == "assistant/message":
                return

    async def writer() -> None:
        with contextlib.suppress(DurabilityError):  # the message landed, its WAIT had no replica
            async with w:
                for i, t in enumerate(sent):
                    await w.delta(t)
                    await anyio.sleep(0.02)
                    if i == 40:
                        with anyio.fail_after(20):
                            await logged_some.wait()  # rows have landed: the kill is mid-answer

    async def killer() -> None:
        await logged_some.wait()
        await anyio.sleep(0.3)
        killed_mid_answer.append(not w._closed and w.count < DELTAS)
        victim.kill()
        await anyio.sleep(3.0)  # the replica takes over meanwhile; then the pod comes back
        await anyio.to_thread.run_sync(cluster.restart, victim)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(killer)
            await anyio.sleep(0.2)  # the reader is following
            await writer()
    cluster.wait_ok()
    assert killed_mid_answer == [True]
    assert cluster.master_of_slot(slot).port != victim.port  # the replica took over

    assert w.message is not None, "no closing message"
    entries = await store.read(sid)
    assert [e.n for e in entries] == list(range(len(entries)))
    texts = [c["text"] for c in replay(entries)[w.answer]]
    assert texts == sent, f"{len(texts)} deltas logged for {len(sent)} sent"  # none twice, none lost
    messages = [e for e in entries if e.type == "assistant/message"]
    assert len(messages) == 1 and messages[0].n == w.message.n
    assert messages[0].data["content"] == [{"type": "text", "text": "".join(sent)}]
    live = [r for r in await store.read_live(sid) if r.answer == w.answer]
    assert live and live[-1].kind == "end" and live[-1].reason == "committed" and live[-1].n == w.message.n
    assert live[-1].index == DELTAS
    # the reader: every index at most once, in order; what it did not get a gap names
    held: set[int] = set()
    nxt = 0
    for item in got:
        if isinstance(item, Delta):
            assert item.index >= nxt and item.index not in held, f"delta {item.index} twice or out of order"
            assert item.text == sent[item.index]
            held.add(item.index)
            nxt = item.index + 1
        else:
            stop = DELTAS if item.stop is None else item.stop
            held.update(range(item.start, stop))
            nxt = max(nxt, stop)
    assert held == set(range(DELTAS)), f"the reader missed {sorted(set(range(DELTAS)) - held)[:5]} silently"


async def test_a_master_killed_mid_answer_loses_and_duplicates_no_row(own_cluster: LocalCluster) -> None:
    store = RedisSessionStore.from_url(
        own_cluster.url, prefix=f"af{uuid.uuid4().hex[:6]}", cluster=True, durability="replica"
    )
    try:
        for round_ in range(2):
            own_cluster.wait_ok()
            await anyio.to_thread.run_sync(_replicas_synced, own_cluster)
            await _one_round(own_cluster, store, f"answer-{round_}-{time.monotonic_ns() % 10000}")
    finally:
        await store.aclose()
