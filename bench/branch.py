"""Branching costs the same for any parent length (docs/design.md §5): nothing is copied.

    python bench/branch.py [--url URL] [--seconds N] [--entries 100000]

Builds a 100 000-entry parent (``store.put`` batches of 1 000) and a 10-entry parent, then times
``Sessions.branch`` of each, in interleaved rounds so load drift hits both sides alike:
  - in this process;
  - in a fresh process that never touched either parent (no client-side state of any kind),
    including its very first, cold branch of each.
Each branch is a new session (default id ``<parent>:branch:<8 hex>``) at the parent's end, plus
the big parent at its middle. Target: median(big) / median(small) <= 1.5.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from _common import Timer, bench_args, drop_prefix, interleave, print_table, server, settle_gc, unique_prefix

from redis_session import NewEntry, RedisSessionStore
from redis_session.sessions import Sessions

TARGET = 1.5
BATCH = 1_000
TEXT = "The quick brown fox jumps over the lazy dog; " * 4


async def build(url: str, prefix: str, entries: int) -> None:
    store = RedisSessionStore.from_url(url, prefix=prefix)
    sessions = Sessions(store)
    try:
        await sessions.create("big")
        t0 = time.perf_counter()
        for k in range(0, entries, BATCH):
            batch = [
                NewEntry("user/message" if i % 2 == 0 else "assistant/message", {"content": f"{i} {TEXT}"})
                for i in range(k, min(entries, k + BATCH))
            ]
            await store.put("big", k, batch)
        built = time.perf_counter() - t0
        small = await sessions.create("small")
        await small.append_many([NewEntry("user/message", {"content": f"{i} {TEXT}"}) for i in range(10)])
        head = await store.head("big")
        assert head is not None and head.n == entries
        print(f"built parents: big n={entries:,} in {built:.1f}s ({entries / built:,.0f} entries/s), small n=10")
    finally:
        await store.aclose()


async def measure(url: str, prefix: str, seconds: float, entries: int) -> dict[str, list[float]]:
    """Interleaved branch timings of this process: the first (cold) op of each side, then rounds."""
    store = RedisSessionStore.from_url(url, prefix=prefix)
    sessions = Sessions(store)
    try:
        sides = [
            (Timer("small  (at=10)"), lambda: sessions.branch("small", 10)),
            (Timer(f"big    (at={entries:,})"), lambda: sessions.branch("big", entries)),
            (Timer(f"big    (at={entries // 2:,})"), lambda: sessions.branch("big", entries // 2)),
        ]
        cold: list[float] = []
        for _, op in sides:
            t0 = time.perf_counter()
            await op()
            cold.append(time.perf_counter() - t0)
        settle_gc()
        await interleave(sides, seconds, warmup_ops=10)
        out = {t.name: t.samples for t, _ in sides}
        out["cold"] = cold
        return out
    finally:
        await store.aclose()


def report(title: str, results: dict[str, list[float]]) -> float:
    import statistics

    cold = results.pop("cold")
    names = list(results)
    small = statistics.median(results[names[0]])
    rows = []
    for i, name in enumerate(names):
        s = results[name]
        med = statistics.median(s)
        rows.append((name, len(s), med * 1000, sorted(s)[int(len(s) * 0.99) - 1] * 1000, cold[i] * 1000, med / small))
    print(f"\n{title}")
    print_table(["branch of", "ops", "median ms", "p99 ms", "first (cold) ms", "x small"], rows)
    return max(r[5] for r in rows)


def child_main(url: str, prefix: str, seconds: float, entries: int) -> None:
    results = anyio.run(measure, url, prefix, seconds, entries)
    print(json.dumps(results))


def main() -> None:
    p = bench_args("branch cost vs parent length", seconds=4.0)
    p.add_argument("--entries", type=int, default=100_000, help="length of the big parent")
    p.add_argument("--child", nargs=2, metavar=("URL", "PREFIX"), help=argparse_suppress())
    args = p.parse_args()
    if args.child:
        child_main(args.child[0], args.child[1], args.seconds, args.entries)
        return
    with server(args.url) as url:
        prefix = unique_prefix()
        try:
            anyio.run(build, url, prefix, args.entries)
            here = anyio.run(measure, url, prefix, args.seconds, args.entries)
            ratio_here = report("this process (the one that built the parents)", here)
            cmd = [
                sys.executable,
                __file__,
                "--child",
                url,
                prefix,
                "--seconds",
                str(args.seconds),
                "--entries",
                str(args.entries),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            there = json.loads(out.strip().splitlines()[-1])
            ratio_there = report("a fresh process (never saw the parents)", there)
        finally:
            anyio.run(drop_prefix, url, prefix)
    worst = max(ratio_here, ratio_there)
    verdict = "OK" if worst <= TARGET else "ABOVE TARGET"
    print(f"\nratio big/small (worst side, by median): {worst:.2f}  (target <= {TARGET})  {verdict}")


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
