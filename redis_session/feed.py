"""The change feed's consumer side, shared by every worker that reads it (the projector and the
compactor): consumer-group names, consumer ids, and parsing of XREADGROUP / XAUTOCLAIM replies
(RESP2 or RESP3) read undecoded through `redis.wire.feed_client`.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import secrets
import signal
import socket
from typing import Any, ClassVar

import anyio
from redis.exceptions import RedisError

from .errors import StoreUnavailableError
from .keys import validate_prefix
from .redis.replies import io_guard
from .redis.store import RedisSessionStore
from .redis.wire import RAW, feed_client

log = logging.getLogger(__name__)

FeedRow = tuple[str, str, dict[str, str] | None]

__all__ = [
    "FeedWorker",
    "as_map",
    "as_str",
    "default_consumer",
    "entry_rows",
    "feed_client_of",
    "stream_rows",
    "validate_group",
]


def validate_group(group: str) -> str:
    validate_prefix(group)  # same alphabet: no braces, whitespace or control characters
    return group


def as_str(b: Any) -> str:
    return b.decode() if isinstance(b, bytes | bytearray) else str(b)


def as_map(raw: Any) -> dict[str, Any]:
    """A RESP2 flat list or a RESP3 map as a dict with str keys."""
    if isinstance(raw, dict):
        return {as_str(k): v for k, v in raw.items()}
    if not raw:
        return {}
    return {as_str(k): v for k, v in zip(raw[::2], raw[1::2], strict=False)}


def stream_rows(raw: Any) -> builtins.list[tuple[str, str, dict[str, str] | None]]:
    """``(stream key, entry id, fields or None)`` from an XREADGROUP reply (RESP2 or RESP3)."""
    if not raw:
        return []
    pairs = raw.items() if isinstance(raw, dict) else ((p[0], p[1]) for p in raw)
    out: builtins.list[tuple[str, str, dict[str, str] | None]] = []
    for key, rows in pairs:
        k = as_str(key)
        for rid, fields in entry_rows(rows):
            out.append((k, rid, fields))
    return out


def entry_rows(rows: Any) -> builtins.list[tuple[str, dict[str, str] | None]]:
    if not rows:
        return []
    if isinstance(rows, dict):  # RESP3 attribute-free map form (some servers)
        rows = builtins.list(rows.items())
    out: builtins.list[tuple[str, dict[str, str] | None]] = []
    for row in rows:
        rid, fields = row[0], row[1]
        out.append((as_str(rid), None if fields is None else {k: as_str(v) for k, v in as_map(fields).items()}))
    return out


def default_consumer() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(2)}"


def feed_client_of(store: RedisSessionStore) -> Any:
    """The store's client for the feed commands, replies unparsed (`wire.feed_client`)."""
    return feed_client(store.client)


class FeedWorker:
    """What every consumer of the change feed shares (the projector, the compactor): the group on
    every shard, the read loop with its retry and stop, SIGTERM handling, reclaiming a dead
    worker's pending entries, and the metrics endpoint. A subclass sets the attributes below in
    its ``__init__`` and implements `run_once` (one batch; returns the feed entries acked)."""

    kind: ClassVar[str] = "worker"  # names it in logs
    in_hand: ClassVar[str] = "the work in hand"  # what a SIGTERM lets it finish

    store: RedisSessionStore
    group: str
    consumer: str
    batch: int
    claim_idle_ms: int
    metrics_port: int | None
    metrics_addr: str
    metrics: Any  # has a `reclaimed` counter
    feeds: builtins.list[str]
    _r: Any
    _stats_key: str
    _stopping: bool
    _groups_ready: bool
    _idle_scope: anyio.CancelScope | None
    _http: Any
    _claim_cursor: dict[str, str]
    _deferred: dict[str, Any]  # session → its held-back work (an `ids` map of feed key → entry ids)

    async def run_once(self, *, block: bool = False) -> int:
        raise NotImplementedError

    def stop(self) -> None:
        """Ask `run()` to return: an idle read is interrupted, the work in hand is finished first."""
        self._stopping = True
        if self._idle_scope is not None:
            self._idle_scope.cancel()

    @property
    def deferred(self) -> int:
        """Sessions this worker holds back for a busy lock (their feed entries are still pending)."""
        return len(self._deferred)

    async def run(self) -> None:
        """Consume the feed until `stop()` (a `stop()` before `run()` makes it return at once)."""
        self._start_http()
        try:
            while not self._stopping:
                try:
                    # in the retried part: a connection closed while the groups are made (a worker
                    # starting while the server drops clients) is retried like any other read
                    await self.ensure_groups()
                    await self.run_once(block=True)
                except (StoreUnavailableError, RedisError, OSError) as e:
                    if self._stopping:
                        break
                    if "NOGROUP" in str(e):  # the group (or a feed key) was deleted: recreate it
                        self._groups_ready = False
                    log.warning("%s %s: %s; retrying in 1 s", self.kind, self.consumer, e)
                    with anyio.move_on_after(1.0) as scope:
                        self._idle_scope = scope
                        await anyio.sleep_forever()
                    self._idle_scope = None
        finally:
            self._stop_http()
            self._stopping = False

    async def run_forever(self) -> None:
        """`run()` with SIGTERM/SIGINT handled: a signal stops it after the work in hand."""
        async with anyio.create_task_group() as tg:

            async def _signals() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("%s %s: signal %s, finishing %s", self.kind, self.consumer, signum, self.in_hand)
                        self.stop()
                        return

            tg.start_soon(_signals)
            await self.run()
            tg.cancel_scope.cancel()

    group_start = "0"  # where a new group starts on a shard: "0" the retained feed, "$" its end

    async def ensure_groups(self) -> None:
        """Create the group on every feed shard (from `group_start`, MKSTREAM); existing groups are
        kept (they resume where they left off). `groups_created` hears of the shards it created."""
        if self._groups_ready:
            return
        created: builtins.list[str] = []
        for key in self.feeds:
            try:
                await self._r.execute_command("XGROUP", "CREATE", key, self.group, self.group_start, "MKSTREAM")
                created.append(key)
            except RedisError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self._groups_ready = True
        if created:
            self.groups_created(created)

    def groups_created(self, keys: builtins.list[str]) -> None:
        """Called once the group was created on `keys` (a first start); a hook for subclasses."""

    def _start_http(self) -> None:
        if self.metrics_port is None or self._http is not None:
            return
        from prometheus_client import start_http_server

        self._http = start_http_server(self.metrics_port, addr=self.metrics_addr, registry=self.metrics.registry)

    def _stop_http(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None

    async def _cmd(self, *args: Any) -> Any:
        """One raw command of the feed loop; a lost connection as `StoreUnavailableError`."""
        with io_guard():
            return await self._r.execute_command(*args, **RAW)

    async def _read(self, start: dict[str, str], block_ms: int | None) -> builtins.list[FeedRow]:
        """XREADGROUP from `start` (per feed key: ``>`` for new entries, an id for our own)."""
        group, consumer, count = self.group, self.consumer, self.batch
        if not self.store.cluster:
            args: builtins.list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
            if block_ms is not None:
                args += ["BLOCK", block_ms]
            args += ["STREAMS", *start.keys(), *start.values()]
            return stream_rows(await self._cmd(*args))
        # A cluster puts the shards in different slots: one read per shard, then a short poll.
        out: builtins.list[FeedRow] = []
        for key, from_id in start.items():
            raw = await self._cmd("XREADGROUP", "GROUP", group, consumer, "COUNT", count, "STREAMS", key, from_id)
            out.extend(stream_rows(raw))
        if not out and block_ms:
            await anyio.sleep(min(block_ms, 100) / 1000)
        return out

    async def _autoclaim(self) -> builtins.list[FeedRow]:
        """Entries idle past ``claim_idle_ms`` in any consumer's pending list (a dead worker's)."""
        out: builtins.list[FeedRow] = []
        for key in self.feeds:
            cursor = self._claim_cursor[key]
            idle = self.claim_idle_ms
            raw = await self._cmd("XAUTOCLAIM", key, self.group, self.consumer, idle, cursor, "COUNT", self.batch)
            self._claim_cursor[key] = as_str(raw[0])
            for rid, fields in entry_rows(raw[1]):
                out.append((key, rid, fields))
        # Entries this worker deferred (a busy lock) idle in its own list too: not a reclaim.
        mine = {(k, rid) for w in self._deferred.values() for k, rids in w.ids.items() for rid in rids}
        fresh = sum(1 for key, rid, _ in out if (key, rid) not in mine)
        if fresh:
            self.metrics.reclaimed.inc(fresh)
            with contextlib.suppress(RedisError, OSError):
                await self._r.execute_command("HINCRBY", self._stats_key, "reclaimed", fresh)
            log.info("%s %s: reclaimed %d idle feed entries", self.kind, self.consumer, fresh)
        return out
