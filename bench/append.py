"""The store's hot paths against the bare Redis commands they are built on.

    python bench/append.py [--url URL] [--seconds N] [--no-freeze]

On one server, in interleaved rounds (ours, baseline, ours, …) so that load drift hits both:
  (a) `put` of one ~300-byte `user/message` entry  vs  a raw XADD of the same bytes, same client;
  (b) `put` of a 100-entry batch                    vs  100 pipelined XADDs;
  (c) `read` of a 10 000-entry session into Entry   vs  redis-py's XRANGE (default parsing, bytes).
Targets (ours / baseline ops/s): (a) >= 0.90, (b) >= 1.00, (c) >= 1.00, each in every fifth of the run.

Reference rows run in (a)'s rounds too: `put` with an idempotency key, and a bare Lua script
(HGET n, compare, XADD, HSET n), the least any checked append costs on this server, so (a)'s ratio
can be read against that floor.

"server µs/call" is the server's CPU per op by INFO commandstats, read around each side's rounds:
the `usec` of EVALSHA for a put or a script (the commands it calls included), of XADD for the raw
side (per op: a 100-entry batch is one call, or 100 XADDs), of XRANGE for a read. This is what a
user pays Redis for; the ops/s ratio is mostly the client's and the round trip's.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
import msgspec
import redis.asyncio as aioredis
from _common import (
    ServerMeter,
    Timer,
    bench_args,
    drop_prefix,
    interleave,
    print_table,
    round_ratios,
    server,
    settle_gc,
    unique_prefix,
)

from redis_session import NewEntry, RedisSessionStore, SessionHeader

TEXT = "The quick brown fox jumps over the lazy dog; " * 6  # ~270 characters
DATA = {"content": TEXT.strip()}
DATA_RAW = msgspec.json.encode(DATA)
READ_N = 10_000
BATCH = 100
TARGETS = {"a": 0.90, "b": 1.00, "c": 1.00}
BARE_LUA = """local n = tonumber(redis.call('HGET', KEYS[1], 'n'))
if n ~= tonumber(ARGV[1]) then return {2, n} end
redis.call('XADD', KEYS[2], string.format('%d-1', n), 'type', ARGV[2], 'time', ARGV[3], 'data', ARGV[4])
redis.call('HSET', KEYS[1], 'n', n + 1)
return {0, n}"""

Result = tuple[str, Timer, Timer, str]  # name, ours, baseline, target ("" for a reference row)


async def run(url: str, seconds: float, freeze: bool) -> tuple[list[Result], ServerMeter]:
    prefix = unique_prefix()
    client = aioredis.Redis.from_url(url)  # the user's client: the store shares its pool
    store = RedisSessionStore(client, prefix=prefix)
    plain = aioredis.Redis.from_url(url)  # a stock client with redis-py's default reply parsing
    results: list[Result] = []
    meter = ServerMeter(url, {})
    try:
        # ------------------------------------------------------------ (a) one entry
        await store.create(SessionHeader(id="one"))
        n = 0
        one = [NewEntry("user/message", DATA)]

        async def put_one() -> None:
            nonlocal n
            await store.put("one", n, one)
            n += 1

        await store.create(SessionHeader(id="idem"))
        ni = 0

        async def put_idem() -> None:
            nonlocal ni
            await store.put("idem", ni, one, idempotency_key=f"k{ni}")
            ni += 1

        raw_key = f"{prefix}:raw-one"

        async def xadd_one() -> object:
            return await client.execute_command(
                "XADD", raw_key, "*", "type", "user/message", "time", "1700000000000", "data", DATA_RAW
            )

        bare_keys = (f"{prefix}:{{bare}}:hdr", f"{prefix}:{{bare}}:log")
        await client.hset(bare_keys[0], "n", 0)
        bare_sha = await client.script_load(BARE_LUA)
        nbare = 0

        async def bare_lua() -> None:
            nonlocal nbare
            await client.execute_command("EVALSHA", bare_sha, 2, *bare_keys, nbare, "user/message", "1", DATA_RAW)
            nbare += 1

        ref_idem, ref = Timer("(ref) put 1 entry + idempotency key"), Timer("(ref) bare Lua append")
        meter.commands.update({"(a) put 1 entry": "evalsha", "XADD": "xadd", ref_idem.name: "evalsha"})
        meter.commands[ref.name] = "evalsha"
        results += await _compare(
            "(a) put 1 entry", "XADD", put_one, xadd_one, seconds, 1, freeze, meter,
            refs=[(ref_idem, put_idem), (ref, bare_lua)],
        )  # fmt: skip

        # ------------------------------------------------------------ (b) 100-entry batch
        await store.create(SessionHeader(id="batch"))
        nb = 0
        batch = [NewEntry("user/message", DATA) for _ in range(BATCH)]

        async def put_batch() -> None:
            nonlocal nb
            await store.put("batch", nb, batch)
            nb += BATCH

        raw_batch_key = f"{prefix}:raw-batch"

        async def xadd_batch() -> object:
            pipe = client.pipeline(transaction=False)
            for _ in range(BATCH):
                pipe.execute_command(
                    "XADD", raw_batch_key, "*", "type", "user/message", "time", "1700000000000", "data", DATA_RAW
                )
            return await pipe.execute()

        meter.commands.update({f"(b) put {BATCH} entries": "evalsha", f"{BATCH} piped XADD": "xadd"})
        results += await _compare(
            f"(b) put {BATCH} entries", f"{BATCH} piped XADD", put_batch, xadd_batch, seconds, BATCH, freeze, meter
        )

        # ------------------------------------------------------------ (c) 10k-entry read
        await store.create(SessionHeader(id="long"))
        for i in range(0, READ_N, 1000):
            await store.put("long", i, [NewEntry("user/message", DATA)] * 1000)
        log_key = store.keys.log("long")

        async def read_ours() -> object:
            entries = await store.read("long")
            assert len(entries) == READ_N
            return entries

        async def xrange_plain() -> object:
            rows = await plain.xrange(log_key)
            assert len(rows) == READ_N
            return rows

        meter.commands.update({f"(c) read {READ_N} entries": "xrange", "XRANGE (redis-py)": "xrange"})
        results += await _compare(
            f"(c) read {READ_N} entries",
            "XRANGE (redis-py)",
            read_ours,
            xrange_plain,
            seconds,
            READ_N,
            freeze,
            meter,
            warmup=3,
        )
    finally:
        await store.aclose()
        await client.aclose()
        await plain.aclose()
        await meter.aclose()
        await drop_prefix(url, prefix)
    return results, meter


async def _compare(
    ours_name: str,
    base_name: str,
    ours: Callable[[], Awaitable[object]],
    base: Callable[[], Awaitable[object]],
    seconds: float,
    items: int,
    freeze: bool,
    meter: ServerMeter,
    warmup: int = 20,
    refs: Sequence[tuple[Timer, Callable[[], Awaitable[object]]]] = (),
) -> list[Result]:
    a, b = Timer(ours_name, items), Timer(base_name, items)
    sides = [(a, ours), (b, base), *refs]
    for _ in range(warmup):
        for _, op in sides:
            await op()
    if freeze:
        settle_gc()
    await interleave(sides, seconds * len(sides) / 2, warmup_ops=0, meter=meter)
    target = f">={TARGETS[ours_name[1]]:.2f}"
    return [(ours_name, a, b, target), *((t.name, t, b, "") for t, _ in refs)]


def main() -> None:
    p = bench_args(__doc__ or "")
    p.add_argument("--no-freeze", action="store_true", help="skip gc.freeze() after set-up")
    args = p.parse_args()
    with server(args.url) as url:
        results, meter = anyio.run(run, url, args.seconds, not args.no_freeze)
    rows = []
    for name, ours, base, target in results:
        ratio = ours.ops_per_s / base.ops_per_s if base.ops_per_s else 0.0
        p50_ratio = base.p(50) / ours.p(50) if ours.samples else 0.0
        verdict = "" if not target else "ok" if ratio >= float(target[2:]) else "MISS"
        us, base_us = meter.per_op(ours), meter.per_op(base)
        rows.append(
            [name, f"{ours.ops_per_s:,.0f}", f"{ours.p(50):.3f}", f"{ours.p(99):.3f}", _us(us),
             base.name, f"{base.ops_per_s:,.0f}", f"{base.p(50):.3f}", f"{base.p(99):.3f}", _us(base_us),
             f"{ratio:.2f}x", f"{p50_ratio:.2f}x", f"{us / base_us:.2f}x" if us and base_us else "",
             f"{target} {verdict}".strip()]
        )  # fmt: skip
    print_table(
        ["ours", "ops/s", "p50 ms", "p99 ms", "server µs/call", "baseline", "ops/s", "p50 ms", "p99 ms",
         "server µs/call", "ratio", "p50 ratio", "server ratio", "target"],
        rows,
    )  # fmt: skip
    print(
        "ratio: ours/baseline ops/s (the target's measure); p50 ratio: baseline p50 / ours p50;\n"
        "server µs/call: INFO commandstats usec per op (EVALSHA for a put or a script, XADD, XRANGE); "
        "server ratio: ours / baseline"
    )
    print("ratio over the run, first to last fifth of its rounds (a drift within one run shows here):")
    for name, ours, base, target in results:
        if target:
            fifths = round_ratios(ours, base)
            low = min(fifths, default=0.0)
            verdict = "ok" if low >= float(target[2:]) else "MISS"
            print(f"  {name}: " + "  ".join(f"{r:.2f}x" for r in fifths) + f"   (lowest {low:.2f}x {verdict})")
    for name, ours, base, _ in results:
        if ours.items_per_op > 1:
            print(f"{name}: {ours.items_per_s:,.0f} entries/s vs {base.items_per_s:,.0f} entries/s")


def _us(v: float | None) -> str:
    return "" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    main()
