"""Our store against its peers, on one server in one run.

    python bench/peers.py [--url URL] [--seconds N]

With no URL a private valkey-server (AOF off) is started in a temporary directory.

Peers:
  - the OpenAI Agents SDK's Redis session (`agents.extensions.memory.redis_session.RedisSession`:
    one LIST per session, every append a WATCH/TYPE/MULTI/RPUSH/HSET/EXEC transaction), when
    `openai-agents` is installed (``pip install openai-agents``; skipped otherwise);
  - the floor: the bare command our store is built on, on the same client (XADD of the same JSON
    bytes; XRANGE of 1 000 entries with redis-py's own parsing).

Scenarios, in interleaved rounds so load drift hits every side alike:
  (a) add one chat message (~300 bytes) to a session;
  (b) read a 1 000-item session back as Python objects.

Then the correctness differences that the numbers do not show: two writers that each read the
history and append a reply computed from it (the SDK session has no optimistic concurrency: both
land, interleaved; ours refuses the stale one), and a retried append after a lost reply (no
idempotency key in the SDK: a retry is a duplicate).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
import anyio.lowlevel
import msgspec
import redis.asyncio as aioredis
from _common import Timer, bench_args, drop_prefix, interleave, print_table, server, settle_gc, unique_prefix

from redis_session import NewEntry, RedisSessionStore, SessionConflictError, SessionHeader

TEXT = "The quick brown fox jumps over the lazy dog; " * 6  # ~270 characters
ITEM = {"role": "user", "content": TEXT.strip()}
ITEM_RAW = msgspec.json.encode(ITEM)
READ_N = 1_000


def _sdk_session_class() -> Any:
    try:
        from agents.extensions.memory.redis_session import RedisSession
    except ImportError:
        return None
    return RedisSession


async def main(url: str, seconds: float) -> None:
    prefix = unique_prefix()
    sdk_prefix = f"{prefix}-sdk"
    RedisSession = _sdk_session_class()
    client = aioredis.Redis.from_url(url)
    store = RedisSessionStore(client, prefix=prefix)
    try:
        # ------------------------------------------------------------- (a) add one item
        await store.create(SessionHeader(id="add"))
        await store.create(SessionHeader(id="add-any"))
        n = 0

        async def ours_add() -> None:
            nonlocal n
            got = await store.put("add", n, [NewEntry("message", ITEM)])
            n = got[-1].n + 1

        async def ours_add_any() -> None:
            await store.put("add-any", None, [NewEntry("message", ITEM)])

        raw_key = f"{prefix}:raw:add"

        async def raw_add() -> None:
            await client.xadd(raw_key, {"type": "message", "data": ITEM_RAW})

        sides_a: list[tuple[Timer, Any]] = [
            (Timer("redis-session put (expected_n)"), ours_add),
            (Timer("redis-session put (expected_n=None)"), ours_add_any),
            (Timer("raw XADD (floor)"), raw_add),
        ]
        if RedisSession is not None:
            sdk = RedisSession("add", redis_client=client, key_prefix=sdk_prefix)

            async def sdk_add() -> None:
                await sdk.add_items([ITEM])

            sides_a.append((Timer("openai-agents RedisSession.add_items"), sdk_add))

        # ------------------------------------------------------------- (b) read 1 000 items
        await store.create(SessionHeader(id="read"), [NewEntry("message", ITEM) for _ in range(READ_N)])
        raw_read_key = f"{prefix}:raw:read"
        pipe = client.pipeline(transaction=False)
        for i in range(READ_N):
            pipe.xadd(raw_read_key, {"type": "message", "data": ITEM_RAW}, id=f"{i}-1")
        await pipe.execute()

        async def ours_read() -> None:
            got = await store.read("read")
            assert len(got) == READ_N

        async def raw_read() -> None:
            got = await client.xrange(raw_read_key)
            assert len(got) == READ_N

        sides_b: list[tuple[Timer, Any]] = [
            (Timer("redis-session read -> Entry", READ_N), ours_read),
            (Timer("raw XRANGE, redis-py parsing (floor)", READ_N), raw_read),
        ]
        if RedisSession is not None:
            sdk_r = RedisSession("read", redis_client=client, key_prefix=sdk_prefix)
            for _ in range(0, READ_N, 100):
                await sdk_r.add_items([ITEM] * 100)

            async def sdk_read() -> None:
                got = await sdk_r.get_items()
                assert len(got) == READ_N

            sides_b.append((Timer("openai-agents RedisSession.get_items", READ_N), sdk_read))

        settle_gc()
        await interleave(sides_a, seconds)
        await interleave(sides_b, seconds)

        for title, sides in (("(a) add one ~300-byte message", sides_a), ("(b) read 1 000 items", sides_b)):
            print(f"\n{title}")
            sdk_t = next((t for t, _ in sides if t.name.startswith("openai-agents")), None)
            floor = next(t for t, _ in sides if "floor" in t.name)
            rows = []
            for t, _ in sides:
                rows.append(
                    [
                        t.name,
                        t.ops_per_s,
                        t.median_ms,
                        t.p(99),
                        (t.ops_per_s / sdk_t.ops_per_s) if sdk_t else float("nan"),
                        t.ops_per_s / floor.ops_per_s,
                    ]
                )
            print_table(["side", "ops/s", "p50 ms", "p99 ms", "x SDK", "x floor"], rows)
        if RedisSession is None:
            print("\n(openai-agents is not installed: `pip install openai-agents` to compare with its RedisSession)")

        await correctness(client, store, RedisSession, sdk_prefix)
    finally:
        await drop_prefix(url, prefix)
        await drop_prefix(url, sdk_prefix)
        await client.aclose()


async def correctness(client: aioredis.Redis, store: RedisSessionStore, RedisSession: Any, sdk_prefix: str) -> None:
    """Two writers that each read the history and append a reply computed from it."""
    print("\ncorrectness: two writers, each reads the history then appends a reply based on it")
    await store.create(SessionHeader(id="race"), [NewEntry("message", {"role": "user", "content": "q"})])
    seen = {w: (await store.head("race")).n for w in ("A", "B")}  # both read n=1
    outcomes = {}
    for w in ("A", "B"):
        try:
            await store.put("race", seen[w], [NewEntry("message", {"role": "assistant", "content": f"reply by {w}"})])
            outcomes[w] = "landed"
        except SessionConflictError as e:
            outcomes[w] = f"SessionConflictError (expected n={e.expected_n}, log at n={e.actual_n}): reload, retry"
    log = [e.data["content"] for e in await store.read("race")]
    print(f"  redis-session: A {outcomes['A']}; B {outcomes['B']}; log = {log}")
    if RedisSession is not None:
        sdk = RedisSession("race", redis_client=client, key_prefix=sdk_prefix)
        await sdk.add_items([{"role": "user", "content": "q"}])
        a_saw = await sdk.get_items()
        b_saw = await sdk.get_items()
        await sdk.add_items([{"role": "assistant", "content": f"reply by A (saw {len(a_saw)} items)"}])
        await sdk.add_items([{"role": "assistant", "content": f"reply by B (saw {len(b_saw)} items)"}])
        items = [i["content"] for i in await sdk.get_items()]
        print(f"  openai-agents RedisSession: both landed, nothing noticed; log = {items}")
        print("    (B's reply answers a history without A's reply: a silent lost update; the SDK has")
        print("     no expected-n check, and no idempotency key, so a retried add_items after a lost")
        print("     reply appends the items a second time)")

        # Interleaving: two writers append 3-item turns concurrently; nothing tells them apart.
        sdk2 = RedisSession("interleave", redis_client=client, key_prefix=sdk_prefix)

        async def turn(w: str) -> None:
            for i in range(3):
                await sdk2.add_items([{"role": "assistant", "content": f"{w}{i}"}])
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(turn, "A")
            tg.start_soon(turn, "B")
        print(
            f"  openai-agents, two concurrent writers of 3 items each: {[i['content'] for i in await sdk2.get_items()]}"
        )
    await store.create(SessionHeader(id="inter"))

    async def our_turn(w: str) -> None:
        n = 0
        for i in range(3):
            while True:
                try:
                    got = await store.put(
                        "inter", n, [NewEntry("message", {"role": "assistant", "content": f"{w}{i}"})]
                    )
                    n = got[-1].n + 1
                    break
                except SessionConflictError as e:
                    n = e.actual_n  # a real pod would reload and rebuild its reply here
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(our_turn, "A")
        tg.start_soon(our_turn, "B")
    print(
        "  redis-session, same two writers with expected_n: every interleaving is a conflict the writer "
        f"sees and handles; log = {[e.data['content'] for e in await store.read('inter')]}"
    )


if __name__ == "__main__":
    args = bench_args(
        "redis-session vs the OpenAI Agents SDK's RedisSession vs raw XADD/XRANGE", seconds=4.0
    ).parse_args()
    with server(args.url) as url:
        anyio.run(main, url, args.seconds)
