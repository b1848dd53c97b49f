"""The projector's promise: a long session's context loads in the time of its messages, not its log.

    python bench/projector.py [--url URL] [--seconds N] [--entries N]

A session of 100 000 entries (90% ``assistant/chunk``, user/assistant messages among them, one cut
in the middle), written in batches of 1000; a projector worker folds it. Then, in interleaved
rounds on one server:
  (a) ``load_messages`` + ``messages()`` with a fresh snapshot  vs  (b) a full fold of the log read
      from Redis (``project(store.read(id))``)                   target: (b) / (a) >= 20
  (a) again                                                      vs  (c) one ``HGET`` of the
      snapshot alone (raw bytes)                                 target: (a) / (c) <= 2
  (d) ``HGET`` + ``ProjectionState.from_bytes`` (the decode (a) cannot avoid), for reference;
  (e) ``load_messages`` with a `SnapshotCache` that holds this snapshot (a reader loading the
      same session again before the projector rewrote it: no decode).
Then worker throughput: 800 sessions x 500 entries (batches of 50; each with a cut in its middle)
folded from scratch by 1 and by 2 worker processes (``python -m redis_session.cli projector``), timed
from the workers' first read until the group is drained (lag 0, nothing pending).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from _common import (
    Timer,
    bench_args,
    drop_prefix,
    interleave,
    print_table,
    server,
    settle_gc,
    unique_prefix,
)

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.projection import ProjectionState, project
from redis_session.projector import Projector, status
from redis_session.snapshots import SnapshotCache, load_messages

USER = "Please look at the failing test in the scheduler module and explain what goes wrong. " * 2
ANSWER = "The scheduler drops the last tick because the window is computed before the lock. " * 5


def big_session(total: int) -> list[NewEntry]:
    """`total` entries: turns of a user message, 18 chunks and an assistant message (90% chunks),
    and one cut in the middle that keeps the last few turns."""
    out: list[NewEntry] = []
    t = 0
    while len(out) < total:
        if len(out) >= total // 2 and not any(e.type == "cut" for e in out):
            out.append(
                NewEntry(
                    "cut",
                    {
                        "before": len(out) - 100,
                        "summary": [{"role": "user", "content": "Summary of the first half. " * 20}],
                        "reason": "compaction",
                    },
                )
            )
            continue
        t += 1
        out.append(NewEntry("user/message", {"content": f"[{t}] {USER}"}))
        out.extend(NewEntry("assistant/chunk", {"turn": t, "chunk": ANSWER[i * 20 : i * 20 + 20]}) for i in range(18))
        out.append(NewEntry("assistant/message", {"content": [{"type": "text", "text": f"[{t}] {ANSWER}"}]}))
    return out[:total]


async def read_side(url: str, seconds: float, total: int) -> list[list[Any]]:
    prefix = unique_prefix()
    store = RedisSessionStore.from_url(url, prefix=prefix)
    rows: list[list[Any]] = []
    try:
        await store.create(SessionHeader(id="big"))
        entries = big_session(total)
        t0 = time.perf_counter()
        for i in range(0, len(entries), 1000):
            await store.put("big", None, entries[i : i + 1000])
        build_s = time.perf_counter() - t0
        worker = Projector(store, consumer="bench")
        t0 = time.perf_counter()
        while (await status(store))["pending"] or (await status(store))["lag"]:
            await worker.run_once()
        fold_s = time.perf_counter() - t0
        got = await store.get_projection("big")
        assert got is not None and got[0] == total, got and got[0]
        snap_bytes = len(got[1])
        want = project(await store.read("big"))
        state, n = await load_messages(store, "big")
        assert n == total and state.messages() == want
        proj_key = store.keys.proj("big")
        client = store.client
        settle_gc()

        async def loaded() -> None:
            state, _ = await load_messages(store, "big")
            state.messages()

        cache = SnapshotCache()

        async def loaded_warm() -> None:
            state, _ = await load_messages(store, "big", cache=cache)
            state.messages()

        # a reader that holds the state from 10 entries ago (the projector has moved on since)
        older = ProjectionState()
        older.extend(await store.read("big", 0, total - 10))
        incarnation = (await store.head("big")).header.incarnation  # type: ignore[union-attr]
        behind = SnapshotCache()

        async def loaded_behind() -> None:
            behind.put("big", b"an older snapshot", older, incarnation)
            state, _ = await load_messages(store, "big", cache=behind)
            state.messages()

        async def full() -> None:
            project(await store.read("big"))

        async def hget() -> None:
            await client.execute_command("HGET", proj_key, "state", NEVER_DECODE=True)

        async def hget_decode() -> None:
            blob = await client.execute_command("HGET", proj_key, "state", NEVER_DECODE=True)
            ProjectionState.from_bytes(blob).messages()

        a, b = Timer("load_messages (fresh snapshot)"), Timer("full fold of the log")
        await interleave([(a, loaded), (b, full)], seconds, warmup_ops=2)
        a2, c, d = Timer("load_messages (fresh snapshot)"), Timer("HGET snapshot"), Timer("HGET + from_bytes")
        w = Timer("load_messages, SnapshotCache hit")
        bh = Timer("load_messages, cache 10 entries behind")
        await interleave(
            [(a2, loaded), (w, loaded_warm), (bh, loaded_behind), (c, hget), (d, hget_decode)], seconds, warmup_ops=5
        )
        print(
            f"session: {total:,} entries, {len(want):,} messages after the cut; written in "
            f"{build_s:.2f} s; first fold (rebuilt from the cut) {fold_s * 1000:.0f} ms; "
            f"snapshot {snap_bytes / 1024:.0f} KiB\n"
        )
        for t in (a, b, a2, w, bh, c, d):
            rows.append([t.name, t.median_ms, t.p(95), len(t.samples)])
        rows.append(["ratio full fold / load_messages (target >= 20)", b.median_ms / a.median_ms, "", ""])
        rows.append(["ratio load_messages / HGET (target <= 2)", a2.median_ms / c.median_ms, "", ""])
        rows.append(["ratio load_messages, cache hit / HGET", w.median_ms / c.median_ms, "", ""])
        rows.append(["ratio load_messages, cache 10 behind / HGET", bh.median_ms / c.median_ms, "", ""])
        rows.append(["ratio load_messages / HGET+decode", a2.median_ms / d.median_ms, "", ""])
    finally:
        await store.aclose()
        await drop_prefix(url, prefix)
    return rows


def spawn(url: str, prefix: str, consumer: str) -> subprocess.Popen[bytes]:
    """A worker process, as `redis-session projector` runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = ["--url", url, "--prefix", prefix, "--consumer", consumer]
    return subprocess.Popen([sys.executable, "-m", "redis_session.cli", "projector", *args], env=env)


async def throughput(url: str, sessions: int, per: int, workers: int) -> list[Any]:
    prefix = unique_prefix()
    store = RedisSessionStore.from_url(url, prefix=prefix)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        one = big_session(per)
        for i in range(sessions):
            await store.create(SessionHeader(id=f"s{i}"))
            for k in range(0, per, 50):
                await store.put(f"s{i}", None, one[k : k + 50])
        feed = (await status(store))["lag"]
        procs.extend(spawn(url, prefix, f"w{w}") for w in range(workers))
        start = None
        with anyio.fail_after(600):
            while True:
                st = await status(store)
                if start is None and st["lag"] < feed:
                    start = time.perf_counter()
                if start is not None and st["lag"] == 0 and st["pending"] == 0:
                    break
                await anyio.sleep(0.05)
        elapsed = time.perf_counter() - (start or time.perf_counter())
        for i in range(sessions):
            got = await store.get_projection(f"s{i}")
            assert got is not None and got[0] == per
        total = sessions * per
        return [f"{workers} worker(s)", total / elapsed, feed / elapsed, sessions / elapsed, elapsed]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        await store.aclose()
        await drop_prefix(url, prefix)


async def main(url: str, seconds: float, total: int, sessions: int) -> None:
    rows = await read_side(url, seconds, total)
    print_table(["loading a session's context", "median ms", "p95 ms", "ops"], rows)
    print()
    trows = [await throughput(url, sessions, 500, w) for w in (1, 2)]
    print_table(["worker throughput", "entries/s", "feed entries/s", "sessions/s", "seconds"], trows)


if __name__ == "__main__":
    p = bench_args("load_messages vs a full fold; projector worker throughput", seconds=4.0)
    p.add_argument("--entries", type=int, default=100_000, help="entries of the long session")
    p.add_argument("--sessions", type=int, default=800, help="sessions of 500 entries for the throughput runs")
    args = p.parse_args()
    with server(args.url) as url:
        anyio.run(main, url, args.seconds, args.entries, args.sessions)
