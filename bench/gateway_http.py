"""The HTTP gateway against the Python store directly, on the same server, side by side in one run.

    python bench/gateway_http.py [--url URL] [--seconds N] [--writers W] [--readers R] [--sessions S]
                                 [--only latency|throughput|fanout] [--stack TEXT]

(Not named ``http.py``: in bench/ that name would shadow the standard library's ``http`` package
for every sibling bench, since running a script puts its folder first on ``sys.path``.)

Each gateway runs as its own process (``redis-session gateway``, as deployed). The client is a
minimal HTTP/1.1 keep-alive client on raw sockets in this process (httpx alone costs more than the
server it would measure), on the same event loop as the store side.

  1. Latency, one writer, interleaved rounds (gateway, store, gateway, …), for each HTTP stack:
     uvicorn with h11 on asyncio (what ran before), uvicorn with httptools on uvloop (the default
     now, the ``fast`` extra), and granian when installed:
       (a) one ~300-byte ``user/message`` appended with ``If-Match`` (expected n);
       (b) a 100-entry batch, the same way;
       (ref) ``GET /healthz`` (liveness: no store call): the HTTP floor.
  2. Throughput: W concurrent writers (default 32), one entry per append, each on its own session,
     through 1, 2 and 4 worker processes (``--workers``), against the store directly.
  3. SSE fan-out: R concurrent SSE readers (default 1 000) of S sessions (default 50) on one gateway
     process, against R direct ``tail``s in this process: a writer appends to every session in
     turn; delivery latency = when a reader has the entry - when its append was sent.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
import msgspec
from _common import Timer, bench_args, drop_prefix, interleave, print_table, server, settle_gc, unique_prefix

from redis_session import NewEntry, RedisSessionStore, SessionHeader

TEXT = "The quick brown fox jumps over the lazy dog; " * 6  # ~270 characters
DATA = {"content": TEXT.strip()}
BATCH = 100
_json = msgspec.json.Encoder()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    """A gateway process: `redis-session gateway` with the given options, on a free port."""

    def __init__(self, url: str, prefix: str, *options: str) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDIS_SESSION_TOKENS")}
        env.pop("REDIS_SESSION_TOKEN", None)
        if options and options[0] == "minimal":  # the floor of the hop (bench/_minimal_http.py)
            here = Path(__file__).resolve().parent
            cmd = [sys.executable, str(here / "_minimal_http.py"), url, prefix, str(self.port)]
        elif options and options[0] == "granian":  # granian serving the same app (bench/_granian_app.py)
            env.update(RS_BENCH_URL=url, RS_BENCH_PREFIX=prefix)
            here = str(Path(__file__).resolve().parent)
            env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1"]
            cmd += ["--port", str(self.port), "--no-ws", *options[1:], "_granian_app:app"]
        else:
            cmd = [sys.executable, "-m", "redis_session.cli", "gateway", "--url", url, "--prefix", prefix]
            cmd += ["--port", str(self.port), *options]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    if s.recv(100).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise SystemExit(f"the gateway ({' '.join(options)}) did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Http:
    """One keep-alive HTTP/1.1 connection: request bytes out, status + body back."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stream: Any = None
        self.buf = b""

    async def connect(self) -> Http:
        self.stream = await anyio.connect_tcp("127.0.0.1", self.port)
        return self

    async def request(self, method: str, path: str, body: bytes = b"", headers: str = "") -> tuple[int, bytes, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        await self.stream.send(head.encode() + b"\r\n" + body)
        while b"\r\n\r\n" not in self.buf:
            self.buf += await self.stream.receive()
        raw_head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = raw_head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v)
        while len(self.buf) < length:
            self.buf += await self.stream.receive()
        got, self.buf = self.buf[:length], self.buf[length:]
        return status, raw_head, got

    async def aclose(self) -> None:
        await self.stream.aclose()


def etag_of(raw_head: bytes) -> int:
    for line in raw_head.split(b"\r\n"):
        if line.lower().startswith(b"etag:"):
            return int(line.split(b":", 1)[1].strip().strip(b'"'))
    raise RuntimeError(raw_head.decode())


class Writer:
    """One session written both ways: through the gateway and through the store."""

    def __init__(self, store: RedisSessionStore, http: Http | None, sid: str, size: int) -> None:
        self.store, self.http, self.sid = store, http, sid
        self.entries = [NewEntry("user/message", DATA)] * size
        self.body = _json.encode(
            [{"type": "user/message", "data": DATA}] * size if size > 1 else {"type": "user/message", "data": DATA}
        )
        self.n = 0

    async def create(self) -> None:
        await self.store.create(SessionHeader(id=self.sid))

    async def via_http(self) -> None:
        assert self.http is not None
        status, head, body = await self.http.request(
            "POST", f"/sessions/{self.sid}/entries", self.body, f'If-Match: "{self.n}"\r\n'
        )
        if status != 201:
            raise RuntimeError(body.decode())
        self.n = etag_of(head)

    async def via_store(self) -> None:
        stored = await self.store.put(self.sid, self.n, self.entries)
        self.n = stored[-1].n + 1


async def concurrent(ops: list[Callable[[], Awaitable[None]]], seconds: float) -> int:
    """How many ops `len(ops)` concurrent loops complete in `seconds`."""
    done = 0
    end = time.perf_counter() + seconds

    async def loop(op: Callable[[], Awaitable[None]]) -> None:
        nonlocal done
        while time.perf_counter() < end:
            await op()
            done += 1

    async with anyio.create_task_group() as tg:
        for op in ops:
            tg.start_soon(loop, op)
    return done


def _row(name: str, g: Timer, s: Timer) -> list[Any]:
    return [name, f"{g.p(50):.3f}", f"{s.p(50):.3f}", f"{g.p(50) / s.p(50):.2f}x", f"{g.p(99):.3f}"]


async def latency(store: RedisSessionStore, gw: Gateway, label: str, seconds: float) -> list[list[Any]]:
    rows: list[list[Any]] = []
    http = await Http(gw.port).connect()
    try:
        for name, size in [("append 1 entry", 1), (f"append {BATCH} entries", BATCH)]:
            w = Writer(store, http, f"seq-{label.replace(' ', '_')}-{size}", size)
            await w.create()
            g, s, floor = Timer("gateway", size), Timer("store", size), Timer("healthz")
            sides: list[tuple[Timer, Callable[[], Awaitable[object]]]] = [(g, w.via_http), (s, w.via_store)]
            if size == 1:
                sides.append((floor, lambda: http.request("GET", "/healthz")))
            settle_gc()
            await interleave(sides, seconds * len(sides), round_s=1.0, per_op=True)
            rows.append(_row(f"{label}: {name}", g, s))
            if floor.samples:
                rows.append([f"{label}: GET /healthz", f"{floor.p(50):.3f}", "-", "-", f"{floor.p(99):.3f}"])
    finally:
        await http.aclose()
    return rows


async def throughput(store: RedisSessionStore, port: int | None, label: str, writers: int, seconds: float) -> float:
    conns = [await Http(port).connect() for _ in range(writers)] if port else [None] * writers
    ws = [Writer(store, c, f"conc-{label}-{i}", 1) for i, c in enumerate(conns)]
    for w in ws:
        await w.create()
    await concurrent([w.via_http if port else w.via_store for w in ws], 0.3)  # warm up
    done = await concurrent([w.via_http if port else w.via_store for w in ws], seconds)
    for c in conns:
        if c is not None:
            await c.aclose()
    return done / seconds


async def fanout(store: RedisSessionStore, port: int, readers: int, sessions: int, seconds: float) -> list[list[Any]]:
    """Delivery latency to `readers` SSE clients and to `readers` direct tails, in turn."""
    sids = [f"fan-{i}" for i in range(sessions)]
    for sid in sids:
        await store.create(SessionHeader(id=sid))
    sent: dict[tuple[str, int], float] = {}
    n = dict.fromkeys(sids, 0)

    async def write(stop: anyio.Event) -> None:
        i = 0
        while not stop.is_set():
            sid = sids[i % sessions]
            i += 1
            sent[(sid, n[sid])] = time.perf_counter()
            await store.put(sid, n[sid], [NewEntry("test/mark", {"i": i})])
            n[sid] += 1
            await anyio.sleep(0.002)

    async def sse_reader(sid: str, start: int, lat: list[float], ready: list[int]) -> None:
        stream = await anyio.connect_tcp("127.0.0.1", port)
        await stream.send(f"GET /sessions/{sid}/events?start={start} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        buf = b""
        first = True
        try:
            while True:
                buf += await stream.receive()
                if first and b"\r\n\r\n" in buf:
                    ready.append(1)
                    first = False
                while b"\nid: " in buf or buf.startswith(b"id: "):
                    at = buf.find(b"id: ")
                    end = buf.find(b"\n", at)
                    if end < 0:
                        break
                    got = int(buf[at + 4 : end].split(b"/")[0].rsplit(b":", 1)[-1])  # <inc>:<n>[/<live id>]
                    buf = buf[end:]
                    t = sent.get((sid, got))
                    if t is not None:
                        lat.append(time.perf_counter() - t)
        finally:
            await stream.aclose()

    async def tail_reader(sid: str, start: int, lat: list[float], ready: list[int]) -> None:
        ready.append(1)
        async for e in store.tail(sid, start):
            t = sent.get((sid, e.n))
            if t is not None:
                lat.append(time.perf_counter() - t)

    rows: list[list[Any]] = []
    results: dict[str, Timer] = {}
    for label, reader in (("SSE via the gateway", sse_reader), ("direct tail", tail_reader)):
        lat: list[float] = []
        ready: list[int] = []
        async with anyio.create_task_group() as tg:
            for i in range(readers):
                sid = sids[i % sessions]
                tg.start_soon(reader, sid, n[sid], lat, ready)
                if i % 50 == 49:  # connect in waves: 1 000 connects at once time out on a loaded machine
                    await anyio.sleep(0.05)
            with anyio.fail_after(120):
                while len(ready) < readers:  # noqa: ASYNC110 (a count reached by many tasks)
                    await anyio.sleep(0.05)
            await anyio.sleep(0.5)
            stop = anyio.Event()
            tg.start_soon(write, stop)
            await anyio.sleep(seconds)
            stop.set()
            await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
        t = Timer(label)
        t.samples = lat
        results[label] = t
    g, d = results["SSE via the gateway"], results["direct tail"]
    rows.append(
        [
            f"{readers} readers of {sessions} sessions",
            f"{g.p(50):.3f}",
            f"{d.p(50):.3f}",
            f"{g.p(50) / d.p(50):.2f}x",
            f"{g.p(99):.3f} / {d.p(99):.3f}",
            f"{len(g.samples):,} / {len(d.samples):,}",
        ]
    )
    return rows


STACKS: list[tuple[str, list[str]]] = [
    ("uvicorn h11 + asyncio", ["--http", "h11", "--loop", "asyncio"]),
    ("uvicorn httptools + uvloop", ["--http", "httptools", "--loop", "uvloop"]),
]
if importlib.util.find_spec("granian") is not None:
    STACKS.append(("granian + uvloop", ["granian", "--loop", "uvloop"]))
# not a gateway: a bare httptools + uvloop server making the same store call (no ASGI, no checks),
# the least any Python HTTP hop adds, so the gateway's own share of its ratio can be read off
STACKS.append(("floor: bare httptools + uvloop server", ["minimal"]))


def main() -> None:
    p = bench_args(__doc__ or "", seconds=3.0)
    p.add_argument("--writers", type=int, default=32, help="concurrent writers of the throughput run")
    p.add_argument("--readers", type=int, default=1000, help="SSE readers of the fan-out run")
    p.add_argument("--sessions", type=int, default=50, help="sessions the SSE readers follow")
    p.add_argument(
        "--only", choices=["latency", "throughput", "fanout"], action="append", help="run only this part (repeatable)"
    )
    p.add_argument("--stack", default=None, help="latency: only the HTTP stacks whose name contains this text")
    args = p.parse_args()
    with server(args.url) as url:
        prefix = unique_prefix()
        pool_url = url + ("&" if "?" in url else "?") + f"max_connections={args.readers + 200}"
        try:
            anyio.run(_run, url, pool_url, prefix, args, backend_options={"use_uvloop": True})
        finally:
            anyio.run(drop_prefix, url, prefix)


async def _run(url: str, pool_url: str, prefix: str, args: Any) -> None:
    store = RedisSessionStore.from_url(pool_url, prefix=prefix, client_options={"socket_connect_timeout": 30})
    try:
        parts = set(args.only or ["latency", "throughput", "fanout"])
        if "latency" in parts:
            await _latency_part(store, url, prefix, args)
        if "throughput" in parts:
            await _throughput_part(store, url, prefix, args)
        if "fanout" in parts:
            await _fanout_part(store, pool_url, prefix, args)
    finally:
        await store.aclose()


async def _latency_part(store: RedisSessionStore, url: str, prefix: str, args: Any) -> None:
    rows: list[list[Any]] = []
    for label, options in STACKS:
        if args.stack is not None and args.stack not in label:
            continue
        gw = Gateway(url, prefix, *options)
        try:
            rows += await latency(store, gw, label, args.seconds)
        finally:
            gw.stop()
    print_table(["latency (one writer)", "gateway p50 ms", "store p50 ms", "ratio", "gateway p99 ms"], rows)
    print("ratio: gateway p50 / store p50 (1.00x = no overhead; the goal is <= 2x)\n")


async def _throughput_part(store: RedisSessionStore, url: str, prefix: str, args: Any) -> None:

    direct = await throughput(store, None, "store", args.writers, args.seconds)
    trows: list[list[Any]] = [["store directly (this process)", f"{direct:,.0f}", "1.00x"]]
    for workers in (1, 2, 4):
        gw = Gateway(url, prefix, "--workers", str(workers))
        try:
            ops = await throughput(store, gw.port, f"w{workers}", args.writers, args.seconds)
        finally:
            gw.stop()
        trows.append([f"gateway, {workers} worker process(es)", f"{ops:,.0f}", f"{ops / direct:.2f}x"])
    print_table([f"throughput ({args.writers} writers, 1 entry)", "appends/s", "vs store"], trows)
    print(f"(this machine has {os.cpu_count()} cores, shared with the server and this client)\n")


async def _fanout_part(store: RedisSessionStore, pool_url: str, prefix: str, args: Any) -> None:
    gw = Gateway(pool_url, prefix)
    try:
        frows = await fanout(store, gw.port, args.readers, args.sessions, args.seconds * 2)
    finally:
        gw.stop()
    print_table(
        [
            "SSE fan-out, one gateway process",
            "SSE p50 ms",
            "tail p50 ms",
            "ratio",
            "p99 ms SSE / tail",
            "deliveries",
        ],
        frows,
    )
    print("delivery: the reader has the entry - its append was sent; the goal is SSE p50 <= 2x tail p50")


if __name__ == "__main__":
    main()
