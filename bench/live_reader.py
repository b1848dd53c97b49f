"""A live reader's client CPU per delta: `store.tail_live` vs a raw ``XREAD BLOCK`` loop.

    python bench/live_reader.py [--url URL] [--sessions 50] [--deltas 400] [--rate 50] [--rounds 3]

S live streams, each fed `--deltas` text deltas at ~`--rate`/s by a writer process (plain
pipelined XADDs, so the writer costs the reader nothing); S readers in another process, one per
stream. Reported per way: the reader process's CPU (``time.process_time``) per delta, and its
ratio to the raw reader's in the same round. The ways, interleaved round by round:

(raw)        redis-py ``XREAD BLOCK`` on the stream, fields as bytes (the floor);
(one/held)   `tail_live`, records in one field (``t`` -> ``"<answer> <index> <life> <text>"``),
             one pooled connection held for the tail's loop (this release);
(one/pooled) the same records, a connection taken from the pool for each XREAD;
(four/held)  records as the four fields ``a i t l`` older writers write, the held connection;
(four/pooled) both as before this release.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anyio
import redis.asyncio as aioredis
from _common import drop_prefix, print_table, server, unique_prefix

from redis_session import RedisSessionStore, SessionHeader
from redis_session.projection.chunks import LiveRecord

WAYS = ["raw", "one/held", "one/pooled", "four/held", "four/pooled"]


def _fields(way: str, answer: str, i: int, life: str, text: str) -> list[str]:
    if way == "raw":
        return ["d", text]
    r = LiveRecord(answer=answer, kind="text", index=i, text=text, incarnation=life)
    if way.startswith("four"):
        return ["a", answer, "i", str(i), "t", text, "l", life]
    return r.fields()


async def _write(url: str, keys: list[str], way: str, life: str, deltas: int, rate: float) -> None:
    r = aioredis.Redis.from_url(url, max_connections=len(keys) + 4)
    rng = random.Random(1)
    texts = ["".join(rng.choice("abcdefgh  .,") for _ in range(rng.randint(1, 8))) for _ in range(deltas)]

    async def one(key: str, answer: str) -> None:
        await anyio.sleep(random.random() / rate)
        for i, t in enumerate(texts):
            await r.execute_command("XADD", key, "*", *_fields(way, answer, i, life, t))
            await anyio.sleep(1 / rate)

    async with anyio.create_task_group() as tg:
        for k, key in enumerate(keys):
            tg.start_soon(one, key, f"a{k:09d}")
    await r.aclose()


def _writer(args: tuple[str, list[str], str, str, int, float, Any]) -> None:
    url, keys, way, life, deltas, rate, go = args
    go.wait()
    anyio.run(_write, url, keys, way, life, deltas, rate)


async def _read(url: str, prefix: str, sids: list[str], way: str, deltas: int, ready: Any, go: Any) -> float:
    store = RedisSessionStore.from_url(url, prefix=prefix, client_options={"max_connections": 2 * len(sids) + 8})
    store._hold_tails = way.endswith("held")
    raw = aioredis.Redis.from_url(url, max_connections=2 * len(sids) + 8)
    done = [0] * len(sids)
    finished = anyio.Event()
    left = [len(sids)]

    def one_done() -> None:
        left[0] -= 1
        if not left[0]:
            finished.set()

    async def reader(k: int, sid: str) -> None:
        if way == "raw":
            key, last = store.keys.live(sid), "0-0"
            while done[k] < deltas:
                resp = await raw.xread({key: last}, count=1000, block=2000)
                for _, rows in resp or ():
                    for rid, fields in rows:
                        fields[b"d"].decode()
                        done[k] += 1
                        last = rid
            one_done()
            return
        async for r in store.tail_live(sid, 0):
            if isinstance(r, LiveRecord) and r.is_delta:
                done[k] += 1
                if done[k] >= deltas:
                    one_done()
                    return

    try:
        async with anyio.create_task_group() as tg:
            for k, sid in enumerate(sids):
                tg.start_soon(reader, k, sid)
            await anyio.sleep(0.5)  # every reader blocked in its XREAD
            cpu0 = time.process_time()
            ready.set()
            go.set()
            with anyio.move_on_after(120):
                await finished.wait()
            cpu = time.process_time() - cpu0
            tg.cancel_scope.cancel()
    finally:
        await store.aclose()
        await raw.aclose()
    return cpu / max(1, sum(done))


def _reader(args: tuple[str, str, list[str], str, int, Any, Any]) -> float:
    return anyio.run(_read, *args)


async def _setup(url: str, prefix: str, sids: list[str]) -> str:
    store = RedisSessionStore.from_url(url, prefix=prefix)
    try:
        for sid in sids:
            await store.create(SessionHeader(id=sid))
        head = await store.head(sids[0])
        assert head is not None
        return head.header.incarnation
    finally:
        await store.aclose()


def run_way(url: str, way: str, sessions: int, deltas: int, rate: float) -> float:
    prefix = unique_prefix()
    sids = [f"r{i}" for i in range(sessions)]
    life = anyio.run(_setup, url, prefix, sids)
    keys = [f"{prefix}:{{{sid}}}:live" for sid in sids]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as m:
        ready, go = m.Event(), m.Event()
        w = ctx.Process(target=_writer, args=((url, keys, way, life, deltas, rate, go),))
        w.start()
        with ctx.Pool(1) as pool:
            per = pool.apply(_reader, ((url, prefix, sids, way, deltas, ready, go),))
        w.join()
    anyio.run(drop_prefix, url, prefix)
    return per * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None)
    p.add_argument("--sessions", type=int, default=50)
    p.add_argument("--deltas", type=int, default=400)
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    got: dict[str, list[float]] = {w: [] for w in WAYS}
    with server(args.url) as url:
        for _ in range(args.rounds):
            for w in WAYS:
                got[w].append(run_way(url, w, args.sessions, args.deltas, args.rate))
    print(f"\nS={args.sessions} readers x {args.deltas} deltas at ~{args.rate:g}/s, {args.rounds} rounds interleaved")
    rows = []
    for w in WAYS:
        ratios = [x / r for x, r in zip(got[w], got["raw"], strict=True)]
        rows.append([
            w, " / ".join(f"{x:.1f}" for x in got[w]), f"{statistics.median(got[w]):.1f}",
            " / ".join(f"{x:.2f}" for x in ratios), f"{statistics.median(ratios):.2f}x",
        ])  # fmt: skip
    print_table(["reader", "client CPU us/delta by round", "median", "vs raw by round", "median vs raw"], rows)


if __name__ == "__main__":
    main()
