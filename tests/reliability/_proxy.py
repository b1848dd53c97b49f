"""A small TCP fault proxy for reliability tests: client <-> proxy <-> a real server, on loopback.

It runs its own asyncio loop in a daemon thread, so a test's event loop (or a synchronous test)
drives it with plain attribute writes and method calls, and a stuck test loop never stalls it.

Faults, all changeable while traffic flows:

- ``delay`` / ``jitter``: seconds added before each forwarded chunk (both directions, order kept);
- ``cut_rate``: per forwarded chunk, the chance that the connection is cut right there: a random
  prefix of the chunk (``cut_keeps`` bytes when set: 0 loses the whole reply) is forwarded, then
  both sides are reset. A cut on the way up can leave a
  half-sent command (the server drops it); on the way down a half-sent reply (the client sees a
  torn reply, then EOF) or a command that ran but whose reply never arrives (the ambiguous case
  idempotency keys exist for);
- ``blackhole``: accept and read, forward nothing (a partition: calls hang until their timeout);
- ``refuse``: close new connections at once;
- ``cut_all()``: reset every open connection now.

Only loopback addresses are used: the proxy listens on 127.0.0.1 and forwards to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass, field


@dataclass
class ProxyStats:
    connections: int = 0
    chunks_up: int = 0
    chunks_down: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    cuts: int = 0
    cuts_mid_reply: int = 0
    dropped_chunks: int = 0
    refused: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


class FaultProxy:
    """``with FaultProxy(server_port) as proxy: ... proxy.url ...``"""

    def __init__(self, upstream_port: int, *, upstream_host: str = "127.0.0.1", seed: int = 0) -> None:
        if upstream_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the fault proxy only forwards to loopback")
        self.upstream = (upstream_host, upstream_port)
        self.delay = 0.0
        self.jitter = 0.0
        self.cut_rate = 0.0
        self.cut_up = True  # allow cuts on the client -> server direction
        self.cut_down = True  # allow cuts on the server -> client direction
        self.cut_keeps: int | None = None  # bytes of a cut chunk forwarded (None: a random prefix)
        self.blackhole = False
        self.refuse = False
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # pragma: no cover - start failures are reported below
                error.append(e)
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        if error:
            raise error[0]
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def _shutdown() -> None:
            if self._server is not None:
                self._server.close()
            self._cut_all_now()
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(_shutdown(), loop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut_all(self) -> None:
        """Reset every open connection (new ones are accepted as usual)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            done = threading.Event()

            def _do() -> None:
                self._cut_all_now()
                done.set()

            loop.call_soon_threadsafe(_do)
            done.wait(5)

    def heal(self) -> None:
        """Back to a clean pipe: no delay, no cuts, no blackhole, no refusals."""
        self.delay = self.jitter = self.cut_rate = 0.0
        self.blackhole = self.refuse = False

    # ------------------------------------------------------------------ internals

    def _cut_all_now(self) -> None:
        for cw, sw in list(self._conns):
            _abort(cw)
            _abort(sw)
        self._conns.clear()

    def _count(self, kind: str) -> None:
        self.stats.kinds[kind] = self.stats.kinds.get(kind, 0) + 1

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.refuse:
            self.stats.refused += 1
            _abort(client_w)
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            _abort(client_w)
            return
        self.stats.connections += 1
        pair = (client_w, server_w)
        self._conns.add(pair)
        try:
            await asyncio.gather(
                self._pump(client_r, server_w, pair, up=True),
                self._pump(server_r, client_w, pair, up=False),
            )
        finally:
            self._conns.discard(pair)
            _abort(client_w)
            _abort(server_w)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        *,
        up: bool,
    ) -> None:
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                if self.blackhole:
                    self.stats.dropped_chunks += 1
                    continue
                if self.delay or self.jitter:
                    await asyncio.sleep(self.delay + self._rng.random() * self.jitter)
                if pair not in self._conns:
                    break
                may_cut = self.cut_up if up else self.cut_down
                if may_cut and self.cut_rate and self._rng.random() < self.cut_rate:
                    keep = self._rng.randrange(0, len(chunk) + 1) if self.cut_keeps is None else self.cut_keeps
                    keep = min(keep, len(chunk))
                    if keep:
                        writer.write(chunk[:keep])
                        with contextlib.suppress(ConnectionError):
                            await writer.drain()
                    self.stats.cuts += 1
                    if not up and 0 < keep < len(chunk):
                        self.stats.cuts_mid_reply += 1
                    self._count(
                        ("up" if up else "down") + (":none" if keep == 0 else ":part" if keep < len(chunk) else ":all")
                    )
                    self._conns.discard(pair)
                    _abort(pair[0])
                    _abort(pair[1])
                    return
                if up:
                    self.stats.chunks_up += 1
                    self.stats.bytes_up += len(chunk)
                else:
                    self.stats.chunks_down += 1
                    self.stats.bytes_down += len(chunk)
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            _abort(pair[0])
            _abort(pair[1])


def _abort(w: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        w.transport.abort()
