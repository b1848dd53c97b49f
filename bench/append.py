"""The store's hot paths against the bare Redis commands they are built on.

    python bench/append.py [--url URL] [--seconds N] [--rounds R] [--no-freeze]
    python bench/append.py --server-cpu [--url URL] [--rounds R]   # server CPU per call only
    python bench/append.py --callgrind                              # server instructions per call

On one server, in interleaved rounds (ours, baseline, ours, …) so that load drift hits both:
  (a) `put` of one ~300-byte `user/message` entry  vs  a raw XADD of the same bytes, same client;
  (b) `put` of a 100-entry batch                    vs  100 pipelined XADDs;
  (c) `read` of a 10 000-entry session into Entry   vs  redis-py's XRANGE (default parsing, bytes).
Targets (ours / baseline ops/s): (a) >= 0.90, (b) >= 1.00, (c) >= 1.00, each in every round: the
run is cut into R rounds (default 5) and every round's ratio is printed, so a drift shows.

Reference rows run in (a)'s rounds too: `put` in append.lua's long layout (what a put with an
idempotency key, meta, surface or a TTL sends), `put` with an idempotency key, and a bare Lua
script (HGET n, compare, XADD, HSET n), the least any checked append costs on this server, so
(a)'s ratio can be read against that floor; and that script plus what the contract adds to every
append (the header's deleted/ttl_ms/incarnation read, the change-feed XADD, `updated_at`): the
floor append.lua itself can reach.

--client-side NAME runs one single-entry side --ops times and nothing else: under
`valgrind --tool=callgrind`, once with --ops 0 and once with --ops N, the difference / N is the
client's instructions per call (deterministic on a busy machine).

"server µs/call" is the server's CPU per op by INFO commandstats, read around each side's rounds:
the `usec` of EVALSHA for a put or a script (the commands it calls included), of XADD for the raw
side (per op: a 100-entry batch is one call, or 100 XADDs), of XRANGE for a read. This is what a
user pays Redis for; the ops/s ratio is mostly the client's and the round trip's.

--server-cpu runs only the single-entry sides, sequentially, R rounds of --ops calls each, and
prints commandstats µs/call of every round (the sides take turns every 100 calls; the target:
put within 1.3x of the bare script).
--callgrind starts a private valkey-server under valgrind's callgrind and counts the server's
instructions per call of each side (network handling included): deterministic, so the same on a
busy machine. It needs valgrind (`apt-get install valgrind`) and says so when it is missing.
"""

from __future__ import annotations

import sys
import time
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
# the bare script plus what the contract adds to every append, no more: the header fields a plain
# append must check (deleted, ttl_ms, incarnation), the change-feed XADD (the projector's hint,
# whose entry ID is also the batch's server time) and `updated_at`: the floor append.lua can reach
FLOOR_LUA = """local h = redis.call('HMGET', KEYS[1], 'n', 'deleted', 'ttl_ms', 'incarnation')
local n = tonumber(h[1])
if n ~= tonumber(ARGV[1]) then return {2, n} end
local fid = redis.call('XADD', KEYS[3], '*', 's', ARGV[5], 'n', n + 1)
redis.call('XADD', KEYS[2], string.format('%d-1', n), 'type', ARGV[2], 'time', ARGV[3], 'data', ARGV[4])
redis.call('HSET', KEYS[1], 'n', n + 1, 'updated_at', ARGV[3])
return {0, n}"""

Result = tuple[str, Timer, Timer, str]  # name, ours, baseline, target ("" for a reference row)


Op = Callable[[], Awaitable[object]]


async def single_sides(client: aioredis.Redis, prefix: str) -> tuple[dict[str, Op], list[RedisSessionStore]]:
    """The single-entry sides, set up: name -> one call. The stores are the caller's to close."""
    store = RedisSessionStore(client, prefix=prefix)
    long = RedisSessionStore(client, prefix=prefix)
    long._short_puts = False  # append.lua's long layout for every put (what it was before)
    one = [NewEntry("user/message", DATA)]
    counters = {"one": 0, "long": 0, "idem": 0, "bare": 0}
    for sid in ("one", "one-long", "idem"):
        await store.create(SessionHeader(id=sid))

    async def put_one() -> None:
        await store.put("one", counters["one"], one)
        counters["one"] += 1

    async def put_long() -> None:
        await long.put("one-long", counters["long"], one)
        counters["long"] += 1

    async def put_idem() -> None:
        n = counters["idem"]
        await store.put("idem", n, one, idempotency_key=f"k{n}")
        counters["idem"] += 1

    raw_key = f"{prefix}:raw-one"

    async def xadd_one() -> object:
        return await client.execute_command(
            "XADD", raw_key, "*", "type", "user/message", "time", "1700000000000", "data", DATA_RAW
        )

    bare_keys = (f"{prefix}:{{bare}}:hdr", f"{prefix}:{{bare}}:log")
    await client.hset(bare_keys[0], "n", 0)
    bare_sha = await client.script_load(BARE_LUA)

    async def bare_lua() -> None:
        n = counters["bare"]
        await client.execute_command("EVALSHA", bare_sha, 2, *bare_keys, n, "user/message", "1", DATA_RAW)
        counters["bare"] += 1

    floor_keys = (f"{prefix}:{{floor}}:hdr", f"{prefix}:{{floor}}:log", f"{prefix}:{{floor}}:feed")
    await client.hset(floor_keys[0], "n", 0)
    floor_sha = await client.script_load(FLOOR_LUA)
    counters["floor"] = 0

    async def floor_lua() -> None:
        n = counters["floor"]
        await client.execute_command(
            "EVALSHA", floor_sha, 3, *floor_keys, n, "user/message", "1700000000000", DATA_RAW, "floor"
        )
        counters["floor"] += 1

    sides: dict[str, Op] = {
        PUT: put_one,
        XADD: xadd_one,
        LONG: put_long,
        IDEM: put_idem,
        BARE: bare_lua,
        FLOOR: floor_lua,
    }
    return sides, [store, long]


PUT, XADD, LONG = "(a) put 1 entry", "XADD", "(ref) put 1 entry, long layout"
IDEM, BARE = "(ref) put 1 entry + idempotency key", "(ref) bare Lua append"
FLOOR = "(ref) bare + feed + header fields"
CONTROL = "(control) XADD again, A/A"
COMMAND = {
    PUT: "evalsha",
    XADD: "xadd",
    LONG: "evalsha",
    IDEM: "evalsha",
    BARE: "evalsha",
    FLOOR: "evalsha",
    CONTROL: "xadd",
}
CLIENT_SIDES = {"put": PUT, "xadd": XADD, "bare": BARE, "floor": FLOOR}


async def run(url: str, seconds: float, freeze: bool) -> tuple[list[Result], ServerMeter]:
    prefix = unique_prefix()
    client = aioredis.Redis.from_url(url)  # the user's client: the store shares its pool
    store = RedisSessionStore(client, prefix=prefix)
    plain = aioredis.Redis.from_url(url)  # a stock client with redis-py's default reply parsing
    results: list[Result] = []
    meter = ServerMeter(url, {})
    stores: list[RedisSessionStore] = []
    try:
        # ------------------------------------------------------------ (a) one entry
        sides, stores = await single_sides(client, prefix)
        meter.commands.update(COMMAND)
        refs = [(Timer(name), sides[name]) for name in (LONG, IDEM, BARE, FLOOR)]
        # an A/A control: the baseline's own op again, as a side of its own. Its ratio to the
        # baseline is 1.00 by construction, so its spread over the rounds is the noise of the
        # measure itself on this machine at this moment
        refs.append((Timer(CONTROL), sides[XADD]))
        results += await _compare(PUT, XADD, sides[PUT], sides[XADD], seconds, 1, freeze, meter, refs=refs)

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
        for st in stores:
            await st.aclose()
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
    # the timing: op by op in turn, so another tenant's burst of load lands on every side alike
    await interleave(sides, seconds * len(sides) / 2, round_s=1.0, warmup_ops=0, per_op=True)
    # the server's CPU per call: a shorter pass in blocks, commandstats read around each block
    # (its latencies are thrown away: a side's block is timed against nothing)
    metered = [(Timer(t.name, items), op) for t, op in sides]
    await interleave(metered, max(1.0, seconds * len(sides) / 6), warmup_ops=0, meter=meter)
    target = f">={TARGETS[ours_name[1]]:.2f}"
    return [(ours_name, a, b, target), *((t.name, t, b, "") for t, _ in refs)]


async def server_cpu(url: str, rounds: int, ops: int) -> dict[str, list[float]]:
    """INFO commandstats µs per call of each single-entry side, per round (sides in turn)."""
    prefix = unique_prefix()
    client = aioredis.Redis.from_url(url)
    meter = aioredis.Redis.from_url(url)
    stores: list[RedisSessionStore] = []
    out: dict[str, list[float]] = {}
    try:
        sides, stores = await single_sides(client, prefix)
        for op in sides.values():
            for _ in range(20):
                await op()
        chunk = 100  # the sides take turns every 100 calls, so a change in load hits them alike
        for _ in range(rounds):
            usec = dict.fromkeys(sides, 0.0)
            for _ in range(max(1, ops // chunk)):
                for name, op in sides.items():
                    before = (await meter.info("commandstats"))[f"cmdstat_{COMMAND[name]}"]["usec"]
                    for _ in range(chunk):
                        await op()
                    usec[name] += (await meter.info("commandstats"))[f"cmdstat_{COMMAND[name]}"]["usec"] - before
            for name in sides:
                out.setdefault(name, []).append(usec[name] / (max(1, ops // chunk) * chunk))
    finally:
        for st in stores:
            await st.aclose()
        await client.aclose()
        await meter.aclose()
        await drop_prefix(url, prefix)
    return out


def print_server_cpu(us: dict[str, list[float]]) -> None:
    print("server µs/call by INFO commandstats (EVALSHA includes the commands the script calls), per round:")
    for name, per in us.items():
        print(f"  {name:38s} " + "  ".join(f"{v:6.1f}" for v in per))
    bare = us[BARE]
    for name in (PUT, LONG, IDEM, FLOOR):
        ratios = [a / b for a, b in zip(us[name], bare, strict=True)]
        verdict = "" if name != PUT else ("  (target <= 1.30x: " + ("ok" if max(ratios) <= 1.3 else "MISS") + ")")
        print(f"  {name} / bare script: " + "  ".join(f"{r:.2f}x" for r in ratios) + verdict)


def callgrind(ops: int) -> dict[str, float] | None:
    """Server instructions per call of each single-entry side, on a private valkey-server run
    under callgrind (instrumentation on only around each side's calls). None without valgrind."""
    import shutil
    import subprocess
    import tempfile

    from redis_session.redis.embedded import free_port, ping, server_binary

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("--callgrind: valgrind is not installed (apt-get install valgrind); skipped")
        return None
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rs-callgrind-") as d:
        cmd = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={d}/callgrind.out",
            server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", d, "--hz", "1",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not ping(port):
                if time.monotonic() > deadline or proc.poll() is not None:
                    print("--callgrind: valkey-server did not start under valgrind; skipped")
                    return None
                time.sleep(0.2)

            def control(*args: str) -> str:
                return subprocess.run(
                    ["callgrind_control", *args, str(proc.pid)], capture_output=True, text=True, check=False
                ).stdout

            def instructions() -> int:  # every thread's count since the last zero
                lines = [ln.split() for ln in control("-e").splitlines() if ln.strip().startswith("Th ")]
                return sum(int(parts[2].replace(",", "")) for parts in lines if len(parts) > 2)

            async def measure() -> dict[str, float]:
                url = f"redis://127.0.0.1:{port}/0"
                client = aioredis.Redis.from_url(url)
                sides, stores = await single_sides(client, unique_prefix())
                out: dict[str, float] = {}
                try:
                    for name, op in sides.items():
                        for _ in range(20):
                            await op()
                        control("-i", "on")
                        control("-z")
                        for _ in range(ops):
                            await op()
                        out[name] = instructions() / ops
                        control("-i", "off")
                finally:
                    for st in stores:
                        await st.aclose()
                    await client.aclose()
                return out

            return anyio.run(measure)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


async def client_side(url: str, name: str, ops: int) -> None:
    client = aioredis.Redis.from_url(url)
    sides, stores = await single_sides(client, unique_prefix())
    try:
        for _ in range(50 + ops):
            await sides[name]()
    finally:
        for st in stores:
            await st.aclose()
        await client.aclose()


def print_callgrind(ir: dict[str, float]) -> None:
    print("server instructions per call (callgrind on valkey-server, network handling included):")
    for name, v in ir.items():
        print(f"  {name:38s} {v / 1000:8.1f}k   {v / ir[BARE]:.2f}x the bare script   {v / ir[XADD]:.2f}x XADD")


def main() -> None:
    p = bench_args(__doc__ or "")
    p.add_argument("--no-freeze", action="store_true", help="skip gc.freeze() after set-up")
    p.add_argument("--rounds", type=int, default=5, help="rounds the run is cut into, each one's ratio printed")
    p.add_argument("--server-cpu", action="store_true", help="only server CPU per call (commandstats), per round")
    p.add_argument("--ops", type=int, default=2000, help="calls per side and round for --server-cpu")
    p.add_argument("--callgrind", action="store_true", help="only server instructions per call (valgrind)")
    p.add_argument(
        "--client-side",
        choices=sorted(CLIENT_SIDES),
        help="only run this single-entry side --ops times (for the client's instructions: run it under "
        "valgrind --tool=callgrind with --ops 0 and --ops N; the difference / N is per call)",
    )
    args = p.parse_args()
    if args.client_side:
        with server(args.url) as url:
            anyio.run(client_side, url, CLIENT_SIDES[args.client_side], args.ops)
        return
    if args.callgrind:
        ir = callgrind(min(args.ops, 500))
        if ir is not None:
            print_callgrind(ir)
        return
    if args.server_cpu:
        with server(args.url) as url:
            print_server_cpu(anyio.run(server_cpu, url, args.rounds, args.ops))
        return
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
    for median in (False, True):
        how = "by median latency (1 / p50)" if median else "by ops/s (1 / mean latency)"
        print(f"ratio {how} in each of the run's {args.rounds} rounds, first to last (a drift shows here):")
        for name, ours, base, target in results:
            per_round = round_ratios(ours, base, args.rounds, median=median)
            low = min(per_round, default=0.0)
            verdict = f"   (lowest {low:.2f}x {'ok' if low >= float(target[2:]) else 'MISS'})" if target else ""
            print(f"  {name:38s} " + "  ".join(f"{r:.2f}x" for r in per_round) + verdict)
    print(
        "the A/A control row is the baseline against itself: its spread is the measure's own noise here;\n"
        "where the mean's rounds stray from 1.00 on it, the machine's load, not the code, moves the mean"
    )
    for name, ours, base, _ in results:
        if ours.items_per_op > 1:
            print(f"{name}: {ours.items_per_s:,.0f} entries/s vs {base.items_per_s:,.0f} entries/s")


def _us(v: float | None) -> str:
    return "" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    main()
