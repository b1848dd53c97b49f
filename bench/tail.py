"""Append-to-delivery latency of a live tail, three ways, against a raw XREAD BLOCK loop.

    python bench/tail.py [--url URL] [--appends 500]

(a) raw: a redis-py ``XREAD BLOCK`` loop on the session's stream key (the floor);
(b) store: `RedisSessionStore.tail()` (validation, the entry decode);
(c) sse: a lean HTTP/1.1 client (asyncio stream, chunked decoding, SSE lines) reading the
    gateway's ``/events`` stream; the gateway runs in its own process, as in production
    (store.tail + SSE framing + uvicorn), so each entry makes one more process hop than in (a);
(d) sse/httpx: the same stream read with httpx's ``aiter_lines`` (a typical Python client);
(f) floor: a 15-line relay process (XREAD BLOCK, then write "id: n" to a TCP socket, no HTTP),
    what one extra process hop costs on this machine, whatever the gateway does.

Each reader follows its own session and stays connected throughout; the writer appends one entry
at a time, in alternating rounds (a, b, c, a, b, c …) so that drift in the machine's load hits
every reader alike, and measures from just before the append to the moment the reader has the
entry. Only one reader is woken per append. Prints p50/p99 and the ratio of each to (a).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from urllib.parse import quote

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anyio
import httpx
import redis.asyncio as aioredis
from _common import drop_prefix, percentile, print_table, server, settle_gc, unique_prefix

from redis_session import RedisSessionStore, SessionHeader
from redis_session.redis.embedded import free_port

GATEWAY = """
import sys, anyio
from redis_session import RedisSessionStore
from redis_session.gateway import serve

async def main() -> None:
    store = RedisSessionStore.from_url(sys.argv[1], prefix=sys.argv[2])
    await serve(store, "127.0.0.1", int(sys.argv[3]))

anyio.run(main)
"""


class Reader:
    """One tailing client: records when each n arrives and wakes the writer waiting for it."""

    def __init__(self, name: str, session_id: str) -> None:
        self.name = name
        self.session_id = session_id
        self.samples: list[float] = []
        self._waiting: tuple[int, anyio.Event] | None = None
        self.arrived: dict[int, float] = {}

    def got(self, n: int) -> None:
        self.arrived[n] = time.perf_counter()
        if self._waiting is not None and self._waiting[0] == n:
            self._waiting[1].set()

    async def wait(self, n: int) -> float:
        if n not in self.arrived:
            ev = anyio.Event()
            self._waiting = (n, ev)
            with anyio.fail_after(10):
                await ev.wait()
            self._waiting = None
        return self.arrived.pop(n)


async def raw_loop(url: str, key: str, reader: Reader, ready: anyio.Event) -> None:
    r = aioredis.Redis.from_url(url)
    last = "0-0"
    try:
        ready.set()
        while True:
            resp = await r.xread({key: last}, block=0, count=1000)
            for _, rows in resp:
                for rid, _fields in rows:
                    reader.got(int(rid.split(b"-")[0]))
                    last = rid
    finally:
        await r.aclose()


async def store_loop(url: str, prefix: str, reader: Reader, ready: anyio.Event) -> None:
    store = RedisSessionStore.from_url(url, prefix=prefix)
    try:
        ready.set()
        async for e in store.tail(reader.session_id, 0):
            reader.got(e.n)
    finally:
        await store.aclose()


async def sse_lean_loop(base: str, reader: Reader, ready: anyio.Event) -> None:
    """A minimal SSE client: one GET, chunked transfer decoding, "id:" lines."""
    host, port = base.removeprefix("http://").split(":")
    path = f"/sessions/{quote(reader.session_id, safe='')}/events"
    async with await anyio.connect_tcp(host, int(port)) as s:
        await s.send(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += await s.receive()
        status, _, buf = buf.partition(b"\r\n\r\n")
        assert b" 200 " in status.split(b"\r\n", 1)[0], status
        ready.set()
        body = b""
        while True:
            while b"\r\n" not in buf:
                buf += await s.receive()
            size_line, _, buf = buf.partition(b"\r\n")
            size = int(size_line, 16)
            while len(buf) < size + 2:
                buf += await s.receive()
            body += buf[:size]
            buf = buf[size + 2 :]
            *lines, body = body.split(b"\n")
            for line in lines:
                if line.startswith(b"id: "):
                    reader.got(int(line[4:]))


async def sse_httpx_loop(base: str, reader: Reader, ready: anyio.Event) -> None:
    async with (
        httpx.AsyncClient(base_url=base, timeout=None) as client,
        client.stream("GET", f"/sessions/{quote(reader.session_id, safe='')}/events") as r,
    ):
        ready.set()
        async for line in r.aiter_lines():
            if line.startswith("id: "):
                reader.got(int(line[4:]))


RELAY = """
import sys, anyio, redis.asyncio as aioredis

async def main() -> None:
    r = aioredis.Redis.from_url(sys.argv[1])

    async def handle(stream) -> None:
        last = "0-0"
        try:
            while True:
                for _, rows in await r.xread({sys.argv[2]: last}, block=0):
                    for rid, _fields in rows:
                        await stream.send(b"id: " + rid.split(b"-")[0] + b"\\n")
                        last = rid
        except (anyio.BrokenResourceError, OSError):
            pass  # that client left (the start-up probe does)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=int(sys.argv[3]))
    await listener.serve(handle)

anyio.run(main)
"""


async def relay_loop(port: int, reader: Reader, ready: anyio.Event) -> None:
    async with await anyio.connect_tcp("127.0.0.1", port) as s:
        ready.set()
        buf = b""
        while True:
            buf += await s.receive()
            *lines, buf = buf.split(b"\n")
            for line in lines:
                reader.got(int(line[4:]))


def start_relay(url: str, key: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", RELAY, url, key, str(port)])
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the relay did not start") from None
            time.sleep(0.05)


def start_gateway(url: str, prefix: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", GATEWAY, url, prefix, str(port)])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            httpx.get(f"{base}/openapi.json", timeout=1).raise_for_status()
            return proc, base
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the gateway did not start") from None
            time.sleep(0.05)


async def run(url: str, appends: int, rounds: int) -> list[Reader]:
    prefix = unique_prefix()
    writer = RedisSessionStore.from_url(url, prefix=prefix)
    readers = [
        Reader("(a) raw XREAD BLOCK", "bench-a"),
        Reader("(b) store.tail()", "bench-b"),
        Reader("(c) SSE, lean client", "bench-c"),
        Reader("(d) SSE, httpx client", "bench-d"),
        Reader("(f) floor: relay process", "bench-f"),
    ]
    for rd in readers:
        await writer.create(SessionHeader(id=rd.session_id))
    proc, base = start_gateway(url, prefix)
    relay, relay_port = start_relay(url, writer.keys.log("bench-f"))
    try:
        async with anyio.create_task_group() as tg:
            loops: list[Callable[[anyio.Event], Awaitable[None]]] = [
                lambda ready: raw_loop(url, writer.keys.log("bench-a"), readers[0], ready),
                lambda ready: store_loop(url, prefix, readers[1], ready),
                lambda ready: sse_lean_loop(base, readers[2], ready),
                lambda ready: sse_httpx_loop(base, readers[3], ready),
                lambda ready: relay_loop(relay_port, readers[4], ready),
            ]
            for loop in loops:
                ready = anyio.Event()
                tg.start_soon(loop, ready)
                await ready.wait()
            n = 0
            warmup = 20
            per_round = max(1, appends // rounds)
            settle_gc()
            for r in range(rounds + 1):
                count = warmup if r == 0 else per_round
                for rd in readers:
                    for i in range(count):
                        await anyio.sleep(0.001)  # the reader is blocked again before the append
                        t0 = time.perf_counter()
                        await writer.put(rd.session_id, None, [("bench/tick", {"i": i})])
                        t1 = await rd.wait(n + i)
                        if r > 0:
                            rd.samples.append(t1 - t0)
                n += count  # every session moves in step
            tg.cancel_scope.cancel()
    finally:
        for p in (proc, relay):
            p.terminate()
            p.wait(10)
        await writer.aclose()
        await drop_prefix(url, prefix)
    return readers


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="server to measure on (default: a private valkey-server)")
    p.add_argument("--appends", type=int, default=500, help="measured appends per reader")
    p.add_argument("--rounds", type=int, default=10, help="alternating rounds the appends are split into")
    args = p.parse_args()
    with server(args.url) as url:
        readers = anyio.run(run, url, args.appends, args.rounds)
    base50 = percentile(readers[0].samples, 50)
    base99 = percentile(readers[0].samples, 99)
    rows = []
    for rd in readers:
        p50, p99 = percentile(rd.samples, 50), percentile(rd.samples, 99)
        rows.append([rd.name, len(rd.samples), p50 * 1000, p99 * 1000, p50 / base50, p99 / base99])
    print(f"append-to-delivery latency, {len(readers[0].samples)} appends per reader (ms)")
    print_table(["reader", "appends", "p50 ms", "p99 ms", "p50 / (a)", "p99 / (a)"], rows)
    verdict = "ok" if rows[2][4] <= 1.5 else "over"
    print(f"target: SSE p50 <= 1.5x raw: {rows[2][4]:.2f}x ({verdict}); one extra process hop alone: {rows[4][4]:.2f}x")


if __name__ == "__main__":
    main()
