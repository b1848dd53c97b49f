"""Shared helpers of the bench scripts: a server to measure on, timing, percentiles, a table.

Typical use::

    from _common import bench_args, server, Timer, interleave, print_table

    args = bench_args("what this bench measures").parse_args()
    with server(args.url) as url:        # --url, else a private valkey-server (no AOF) in a tmpdir
        ...
        results = anyio.run(main, url)

A bench is not a test: it prints numbers, it asserts nothing. Run each from the repository root
(``python bench/append.py``); the scripts put their own folder on ``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from redis_session.redis.embedded import start_server


def bench_args(description: str, *, seconds: float = 6.0) -> argparse.ArgumentParser:
    """An argument parser with the options every bench shares: ``--url`` and ``--seconds``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", default=None, help="server to measure on (default: a private valkey-server)")
    p.add_argument("--seconds", type=float, default=seconds, help="time budget per scenario, both sides together")
    return p


@contextlib.contextmanager
def server(url: str | None) -> Iterator[str]:
    """`url` as given, else a private valkey-server in a temporary directory (AOF off), stopped
    on exit. Never $REDIS_URL implicitly: a bench must say where it runs."""
    if url:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="rs-bench-") as d:
        proc = start_server(d, appendonly=False)
        try:
            yield proc.url
        finally:
            proc.stop()


def unique_prefix() -> str:
    """A key prefix of its own, so a bench on a shared server touches only its own keys."""
    return f"bench{uuid.uuid4().hex[:8]}"


async def drop_prefix(url: str, prefix: str) -> None:
    """Delete every key under `prefix` (never FLUSHDB: the server may be shared)."""
    r = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
        for i in range(0, len(keys), 500):
            await r.delete(*keys[i : i + 500])
    finally:
        await r.aclose()


def settle_gc() -> None:
    """Collect once and freeze what start-up allocated, so the collector's passes over long-lived
    objects (modules, clients, fixtures) do not land in whichever side happens to trigger them."""
    gc.collect()
    gc.freeze()


def percentile(samples: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) by nearest rank; 0.0 for no samples."""
    if not samples:
        return 0.0
    s = sorted(samples)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


@dataclass
class Timer:
    """Latencies of one side of a comparison (seconds per op) and how many items each op moved."""

    name: str
    items_per_op: int = 1
    samples: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # where each `interleave` round began in `samples`

    @property
    def busy(self) -> float:
        return sum(self.samples)

    @property
    def ops_per_s(self) -> float:
        return len(self.samples) / self.busy if self.samples else 0.0

    @property
    def items_per_s(self) -> float:
        return self.ops_per_s * self.items_per_op

    def p(self, pct: float) -> float:
        """Percentile latency in milliseconds."""
        return percentile(self.samples, pct) * 1000

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples) * 1000 if self.samples else 0.0

    def round_rates(self) -> list[float]:
        """Ops/s of each `interleave` round, in order: a drift within one run shows here."""
        edges = [*self.rounds, len(self.samples)]
        out = []
        for lo, hi in itertools.pairwise(edges):
            busy = sum(self.samples[lo:hi])
            if hi > lo and busy > 0:
                out.append((hi - lo) / busy)
        return out


def round_ratios(ours: Timer, base: Timer, groups: int = 5, *, median: bool = False) -> list[float]:
    """Ours/base ops/s over consecutive groups of interleaved rounds (first to last), so a drift
    within one run is reported instead of averaged away. With `median`, each group's rate is one
    over its median latency: a few ops stalled by another tenant (a VM's steal, a hog) move a
    mean by tens of percent on a loaded machine and a median not at all."""
    a, b = ours.round_rates(), base.round_rates()
    k = min(len(a), len(b))
    if k == 0:
        return []
    groups = min(groups, k)
    edges = [k * i // groups for i in range(groups + 1)]  # exactly `groups` groups, as even as can be
    out = []
    for lo, hi in itertools.pairwise(edges):
        if median:
            ma = statistics.median(ours.samples[ours.rounds[lo] : _edge(ours, hi)])
            mb = statistics.median(base.samples[base.rounds[lo] : _edge(base, hi)])
            out.append(mb / ma if ma else 0.0)
            continue
        ra, rb = statistics.mean(a[lo:hi]), statistics.mean(b[lo:hi])
        out.append(ra / rb if rb else 0.0)
    return out


def _edge(t: Timer, i: int) -> int:
    """Where round `i` of `t` begins in its samples (its end for the last)."""
    return t.rounds[i] if i < len(t.rounds) else len(t.samples)


async def interleave(
    sides: Sequence[tuple[Timer, Callable[[], Awaitable[object]]]],
    seconds: float,
    *,
    round_s: float = 0.2,
    warmup_ops: int = 20,
    meter: ServerMeter | None = None,
    per_op: bool = False,
) -> None:
    """Run each side's op in alternating rounds of ~`round_s` for `seconds` in all, recording
    each op's latency, so drift in the machine's load hits every side alike. With `meter`, each
    side's server time is taken from INFO commandstats around its rounds (outside the timing).

    With `per_op`, the sides take turns op by op (A, B, C, A, B, C, …) and a round is a slice of
    `round_s` in which every side ran: a burst of another tenant's load (a VM's steal time, a CPU
    hog's timeslice) then lands on every side alike instead of on whichever side's block of ops
    it fell in; the order is shuffled every turn, so that what one op leaves behind (a cache
    evicted, a callback pending) is not always paid by the same next side. No `meter` then:
    commandstats cannot tell apart sides that send one command."""
    for _, op in sides:
        for _ in range(warmup_ops):
            await op()
    clock = time.perf_counter
    end = clock() + seconds
    if per_op:
        if meter is not None:
            raise ValueError("per_op interleaving has no per-side server meter")
        rng = random.Random(0)
        order = list(sides)
        while clock() < end:
            for timer, _ in sides:
                timer.rounds.append(len(timer.samples))
            round_end = clock() + round_s
            while True:
                rng.shuffle(order)  # a fresh order each turn: no side always follows the same one
                for timer, op in order:
                    t0 = clock()
                    await op()
                    timer.samples.append(clock() - t0)
                if clock() >= round_end:
                    break
        return
    while clock() < end:
        for timer, op in sides:
            if meter is not None:
                await meter.start()
            ops = len(timer.samples)
            timer.rounds.append(ops)
            round_end = clock() + round_s / len(sides)
            while True:
                t0 = clock()
                await op()
                t1 = clock()
                timer.samples.append(t1 - t0)
                if t1 >= round_end:
                    break
            if meter is not None:
                await meter.stop(timer, len(timer.samples) - ops)


class ServerMeter:
    """Server CPU per op of each side, by INFO commandstats: the `usec` of the command each side
    sends (e.g. ``evalsha``: a script's total, the commands it calls included; ``xadd``), read
    before and after each of its rounds on a connection of its own. Scripts' inner commands are
    also counted under their own names, so a side is metered by its outermost command only."""

    def __init__(self, url: str, commands: dict[str, str]) -> None:
        self.client = aioredis.Redis.from_url(url)
        self.commands = commands  # timer name -> command name as commandstats spells it
        self.usec: dict[str, float] = {}
        self.ops: dict[str, int] = {}
        self._before: dict[str, float] = {}

    async def _read(self) -> dict[str, float]:
        stats = await self.client.info("commandstats")
        return {k.removeprefix("cmdstat_"): float(v["usec"]) for k, v in stats.items()}

    async def start(self) -> None:
        self._before = await self._read()

    async def stop(self, timer: Timer, ops: int) -> None:
        cmd = self.commands.get(timer.name)
        if cmd is None:
            return
        after = await self._read()
        self.usec[timer.name] = self.usec.get(timer.name, 0.0) + after.get(cmd, 0.0) - self._before.get(cmd, 0.0)
        self.ops[timer.name] = self.ops.get(timer.name, 0) + ops

    def per_op(self, timer: Timer) -> float | None:
        """Server microseconds per op of `timer`'s side (None: not metered)."""
        ops = self.ops.get(timer.name)
        return self.usec[timer.name] / ops if ops else None

    async def aclose(self) -> None:
        await self.client.aclose()


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain, aligned text table (floats with 2 decimals, or 0 for big numbers)."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
