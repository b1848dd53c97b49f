"""Projector workers: keep every session's projection snapshot fresh from the change feed.

A pod loads the model context of a long session from a snapshot plus the few entries after it,
instead of replaying the log (docs/design.md §6). This module is the writing side of that cache;
the reading side (`load_messages`, `SnapshotCache`) is `redis_session.snapshots`.

- `Projector`, the worker. Each append script XADDs ``{s: session, n: new n}`` to a change-feed
  shard (``{prefix}:feed:{k}``; `RedisSessionStore.publish` adds ``{s, ev}`` for a branch). Workers
  read the shards in one consumer group, coalesce a batch per session, fold each session's new
  entries onto its snapshot and write it with the forward-only ``put_projection``; then XACK.
- `status`, for ``redis-session projector --status`` (the CLI entry is `redis_session.cli`).

Design choices (the why):

- **Groups start at id 0** (``XGROUP CREATE … 0 MKSTREAM``). A projector deployed onto an existing
  database, or a group recreated by an operator, then catches up on every session still named in
  the retained feed (MAXLEN ~100 000 per shard). ``$`` would silently skip them until their next
  append. Replaying old hints is cheap: each session is folded once per batch, to its head, and a
  hint at or under the stored snapshot's n is acked after one ``HGET``, without a fold.
- **The feed is a hint.** A session is folded to its *current* head n, never to the n in the feed
  entry, so lost or coalesced entries only delay a snapshot.
- **Locking.** Correctness rests on ``put_projection`` alone (proj.lua: a snapshot is written only
  when its n is greater than the stored one, so workers never move it backwards or apply a batch
  twice). On top of that a short per-session lock ``{prefix}:{id}:plock`` (``SET NX PX``) keeps two
  workers from folding one hot session at the same time (wasted reads, and worse, a rebuild done
  three times). A worker that finds the lock taken keeps the session's feed entries unacked and
  retries it on its next loop, so no update is lost behind another worker's older fold. The lock
  is released with a plain DEL: if it had expired and another worker holds it now, the worst case
  is one more concurrent fold, which the forward-only write makes harmless. A dead worker's lock
  lapses after ``lock_ms``.
- **Cuts and replaces.** `ProjectionState` folds both incrementally, so the snapshot never has to
  be replayed from 0. A cut is still used to *compact* the snapshot: when the tail to fold holds a
  cut whose window ``[before, cut)`` is small (≤ ``cut_window``), the state is rebuilt from that cut
  (`ProjectionState.from_cut`: the cut, its window and the entries after it), which drops the
  history the cut hides, so snapshots stay as small as what the model sees. A missing or damaged
  snapshot is rebuilt the same way from the header's ``last_cut``; when ``from_cut`` cannot decide
  (a replace in the window naming older history) it is a full fold from 0. A new branch without
  a cut of its own starts from its parent's snapshot when that one is not past the branch point.
- **Acks.** Per session, after its snapshot is written (or found current, or the session deleted),
  in one round trip with the lock release and the cluster-wide counters in
  ``{prefix}:projector:{group}:stats`` (what `status` reports). A worker killed
  mid-batch leaves only its unfinished sessions pending; another worker reclaims them with
  XAUTOCLAIM once they are idle for ``claim_idle_ms``. A fold that fails (Redis down, a corrupt log)
  is not acked either, so it is retried after ``claim_idle_ms``.
- **Incarnations.** A fold reads the head first and everything after it as of that head's
  ``incarnation`` (reads of another one raise `SessionReplacedError`), and proj.lua writes the
  snapshot only while the header still has that incarnation: a session deleted and re-created
  while a worker folded it never receives the old log's projection.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from redis.exceptions import RedisError

from .errors import InvalidSessionIdError, SessionNotFoundError, StoreUnavailableError
from .feed import FeedWorker, as_map, as_str, default_consumer, feed_client_of, validate_group
from .keys import validate_session_id
from .model import CUT, SessionHead
from .projection.fold import ProjectionState
from .redis.store import RedisSessionStore
from .redis.wire import RAW
from .snapshots import fold_from_cut, fold_range, plausible, rebuild

log = logging.getLogger("redis_session.projector")

DEFAULT_GROUP = "projector"

# The outcomes of one session's fold.
WRITTEN = "written"  # a newer snapshot was written
CURRENT = "current"  # the stored snapshot already covers the head (or another worker's does now)
DELETED = "deleted"  # the session is gone: skipped, its feed entries acked
BUSY = "busy"  # another worker holds the session's lock: retried on the next loop
FAILED = "failed"  # an error: left pending, reclaimed after claim_idle_ms


# --------------------------------------------------------------------------- metrics


class ProjectorMetrics:
    """The worker's Prometheus metrics, in their own registry (``metrics.registry``)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = "redis_session_projector"
        self.processed = Counter(f"{p}_processed", "Feed entries handled and acked", registry=r)
        self.reclaimed = Counter(f"{p}_reclaimed", "Feed entries reclaimed from idle consumers", registry=r)
        self.folds = Counter(f"{p}_folds", "Session folds by outcome", ["outcome"], registry=r)
        self.entries = Counter(f"{p}_entries_folded", "Log entries folded into snapshots", registry=r)
        self.rebuilds = Counter(
            f"{p}_rebuilds", "Snapshots rebuilt instead of extended, by source", ["source"], registry=r
        )
        self.lag = Gauge(f"{p}_lag", "Feed entries not yet delivered to the group", ["shard"], registry=r)
        self.pending = Gauge(f"{p}_pending", "Feed entries delivered but not acked", ["shard"], registry=r)
        self.batch_seconds = Histogram(f"{p}_batch_seconds", "Time to handle one batch", registry=r)

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent), e.g. ``value("processed_total")``."""
        got = self.registry.get_sample_value(f"redis_session_projector_{name}", labels or None)
        return 0.0 if got is None else float(got)


# --------------------------------------------------------------------------- the worker


@dataclass
class _Work:
    """The feed entries of one session in this batch (coalesced: one fold for all)."""

    session_id: str
    hint: int = -1  # the largest n the entries name
    event: bool = False  # an entry without n (a branch event): always fold
    ids: dict[str, set[str]] = field(default_factory=dict)  # feed key -> entry ids

    def add(self, key: str, rid: str, n: int | None) -> None:
        self.ids.setdefault(key, set()).add(rid)
        if n is None:
            self.event = True
        else:
            self.hint = max(self.hint, n)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.ids.values())


SessionHook = Callable[[str], Awaitable[None]]


class Projector(FeedWorker):
    kind = "projector"
    in_hand = "the batch in hand"

    """One projector worker (a consumer of the change-feed group).

    >>> p = Projector(store, consumer="pod-a", metrics_port=9108)
    >>> await p.run_forever()          # until SIGTERM/SIGINT; the batch in hand is finished

    Several workers (processes or tasks) share the work of one `group`. `run()` until `stop()`;
    `run_once()` handles one batch (tests, cron-style use); `fold(id)` brings one session's snapshot
    to its head now.

    Parameters: `batch` feed entries per shard per read; `claim_idle_ms` how long another
    consumer's entry stays pending before this worker reclaims it; `lock_ms` the per-session lock's
    expiry (``0`` disables the lock); `cut_window` the largest cut window worth a compacting rebuild;
    `concurrency` sessions folded at once; `block_ms` how long an idle read blocks; `on_session`
    an async hook called with each session id as its fold begins (tests use it to pause).
    """

    def __init__(
        self,
        store: RedisSessionStore,
        *,
        consumer: str | None = None,
        group: str = DEFAULT_GROUP,
        batch: int = 200,
        claim_idle_ms: int = 30_000,
        metrics_port: int | None = None,
        metrics_addr: str = "0.0.0.0",
        block_ms: int = 2_000,
        lock_ms: int = 10_000,
        concurrency: int = 8,
        cut_window: int = 20_000,
        chunk: int = 20_000,
        stats_interval: float = 5.0,
        consumer_ttl_ms: int = 3_600_000,
        registry: Any = None,
        on_session: SessionHook | None = None,
    ) -> None:
        if batch < 1 or claim_idle_ms < 1 or concurrency < 1 or block_ms < 1 or lock_ms < 0:
            raise ValueError("batch, claim_idle_ms, concurrency and block_ms must be >= 1; lock_ms >= 0")
        self.store = store
        self.group = validate_group(group)
        self.consumer = validate_group(consumer or default_consumer())
        self.batch = batch
        self.claim_idle_ms = claim_idle_ms
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.block_ms = block_ms
        self.lock_ms = lock_ms
        self.concurrency = concurrency
        self.cut_window = cut_window
        self.chunk = chunk
        self.stats_interval = stats_interval
        self.consumer_ttl_ms = consumer_ttl_ms
        self.on_session = on_session
        self.metrics = ProjectorMetrics(registry)
        self.feeds = store.keys.all_feeds()
        self._r = feed_client_of(store)
        self._stats_key = store.keys.projector_stats(self.group)
        self._stopping = False
        self._idle_scope: anyio.CancelScope | None = None
        self._deferred: dict[str, _Work] = {}
        # Our own pending entries (a restart under the same name) are read once, from id 0 on,
        # before new ones; the cursor advances so entries left pending are not re-read forever.
        self._backlog: dict[str, str] | None = dict.fromkeys(self.feeds, "0")
        self._claim_cursor = {k: "0-0" for k in self.feeds}
        self._next_claim = 0.0
        self._next_stats = 0.0
        self._groups_ready = False
        self._http: Any = None
        self.batches = 0

    # ------------------------------------------------------------------ lifecycle

    # ------------------------------------------------------------------ one batch

    async def run_once(self, *, block: bool = False) -> int:
        """Read one batch (reclaimed, own pending, or new entries) and fold it; returns the number
        of feed entries acked. With `block`, an empty feed is waited on for up to ``block_ms``
        (interrupted by `stop()`)."""
        await self.ensure_groups()
        now = time.monotonic()
        if now >= self._next_stats:
            self._next_stats = now + self.stats_interval
            await self.refresh_gauges()
        rows: builtins.list[tuple[str, str, dict[str, str] | None]] = []
        if now >= self._next_claim:
            self._next_claim = now + max(self.claim_idle_ms / 2000, 0.05)
            rows = await self._autoclaim()
        if not rows and self._backlog is not None:
            rows = await self._read(self._backlog, None)
            for key, rid, _ in rows:
                self._backlog[key] = rid
            if not rows:
                self._backlog = None
        if not rows and not (block and self._stopping):
            wait = None if not block else (50 if self._deferred else self.block_ms)
            with anyio.CancelScope() as scope:
                self._idle_scope = scope
                rows = await self._read(dict.fromkeys(self.feeds, ">"), wait)
            self._idle_scope = None
            if scope.cancelled_caught:
                rows = []
        works, garbage = self._coalesce(rows)
        if not works and not garbage:
            return 0
        return await self._handle(works, garbage)

    def _coalesce(
        self, rows: Sequence[tuple[str, str, dict[str, str] | None]]
    ) -> tuple[dict[str, _Work], dict[str, set[str]]]:
        works = self._deferred
        self._deferred = {}
        garbage: dict[str, set[str]] = {}
        for key, rid, fields in rows:
            sid = (fields or {}).get("s")
            try:
                validate_session_id(sid)
                n_raw = (fields or {}).get("n")
                n = int(n_raw) if n_raw is not None else None
            except (InvalidSessionIdError, ValueError):
                garbage.setdefault(key, set()).add(rid)  # trimmed while pending, or not ours
                continue
            assert sid is not None
            w = works.get(sid)
            if w is None:
                w = works[sid] = _Work(sid)
            w.add(key, rid, n)
        return works, garbage

    async def _handle(self, works: dict[str, _Work], garbage: dict[str, set[str]]) -> int:
        t0 = time.perf_counter()
        acked = 0
        if garbage:  # entries trimmed while pending, or not written by a store: nothing to fold
            pipe = self._r.pipeline(transaction=False)
            for key, rids in garbage.items():
                pipe.execute_command("XACK", key, self.group, *sorted(rids))
            await pipe.execute()
            acked += sum(len(v) for v in garbage.values())
            self.metrics.processed.inc(acked)
        limiter = anyio.Semaphore(self.concurrency)

        async def one(w: _Work) -> None:
            nonlocal acked
            async with limiter:
                outcome, count = await self._work(w)
            if outcome == BUSY:
                self._deferred[w.session_id] = w
            acked += count

        async with anyio.create_task_group() as tg:
            for w in works.values():
                tg.start_soon(one, w)
        self.batches += 1
        self.metrics.batch_seconds.observe(time.perf_counter() - t0)
        return acked

    async def _work(self, w: _Work) -> tuple[str, int]:
        """Fold one session for its feed entries; returns (outcome, feed entries acked).

        Round trips: the lock and the snapshot's n together; then the fold (snapshot, head, the
        tail, the write); then the lock release, the acks, the counters and the incarnation check
        together."""
        sid = w.session_id
        keys = self.store.keys
        lock = keys.plock(sid)
        locked = False
        counters: dict[str, int] = {}
        try:
            pipe = self._r.pipeline(transaction=False)
            if self.lock_ms:
                pipe.execute_command("SET", lock, self.consumer, "NX", "PX", self.lock_ms)
            pipe.execute_command("HGET", keys.proj(sid), "n", **RAW)
            res = await pipe.execute()
            locked = bool(self.lock_ms and res[0])
            stored_n = _int_or_none(res[-1])
            if res[-1] is not None and stored_n is None and (locked or not self.lock_ms):
                # An n that is not a number: proj.lua could not compare against it. Drop it.
                await self._r.execute_command("DEL", keys.proj(sid))
                counters["corrupt"] = 1
            if not w.event and stored_n is not None and stored_n >= w.hint:
                outcome = CURRENT  # another fold already covers every entry named here
            elif self.lock_ms and not locked:
                outcome = BUSY
            else:
                outcome = await self._fold_locked(sid, counters)
        except SessionNotFoundError:
            outcome = DELETED  # deleted while we read it
        except (StoreUnavailableError, RedisError, OSError) as e:
            log.warning("projector %s: fold of %r failed: %s", self.consumer, sid, e)
            outcome = FAILED
        except Exception:
            log.exception("projector %s: fold of %r failed", self.consumer, sid)
            outcome = FAILED
        self.metrics.folds.labels(outcome).inc()
        if outcome == BUSY:
            return outcome, 0  # kept pending: retried on the next loop (or reclaimed)
        ack = outcome != FAILED  # a failed fold stays pending and is retried once reclaimed
        count = w.count if ack else 0
        name = outcome if ack else "errors"
        counters[name] = counters.get(name, 0) + 1
        try:
            with anyio.CancelScope(shield=True):
                pipe = self._r.pipeline(transaction=False)
                if locked:
                    pipe.execute_command("DEL", lock)
                if count:
                    for key, rids in w.ids.items():
                        pipe.execute_command("XACK", key, self.group, *sorted(rids))
                    counters["processed"] = count
                for name, value in counters.items():
                    pipe.execute_command("HINCRBY", self._stats_key, name, value)
                await pipe.execute()
        except (RedisError, OSError) as e:
            log.warning("projector %s: ack of %r failed: %s", self.consumer, sid, e)
            return outcome, 0
        self.metrics.processed.inc(count)
        return outcome, count

    # ------------------------------------------------------------------ one session

    async def fold(self, session_id: str) -> str:
        """Bring `session_id`'s snapshot to its head now (no feed entry needed); returns WRITTEN,
        CURRENT, DELETED, BUSY (another worker is folding it) or FAILED."""
        validate_session_id(session_id)
        outcome, _ = await self._work(_Work(session_id, event=True))
        return outcome

    async def _fold_locked(self, session_id: str, counters: dict[str, int]) -> str:
        """The fold itself: its outcome. Everything is read as of one head's incarnation, and the
        snapshot is written only to that incarnation (SessionReplacedError otherwise)."""
        store = self.store
        if self.on_session is not None:
            await self.on_session(session_id)
        head = await store.head(session_id)
        if head is None:
            return DELETED
        inc = head.header.incarnation
        snap = await store.get_projection(session_id, incarnation=inc)
        if snap is not None and snap[0] > head.n:  # written after our head was read: read it again
            newer = await store.head(session_id)
            if newer is None or newer.header.incarnation != inc:
                return DELETED
            head = newer
        target = head.n
        if snap is not None and snap[0] == target:
            return CURRENT
        state = await self._stored_state(session_id, snap, head, counters)
        start = 0 if state is None else state.n
        state, source = await self._bring_to(session_id, state, head, inc)
        if source != "snapshot":
            self.metrics.rebuilds.labels(source).inc()
            counters[f"rebuild_{source}"] = 1
        self.metrics.entries.inc(target - start if source == "snapshot" else target)
        if not await store.put_projection(session_id, target, state.to_bytes(), incarnation=inc):
            return CURRENT  # another worker wrote one at >= target meanwhile
        return WRITTEN

    async def _stored_state(
        self, session_id: str, snap: tuple[int, bytes] | None, head: SessionHead, counters: dict[str, int]
    ) -> ProjectionState | None:
        """The stored snapshot (below `head`'s n) decoded, when it is usable; else None, and a
        damaged or foreign one is counted as ``corrupt``."""
        if snap is None:
            return None
        n_s, blob = snap
        state: ProjectionState | None = None
        if n_s > head.n:
            # Never written by proj.lua (it caps n at the header's): a foreign value that the
            # forward-only write could not replace. Drop it and rebuild.
            await self._r.execute_command("DEL", self.store.keys.proj(session_id))
        else:
            try:
                state = ProjectionState.from_bytes(blob)
            except ValueError:
                state = None
            if state is not None and not plausible(state, n_s, head):
                state = None
        if state is None:
            counters["corrupt"] = 1
        return state

    async def _bring_to(
        self, session_id: str, state: ProjectionState | None, head: SessionHead, inc: str
    ) -> tuple[ProjectionState, str]:
        """`state` (or none) brought to ``head.n``, and how: ``"snapshot"`` (extended), ``"cut"``
        (rebuilt from the tail's last cut, which compacts it), else `rebuild`'s source."""
        target = head.n
        start = 0 if state is None else state.n
        source = ""
        last_cut = head.last_cut
        if last_cut is not None and start <= last_cut < target:
            # The tail holds the session's last cut: rebuild from it when its window is small,
            # which drops the hidden history from the snapshot (compaction).
            try:
                rebuilt = await self._from_cut_if_small(session_id, last_cut, target, inc)
            except ValueError:
                rebuilt = None
            if rebuilt is not None:
                state, source = rebuilt, "cut"
        if not source and state is not None:
            try:
                await fold_range(self.store, session_id, state, target, self.chunk, inc)
                source = "snapshot"
            except ValueError:
                state = None  # a cut reaching under the snapshot's floor: rebuild
        if state is None or not source:
            state, source = await rebuild(self.store, session_id, head, target, self.chunk)
        return state, source

    async def _from_cut_if_small(
        self, session_id: str, cut_n: int, target: int, incarnation: str
    ) -> ProjectionState | None:
        got = await self.store.read(session_id, cut_n, cut_n + 1, incarnation=incarnation)
        if len(got) != 1 or got[0].type != CUT:
            return None
        before = got[0].data.get("before")
        if not isinstance(before, int) or cut_n - before > self.cut_window:
            return None
        return await fold_from_cut(self.store, session_id, got[0], target, self.chunk, incarnation)

    # ------------------------------------------------------------------ health

    async def refresh_gauges(self) -> dict[str, Any]:
        """Update the lag/pending gauges from the server and forget consumers that have been gone
        for ``consumer_ttl_ms`` with nothing pending (every restart names a new one); returns
        `status()`."""
        st = await status(self.store, group=self.group)
        for sh in st["shards"]:
            self.metrics.lag.labels(str(sh["shard"])).set(sh["lag"] or 0)
            self.metrics.pending.labels(str(sh["shard"])).set(sh["pending"])
            for c in sh["consumers"]:
                if c["pending"] == 0 and c["idle_ms"] >= self.consumer_ttl_ms and c["name"] != self.consumer:
                    await self._r.execute_command("XGROUP", "DELCONSUMER", sh["key"], self.group, c["name"])
        return st


def _int_or_none(raw: Any) -> int | None:
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


# --------------------------------------------------------------------------- status


async def status(store: RedisSessionStore, *, group: str = DEFAULT_GROUP) -> dict[str, Any]:
    """The group's health, read from the server: per shard the feed length, lag (entries not yet
    delivered), pending (delivered, not acked) and consumers; the totals; and the counters every
    worker of the group adds to (``processed``, ``reclaimed``, ``written``, ``current``,
    ``deleted``, ``errors``, ``rebuild_cut``, ``rebuild_full``, ``corrupt``)."""
    validate_group(group)
    r = feed_client_of(store)
    shards: builtins.list[dict[str, Any]] = []
    for shard, key in enumerate(store.keys.all_feeds()):
        length = int(await r.execute_command("XLEN", key, **RAW))
        info: dict[str, Any] | None = None
        consumers: builtins.list[dict[str, Any]] = []
        with contextlib.suppress(RedisError):  # no such key yet
            for g in await r.execute_command("XINFO", "GROUPS", key, **RAW) or []:
                m = as_map(g)
                if as_str(m.get("name")) == group:
                    info = m
        if info is not None:
            for c in await r.execute_command("XINFO", "CONSUMERS", key, group, **RAW) or []:
                m = as_map(c)
                consumers.append(
                    {
                        "name": as_str(m.get("name")),
                        "pending": int(m.get("pending") or 0),
                        "idle_ms": int(m.get("idle") or 0),
                    }
                )
        lag: int | None
        if info is None:
            lag, pending, last = length, 0, None
        else:
            pending = int(info.get("pending") or 0)
            last = as_str(info.get("last-delivered-id"))
            raw_lag = info.get("lag")
            lag = int(raw_lag) if raw_lag is not None else await _count_after(r, key, last)
        shards.append(
            {
                "shard": shard,
                "key": key,
                "length": length,
                "group": info is not None,
                "lag": lag,
                "pending": pending,
                "last_delivered_id": last,
                "consumers": consumers,
            }
        )
    raw_stats = await r.execute_command("HGETALL", store.keys.projector_stats(group), **RAW)
    counters = {k: int(v) for k, v in as_map(raw_stats).items()}
    return {
        "group": group,
        "prefix": store.prefix,
        "lag": sum(s["lag"] or 0 for s in shards),
        "pending": sum(s["pending"] for s in shards),
        "length": sum(s["length"] for s in shards),
        "shards": shards,
        "counters": counters,
    }


async def _count_after(r: Any, key: str, last: str | None) -> int:
    """Lag when XINFO cannot tell it (entries deleted mid-stream): count what follows `last`."""
    start = "-" if not last or last == "0-0" else f"({last}"
    rows = await r.execute_command("XRANGE", key, start, "+", "COUNT", 100_000, **RAW)
    return len(rows or [])


async def quiescent(store: RedisSessionStore, *, group: str = DEFAULT_GROUP) -> bool:
    """True when every feed entry has been delivered and acked (lag 0, nothing pending)."""
    st = await status(store, group=group)
    return bool(st["lag"] == 0 and st["pending"] == 0 and all(s["group"] for s in st["shards"]))
