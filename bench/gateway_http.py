"""Appends through the HTTP gateway against the Python store directly, on the same server.

    python bench/gateway_http.py [--url URL] [--seconds N] [--writers W]

(Not named ``http.py``: in bench/ that name would shadow the standard library's ``http`` package
for every sibling bench, since running a script puts its folder first on ``sys.path``.)

The gateway runs as its own process (``redis-session gateway``, as deployed); the client is
httpx with keep-alive in this process. In interleaved rounds (gateway, store, gateway, …):
  (a) one ~300-byte ``user/message`` appended with ``If-Match`` (expected n), one writer;
  (b) a 100-entry batch, the same way;
  (c) throughput of W concurrent writers (default 16), each on its own session, one entry per
      append, for the time budget of each side.
The ratio is gateway / store (ops/s); the p50 ratio is store p50 / gateway p50. A reference
row, ``GET /healthz`` (one HEAD on the store), shows the HTTP floor on this machine: the
client, uvicorn and Starlette, which an append through the gateway pays before any write.
"""

from __future__ import annotations

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
import httpx
from _common import Timer, bench_args, drop_prefix, interleave, print_table, server, settle_gc, unique_prefix

from redis_session import NewEntry, RedisSessionStore, SessionHeader

TEXT = "The quick brown fox jumps over the lazy dog; " * 6  # ~270 characters
DATA = {"content": TEXT.strip()}
BATCH = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_gateway(url: str, prefix: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDIS_SESSION_TOKENS")}
    cmd = [sys.executable, "-m", "redis_session.cli", "gateway", "--url", url, "--prefix", prefix, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the gateway did not start")


class Writer:
    """One session written both ways: through the gateway and through the store."""

    def __init__(self, store: RedisSessionStore, http: httpx.AsyncClient, sid: str, size: int) -> None:
        self.store, self.http, self.sid = store, http, sid
        self.entries = [NewEntry("user/message", DATA)] * size
        self.body = [{"type": "user/message", "data": DATA}] * size
        self.n = 0

    async def create(self) -> None:
        await self.store.create(SessionHeader(id=self.sid))

    async def via_http(self) -> None:
        r = await self.http.post(f"/sessions/{self.sid}/entries", json=self.body, headers={"If-Match": f'"{self.n}"'})
        if r.status_code != 201:
            raise RuntimeError(r.text)
        self.n = int(r.headers["etag"].strip('"'))

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


async def run(url: str, base: str, prefix: str, seconds: float, writers: int) -> list[list[Any]]:
    store = RedisSessionStore.from_url(url, prefix=prefix)
    rows: list[list[Any]] = []
    limits = httpx.Limits(max_connections=writers + 4, max_keepalive_connections=writers + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as http:
        try:
            for name, size in [("(a) append 1 entry", 1), (f"(b) append {BATCH} entries", BATCH)]:
                w = Writer(store, http, f"seq-{size}", size)
                await w.create()
                g, s, floor = Timer("gateway", size), Timer("store", size), Timer("healthz")
                sides: list[tuple[Timer, Callable[[], Awaitable[object]]]] = [(g, w.via_http), (s, w.via_store)]
                if size == 1:  # the HTTP floor: client, uvicorn, Starlette and one store round trip
                    sides.append((floor, lambda: http.get("/healthz")))
                settle_gc()
                await interleave(sides, seconds * len(sides))
                rows.append(_row(name, g.ops_per_s, s.ops_per_s, g.p(50), s.p(50), size))
                if floor.samples:
                    rows.append(_row("(ref) GET /healthz", floor.ops_per_s, s.ops_per_s, floor.p(50), s.p(50), 1))
            ws = [Writer(store, http, f"conc-{i}", 1) for i in range(writers)]
            for w in ws:
                await w.create()
            g_ops = s_ops = 0
            for _ in range(2):  # alternate halves, so drift hits both sides
                g_ops += await concurrent([w.via_http for w in ws], seconds / 2)
                s_ops += await concurrent([w.via_store for w in ws], seconds / 2)
            rows.append(_row(f"(c) {writers} writers, 1 entry", g_ops / seconds, s_ops / seconds, None, None, 1))
        finally:
            await store.aclose()
    return rows


def _row(name: str, g: float, s: float, gp50: float | None, sp50: float | None, size: int) -> list[Any]:
    ratio = g / s if s else 0.0
    p50 = "-" if gp50 is None or sp50 is None else f"{gp50:.3f} / {sp50:.3f}"
    p50_ratio = "-" if gp50 is None or sp50 is None or not gp50 else f"{sp50 / gp50:.2f}x"
    return [name, f"{g:,.0f}", f"{s:,.0f}", f"{ratio:.2f}x", p50, p50_ratio, f"{g * size:,.0f} / {s * size:,.0f}"]


def main() -> None:
    p = bench_args(__doc__ or "", seconds=4.0)
    p.add_argument("--writers", type=int, default=16, help="concurrent writers of (c)")
    args = p.parse_args()
    with server(args.url) as url:
        prefix = unique_prefix()
        proc, base = start_gateway(url, prefix)
        try:
            rows = anyio.run(run, url, base, prefix, args.seconds, args.writers)
        finally:
            proc.terminate()
            proc.wait(10)
            anyio.run(drop_prefix, url, prefix)
    print_table(
        ["scenario", "gateway ops/s", "store ops/s", "ratio", "p50 ms gw / store", "p50 ratio", "entries/s gw / store"],
        rows,
    )
    print("ratio: gateway / store ops/s; p50 ratio: store p50 / gateway p50 (1.00x = no overhead)")


if __name__ == "__main__":
    main()
