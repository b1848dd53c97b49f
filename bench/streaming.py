"""Token streaming at scale: the streaming writer vs a raw XADD relay vs an entry per delta.

    python bench/streaming.py [--url URL] [--sessions 50 200] [--deltas 500] [--rate 50]

S concurrent answers (one session each), each `--deltas` deltas of 1-8 characters at ~`--rate`
deltas/s, with one tailing reader per answer that connects before the answer starts. Three
ways, one after the other on the same server, with the same deltas:

(raw)     each delta a plain ``XADD key * d <text>``; each reader an ``XREAD BLOCK`` loop on its key
          (the floor: what a bare relay costs);
(stream)  `Session.stream`: live records (plain XADD, pipelined) + packed ``assistant/chunk`` rows
          through lua/answer.lua every flush interval, the message with the end; readers are
          `live.follow_deltas` (deltas and entries in one XREAD on two keys);
(entries) what the demo did before: an ``assistant/chunk`` entry per delta (append.lua each), then
          the message; readers are `live.follow` (the memory baseline: one entry per delta).

Reported per way: Redis server CPU per delta (INFO commandstats usec of every command, the
readers' included, after CONFIG RESETSTAT, ÷ deltas; commands inside a script are counted in
its own usec and again on their own, so a way with scripts is overstated: the server process's
CPU, INFO cpu, is the other figure), memory per delta once every answer is committed (MEMORY
USAGE of every key of the run; for `stream` also after the live stream's grace expiry; and
"compact": each key as a DUMP + RESTORE copy, without the up to 4 KiB a stream's last node
holds preallocated, a cost per stream, not per delta), delivery latency to the reader
(p50/p99, from just before the writer hands the delta over to the moment the reader has it),
and completeness (every delta delivered once and in order to its reader; the log's replay
equals what was sent). The sessions are split over
`--procs` processes (writers and readers of a session in the same process, one clock).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anyio
import redis.asyncio as aioredis
from _common import drop_prefix, percentile, print_table, server, unique_prefix

from redis_session import Delta, RedisSessionStore, Sessions
from redis_session.live import follow, follow_deltas
from redis_session.projection.chunks import assemble, replay
from redis_session.streaming import DEFAULT_FLUSH_INTERVAL

GRACE = 2.0  # the live stream's expiry after an answer ends (the library's default is 30 s)


def deltas_for(sid: str, count: int) -> list[str]:
    rng = random.Random(sid)
    alphabet = "abcdefghijklmnopqrstuvwxyz      .,"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(count)]


class Tracker:
    """One answer: when each delta was handed over, when its reader got it, what it got."""

    def __init__(self, sid: str, deltas: list[str]) -> None:
        self.sid = sid
        self.deltas = deltas
        self.sent_at: list[float] = [0.0] * len(deltas)
        self.got: list[tuple[int, str, float]] = []
        self.done = anyio.Event()
        self.ready = anyio.Event()

    def receive(self, index: int, text: str) -> None:
        self.got.append((index, text, time.perf_counter()))
        if len(self.got) >= len(self.deltas):
            self.done.set()

    def latencies(self) -> list[float]:
        return [t - self.sent_at[i] for i, _, t in self.got if 0 <= i < len(self.sent_at)]

    def complete(self) -> bool:
        return [i for i, _, _ in self.got] == list(range(len(self.deltas))) and [g[1] for g in self.got] == self.deltas


# --------------------------------------------------------------------------- the three ways


async def _raw(url: str, prefix: str, trackers: list[Tracker], rate: float) -> bool:
    r = aioredis.Redis.from_url(url, max_connections=4 * len(trackers) + 8)

    async def reader(t: Tracker) -> None:
        key, last = f"{prefix}:{{{t.sid}}}:raw", "0-0"
        t.ready.set()
        while not t.done.is_set():
            resp = await r.xread({key: last}, count=1000, block=2000)
            for _, rows in resp or ():
                for rid, fields in rows:
                    t.receive(len(t.got), fields[b"d"].decode())
                    last = rid

    async def writer(t: Tracker) -> None:
        key = f"{prefix}:{{{t.sid}}}:raw"
        await anyio.sleep(random.random() / rate)
        for i, d in enumerate(t.deltas):
            t.sent_at[i] = time.perf_counter()
            await r.xadd(key, {"d": d})
            await anyio.sleep(1 / rate)

    try:
        await _run(trackers, reader, writer)
    finally:
        await r.aclose()
    return True


FLUSH = DEFAULT_FLUSH_INTERVAL  # the writer's flush_interval (the library's default); --flush changes it


async def _stream(url: str, prefix: str, trackers: list[Tracker], rate: float) -> bool:
    store = RedisSessionStore.from_url(url, prefix=prefix, client_options={"max_connections": 4 * len(trackers) + 8})
    sessions = Sessions(store)
    handles = {t.sid: await sessions.open(t.sid) for t in trackers}

    async def reader(t: Tracker) -> None:
        t.ready.set()
        async for item in follow_deltas(store, t.sid, handles[t.sid].n):
            if isinstance(item, Delta):
                t.receive(item.index, item.text)
            elif item.type == "assistant/message":
                return

    async def writer(t: Tracker) -> None:
        s = handles[t.sid]
        await anyio.sleep(random.random() / rate)
        async with s.stream(turn=1, step=1, grace=GRACE, flush_interval=FLUSH) as w:
            for i, d in enumerate(t.deltas):
                t.sent_at[i] = time.perf_counter()
                await w.delta(d)
                await anyio.sleep(1 / rate)

    try:
        await _run(trackers, reader, writer)
        ok = True
        for t in trackers:  # the log replays exactly what was sent, and the message is its text
            entries = await handles[t.sid].read()
            chunks = [c for cs in replay(entries).values() for c in cs]
            message = [e for e in entries if e.type == "assistant/message"]
            ok &= [c["text"] for c in chunks] == t.deltas
            ok &= len(message) == 1 and message[0].data["content"] == assemble(chunks)
        return ok
    finally:
        await store.aclose()


async def _entries(url: str, prefix: str, trackers: list[Tracker], rate: float) -> bool:
    store = RedisSessionStore.from_url(url, prefix=prefix, client_options={"max_connections": 4 * len(trackers) + 8})
    sessions = Sessions(store)
    handles = {t.sid: await sessions.open(t.sid) for t in trackers}

    async def reader(t: Tracker) -> None:
        t.ready.set()
        i = 0
        async for e in follow(store, t.sid, handles[t.sid].n):
            if e.type == "assistant/chunk":
                t.receive(i, e.data["chunk"]["text"])
                i += 1
            elif e.type == "assistant/message":
                return

    async def writer(t: Tracker) -> None:
        s = handles[t.sid]
        await anyio.sleep(random.random() / rate)
        for i, d in enumerate(t.deltas):
            t.sent_at[i] = time.perf_counter()
            await s.append("assistant/chunk", {"turn": 1, "step": 1, "chunk": {"type": "text-delta", "text": d}})
            await anyio.sleep(1 / rate)
        await s.append(
            "assistant/message", {"turn": 1, "step": 1, "content": [{"type": "text", "text": "".join(t.deltas)}]}
        )

    try:
        await _run(trackers, reader, writer)
        return True
    finally:
        await store.aclose()


async def _run(trackers: list[Tracker], reader: Any, writer: Any) -> None:
    async with anyio.create_task_group() as tg:
        for t in trackers:
            tg.start_soon(reader, t)
        for t in trackers:
            await t.ready.wait()
        await anyio.sleep(0.3)  # readers are blocked in XREAD by now
        async with anyio.create_task_group() as writers:
            for t in trackers:
                writers.start_soon(writer, t)
        with anyio.move_on_after(30):
            for t in trackers:
                await t.done.wait()
        tg.cancel_scope.cancel()


WAYS = {"raw": _raw, "stream": _stream, "entries": _entries}


async def run_sessions(
    url: str, prefix: str, way: str, sids: list[str], deltas: int, rate: float, flush: float = DEFAULT_FLUSH_INTERVAL
) -> dict[str, Any]:
    """One process's share of a run: its answers, their readers; latencies and completeness."""
    global FLUSH
    FLUSH = flush
    trackers = [Tracker(sid, deltas_for(sid, deltas)) for sid in sids]
    started = time.perf_counter()
    log_ok = await WAYS[way](url, prefix, trackers, rate)
    return {
        "latencies": [x for t in trackers for x in t.latencies()],
        "complete": all(t.complete() for t in trackers),
        "incomplete": [t.sid for t in trackers if not t.complete()],
        "log_ok": log_ok,
        "deltas": sum(len(t.deltas) for t in trackers),
        "seconds": time.perf_counter() - started,
    }


def _worker(args: tuple[str, str, str, list[str], int, float, float]) -> dict[str, Any]:
    return anyio.run(run_sessions, *args)


# --------------------------------------------------------------------------- server figures


async def _warm(url: str) -> None:
    """Load the scripts (a tiny answer, then its session deleted): the first EVAL of each
    compiles it, a cost per server, not per delta, which would land on whichever way runs first."""
    prefix = unique_prefix()
    store = RedisSessionStore.from_url(url, prefix=prefix)
    try:
        s = await Sessions(store).open("warm")
        async with s.stream(turn=1, step=1) as w:
            await w.delta("x")
        await store.delete("warm")
    finally:
        await store.aclose()
        await drop_prefix(url, prefix)


async def _reset(url: str) -> float:
    r = aioredis.Redis.from_url(url)
    await r.config_resetstat()
    cpu = await _process_cpu(r)
    await r.aclose()
    return cpu


async def _process_cpu(r: aioredis.Redis) -> float:
    """The server process's CPU seconds so far (user + system, every thread)."""
    info = await r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _cpu_usec(url: str) -> tuple[float, dict[str, tuple[float, int]]]:
    r = aioredis.Redis.from_url(url)
    stats = await r.info("commandstats")
    per_cpu = await _process_cpu(r)
    await r.aclose()
    stats["cmdstat__process"] = {"usec": per_cpu * 1e6, "calls": 0}
    per = {k.removeprefix("cmdstat_"): (float(v["usec"]), int(v["calls"])) for k, v in stats.items()}
    for k in ("info", "config|resetstat", "config"):
        per.pop(k, None)
    return sum(u for u, _ in per.values()), per


async def _memory(url: str, prefix: str) -> tuple[int, int]:
    """MEMORY USAGE of every key of the run, as it is and compacted: a stream's last listpack
    node is allocated whole when it is created (up to stream-node-max-bytes, 4 KiB by default,
    shrunk only once the node is full), so each stream carries up to 4 KiB that depends on
    neither its entries nor its deltas; the compacted figure measures each key as a copy of it
    (DUMP + RESTORE builds its nodes to fit, as a restart would) and so the cost per delta."""
    r = aioredis.Redis.from_url(url)
    total = compact = 0
    tmp = f"{prefix}:~copy"
    try:
        async for k in r.scan_iter(match=f"{prefix}:*", count=1000):
            if b":feed:" in k or b":sessions:" in k or k == tmp.encode():
                continue  # cross-session index and change feed: the same for every way
            used = int(await r.memory_usage(k, samples=0) or 0)
            total += used
            dumped = await r.dump(k)
            if dumped is None:
                continue
            await r.restore(tmp, 0, dumped, replace=True)
            compact += int(await r.memory_usage(tmp, samples=0) or 0)
            await r.delete(tmp)
    finally:
        await r.aclose()
    return total, compact


def run_way(url: str, way: str, sessions: int, deltas: int, rate: float, procs: int, flush: float) -> dict[str, Any]:
    prefix = unique_prefix()
    sids = [f"{way}-{i}" for i in range(sessions)]
    shares = [sids[i::procs] for i in range(procs)]
    anyio.run(_warm, url)
    cpu0 = anyio.run(_reset, url)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(procs) as pool:
        parts = pool.map(_worker, [(url, prefix, way, share, deltas, rate, flush) for share in shares])
    usec, per = anyio.run(_cpu_usec, url)
    process_us = per.pop("_process")[0] - cpu0 * 1e6
    usec = sum(u for u, _ in per.values())
    memory, _ = anyio.run(_memory, url, prefix)
    memory_later = None
    if way == "stream":
        time.sleep(GRACE + 1.0)
        memory_later, _ = anyio.run(_memory, url, prefix)
    _, compact = anyio.run(_memory, url, prefix)
    anyio.run(drop_prefix, url, prefix)
    total = sum(p["deltas"] for p in parts)
    lat = [x for p in parts for x in p["latencies"]]
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:10]
    return {
        "way": way,
        "deltas": total,
        "cpu_us": usec / total,
        "proc_us": process_us / total,
        "top": ", ".join(f"{k} {u / total:.1f} ({c / total:.2f} calls)" for k, (u, c) in top),
        "mem_b": memory / total,
        "mem_later_b": None if memory_later is None else memory_later / total,
        "mem_compact_b": compact / total,
        "p50": percentile(lat, 50) * 1000,
        "p99": percentile(lat, 99) * 1000,
        "complete": all(p["complete"] for p in parts) and all(p["log_ok"] for p in parts),
        "rate": total / max(p["seconds"] for p in parts),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None)
    p.add_argument("--sessions", type=int, nargs="+", default=[50, 200])
    p.add_argument("--deltas", type=int, default=500)
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--ways", nargs="+", default=["raw", "stream", "entries"])
    p.add_argument("--flush", type=float, default=DEFAULT_FLUSH_INTERVAL, help="the stream writer's flush_interval (s)")
    args = p.parse_args()
    with server(args.url) as url:
        for s in args.sessions:
            results = [run_way(url, w, s, args.deltas, args.rate, args.procs, args.flush) for w in args.ways]
            base = next((r for r in results if r["way"] == "raw"), results[0])
            entry = next((r for r in results if r["way"] == "entries"), None)
            print(
                f"\nS={s} answers x {args.deltas} deltas at ~{args.rate:g}/s, one reader each, flush {args.flush:g} s"
            )
            rows = []
            for r in results:
                mem = f"{r['mem_b']:.1f}" + ("" if r["mem_later_b"] is None else f" ({r['mem_later_b']:.1f})")
                rows.append([
                    r["way"], f"{r['rate']:.0f}", f"{r['cpu_us']:.2f}", f"{r['cpu_us'] / base['cpu_us']:.2f}x",
                    f"{r['proc_us']:.2f}", f"{r['proc_us'] / base['proc_us']:.2f}x", mem,
                    "" if entry is None else f"{(r['mem_later_b'] or r['mem_b']) / entry['mem_b']:.2f}",
                    f"{r['mem_compact_b']:.1f}",
                    "" if entry is None else f"{r['mem_compact_b'] / entry['mem_compact_b']:.2f}",
                    f"{r['p50']:.2f}", f"{r['p99']:.2f}", f"{r['p50'] / base['p50']:.2f}x",
                    "yes" if r["complete"] else "NO",
                ])  # fmt: skip
            print_table(
                ["way", "deltas/s", "cmdstat us/delta", "vs raw", "process us/delta", "vs raw", "mem B/delta",
                 "vs entries", "compact B/delta", "vs entries", "p50 ms", "p99 ms", "p50 vs raw", "complete"],
                rows,
            )  # fmt: skip
            for r in results:
                print(f"  {r['way']:8} server usec/delta by command: {r['top']}")


if __name__ == "__main__":
    main()
