"""The cold tier under ``--keep`` on every hint, side by side in one run: archived vs hot.

    python bench/cold_keep.py [--url URL] [--entries 1000] [--keep 50] [--repeat 5]

A live session gets `entries` single-entry appends and, after each, an archive with
``Policy(keep=KEEP)`` (what ``archive --worker --keep KEEP`` does on each change-feed hint); a
twin session gets the same appends and stays hot. Reported: the archived session's segment
count, its header (bytes of the ``cold`` field, ``MEMORY USAGE``, encoding), the Redis memory of
both (header + log), and a whole read of each from a fresh store (segment LRU cold), p50 of
`repeat` interleaved reads. Goals: a listpack header, Redis memory <= 10 % of hot (when
entries >> keep), whole read <= 5x hot.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from _common import bench_args, drop_prefix, print_table, server, unique_prefix

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.archiver import Archiver, Policy
from redis_session.cold import ColdTier

TEXT = "The quick brown fox jumps over the lazy dog; " * 4


async def main(url: str, entries: int, keep: int, repeat: int, folder: str) -> None:
    p = unique_prefix()
    store = RedisSessionStore.from_url(url, prefix=p, cold=ColdTier(folder))
    try:
        await store.create(SessionHeader(id="cold"))
        await store.create(SessionHeader(id="hot"))
        archiver = Archiver(store)
        t0 = time.perf_counter()
        for i in range(entries):
            e = [NewEntry("user/message", {"content": f"{i}: {TEXT}"})]
            await store.put("cold", i, e)
            await store.put("hot", i, e)
            await archiver.archive("cold", policy=Policy(keep=keep))
        took = time.perf_counter() - t0
        k = store.keys
        cold = await store._raw("HGET", k.hdr("cold"), "cold") or b""
        mem = {}
        for sid in ("cold", "hot"):
            mem[sid] = sum([int(await store._raw("MEMORY", "USAGE", key) or 0) for key in (k.hdr(sid), k.log(sid))])
        hdr_mem = int(await store._raw("MEMORY", "USAGE", k.hdr("cold")))
        enc = await store._raw("OBJECT", "ENCODING", k.hdr("cold"))
        times: dict[str, list[float]] = {"cold": [], "hot": []}
        for _ in range(repeat):
            for sid in ("hot", "cold"):
                fresh = RedisSessionStore.from_url(url, prefix=p)  # finds the URL, empty LRU
                try:
                    t = time.perf_counter()
                    assert len(await fresh.read(sid)) == entries
                    times[sid].append(time.perf_counter() - t)
                finally:
                    await fresh.aclose()
        h, c = statistics.median(times["hot"]), statistics.median(times["cold"])
        print_table(
            ["measure", "hot", "archived", "ratio"],
            [
                ["segments", "", cold.count(b";") + 1 if cold else 0, ""],
                ["cold field / header MEMORY USAGE (B)", "", f"{len(cold)} / {hdr_mem} ({enc.decode()})", ""],
                ["Redis memory, header + log (B)", mem["hot"], mem["cold"], round(mem["cold"] / mem["hot"], 3)],
                ["whole read, fresh store, p50 (ms)", h * 1000, c * 1000, round(c / h, 2)],
                ["appends + archive on each (s)", "", round(took, 2), ""],
            ],
        )
    finally:
        await store.aclose()
        await drop_prefix(url, p)


if __name__ == "__main__":
    ap = bench_args(__doc__ or "")
    ap.add_argument("--entries", type=int, default=1000)
    ap.add_argument("--keep", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with server(args.url) as url, tempfile.TemporaryDirectory(prefix="rs-cold-keep-") as tmp:
        anyio.run(main, url, args.entries, args.keep, args.repeat, tmp)
