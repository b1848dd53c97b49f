"""The archiver: moves the old part of session logs into the cold tier, and back.

One archive of a session, step by step (each step can be killed; a re-run finishes the job):

1. read the header's cold state (incarnation, n, the archived segments) and choose k by the
   policy: entries [hot start, k) go cold;
2. read those entries (the hot stream) and upload them as one segment object, named by session,
   incarnation and range (`ColdTier.write`), then read it back and verify its checksum;
3. one script (``lua/archive.lua``), guarded by the incarnation and the cold list read in step 1
   (compare-and-set), names the segment in the header and drops [hot start, k) from the stream.

Before its upload, the archiver records the object as pending in Redis (`begin_upload`); the
sweep never deletes a pending object, and the script of step 3 takes the pending record (it
refuses when a sweep released a stale one first), so whatever the grace values, either the
header names a verified object or the hot copy stays. A range that follows a small archived
segment is merged with it (one new object for both; the old one goes after the script), so
archiving a few entries at a time (``keep`` on each hint) leaves few large segments. The script
waits as the store's writes do (``durability``: WAIT for a replica, WAITAOF): a merge or a restore
deletes the objects it replaced only once that wait confirmed it, else the sweep does (a failover
to a replica that missed the script brings back the header naming them).

A crash before 3 leaves the hot copy (and maybe an orphan object, which `sweep` deletes once it
is older than its grace); after 3 the cold copy, named by the header. A concurrent append is
untouched (only entries below n move); a delete + re-create refuses the script (another
incarnation), so nothing of one life reaches the other. `restore` brings a session back hot.

`ArchiveWorker` runs the policy from the change feed (like the projector and the compactor): a
``keep`` or ``before_last_cut`` policy acts on each hint, an ``idle`` one schedules the session in
a due set ({prefix}:archiver:{group}:due) and archives it once it has been idle long enough.
Workers share the group, so they scale horizontally; every step is idempotent.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import unquote

import anyio
import zstandard

from .cold.objects import ObjectMissing, ObjectStore, open_objects
from .cold.segments import ColdSegment, ColdTier, segment_name
from .errors import SegmentMissingError, SessionError, SessionNotFoundError, SessionReplacedError
from .feed import FeedWorker, default_consumer, feed_client_of, validate_group
from .keys import validate_session_id
from .model import now_ms
from .redis.store import RedisSessionStore
from .store.protocol import MAX_READ_RANGE, ArchivableStore, ColdState

log = logging.getLogger(__name__)

#: an object younger than this is never swept (an archiver may be between its upload and its
#: script); an archiver that took longer than half of it gives up before its script. A grace of
#: 0 is for a sweep while no archiver runs
DEFAULT_GRACE_MS = 3_600_000
DEFAULT_GROUP = "archiver"

Hook = Callable[[str], Awaitable[None]]


@dataclass(frozen=True)
class Policy:
    """Which prefix of a session goes cold.

    ``idle_ms``: only sessions without a write for that long (alone: the whole log);
    ``before_last_cut``: up to the last cut's ``before`` (what `messages()` no longer shows:
    the cut itself and what it keeps stay hot);
    ``keep``: all but the last `keep` entries. Several limits: the smallest k wins. A range
    shorter than ``min_entries`` is left hot (segments stay few and large); ephemeral sessions
    (a TTL) are never archived."""

    idle_ms: int | None = None
    before_last_cut: bool = False
    keep: int | None = None
    min_entries: int = 1

    def __post_init__(self) -> None:
        if self.idle_ms is None and not self.before_last_cut and self.keep is None:
            raise ValueError("a policy needs idle_ms, before_last_cut or keep")
        if (self.idle_ms is not None and self.idle_ms < 0) or (self.keep is not None and self.keep < 0):
            raise ValueError("idle_ms and keep must be >= 0")
        if self.min_entries < 1:
            raise ValueError("min_entries must be >= 1")

    def upto(self, state: ColdState, now: int, cut_before: int | None = None) -> int | None:
        """k: archive [hot start, k) now; None: leave the session as it is. `cut_before`: the
        last cut's ``before`` (a ``before_last_cut`` policy needs it)."""
        if state.ephemeral:
            return None
        if self.idle_ms is not None and now - state.updated_at < self.idle_ms:
            return None
        k = state.n
        if self.before_last_cut:
            if state.last_cut is None or cut_before is None:
                return None
            k = min(k, state.last_cut, cut_before)
        if self.keep is not None:
            k = min(k, state.n - self.keep)
        return k if k - state.hot_start >= self.min_entries else None


class ArchiveResult(NamedTuple):
    session: str
    status: str  # archived | nothing | absent | ephemeral | replaced | moved | slow
    lo: int = 0
    hi: int = 0
    bytes: int = 0


async def _no_hook(step: str) -> None:
    return None


class Archiver:
    """Archive, restore and sweep on one store (a `RedisSessionStore` or any `ArchivableStore`).

    `tier` defaults to the store's (a tier given is attached to the store's prefix, and recorded
    as the prefix's cold URL at the first archive); `hook` is awaited at each step
    ("before_upload", "after_upload", "after_script"): tests kill the archiver there. A range
    longer than `segment_entries` becomes several segments (a reader of a few entries fetches
    one of them); one that follows a segment of fewer than `merge_below` entries is merged with
    it (within `segment_entries`). Each archived range adds to the counters of `group`
    (``archive --status``)."""

    def __init__(
        self,
        store: ArchivableStore,
        tier: ColdTier | None = None,
        *,
        grace_ms: int = DEFAULT_GRACE_MS,
        hook: Hook | None = None,
        segment_entries: int = 10_000,
        merge_below: int = 1_000,
        group: str = DEFAULT_GROUP,
    ) -> None:
        self.store = store
        self.tier = tier if tier is not None else store.cold
        if self.tier is not None and isinstance(store, RedisSessionStore):
            self.tier.bind(store.prefix)  # one tier, one prefix: a sweep never sees another's objects
        self.grace_ms = grace_ms
        self.merge_below = merge_below
        self.group = validate_group(group)
        self._recorded = False
        self.hook = hook or _no_hook
        if not 1 <= segment_entries <= MAX_READ_RANGE:
            raise ValueError(f"segment_entries must be in [1, {MAX_READ_RANGE}] (one read covers a segment)")
        self.segment_entries = segment_entries

    async def _tier(self) -> ColdTier:
        if self.tier is None and isinstance(self.store, RedisSessionStore):
            self.tier = await self.store.cold_tier()
        if self.tier is None:
            raise ValueError("no cold tier: pass one, or run `redis-session archive --to URL` once")
        if isinstance(self.store, RedisSessionStore) and not self._recorded:
            await self.store.check_cold_url(self.tier)  # refused before the claim writes to its folder
            await claim_tier(self.store, self.tier)  # never another store's folder
            await self.store.record_cold_url(self.tier)  # every process of the prefix finds it
            self._recorded = True
        if self.store.cold is None:
            self.store.cold = self.tier
        return self.tier

    async def archive(
        self, session_id: str, *, upto: int | None = None, policy: Policy | None = None, now: int | None = None
    ) -> ArchiveResult:
        """Archive [hot start, k) of one session: k is `upto` (clamped to n), else the policy's,
        else n (the whole log)."""
        validate_session_id(session_id)
        state = await self.store.cold_state(session_id)
        if state is None or state.deleted:  # before the tier is claimed and recorded: nothing written
            return ArchiveResult(session_id, "absent")
        if state.ephemeral:  # it expires with its keys: its objects would outlive it
            return ArchiveResult(session_id, "ephemeral")
        tier = await self._tier()
        if policy is not None:
            cut_before = None
            if policy.before_last_cut and state.last_cut is not None:
                cut = await self.store.read(session_id, state.last_cut, state.last_cut + 1)
                before = cut[0].data.get("before") if cut else None
                cut_before = before if isinstance(before, int) else None
            k = policy.upto(state, now_ms() if now is None else now, cut_before)
            if k is None:
                return ArchiveResult(session_id, "nothing")
        else:
            k = state.n
        if upto is not None:
            k = min(k, upto)
        lo = state.hot_start
        if k <= lo:
            return ArchiveResult(session_id, "nothing", lo, lo)
        total, first, moved = 0, lo, 0
        while True:  # one segment of at most `segment_entries` per step, each step committed alone
            hi = min(k, lo + self.segment_entries)
            res = await self._archive_range(tier, session_id, state, lo, hi)
            total += res.bytes
            if res.status == "archived":
                moved = hi - first
            if res.status != "archived" or hi >= k:
                await self._count(moved, total)
                return res._replace(lo=first if res.status == "archived" else res.lo, bytes=total)
            nxt = await self.store.cold_state(session_id)
            if nxt is None or nxt.deleted or nxt.incarnation != state.incarnation or nxt.hot_start != hi:
                await self._count(moved, total)
                return ArchiveResult(session_id, "moved", lo, hi, total)
            state, lo = nxt._replace(own_start=state.own_start), hi

    async def _archive_range(self, tier: ColdTier, session_id: str, state: ColdState, lo: int, k: int) -> ArchiveResult:
        """Steps 2 and 3 for [lo, k) (lo: the hot start of `state`)."""
        t0 = time.monotonic()
        try:
            entries = await self.store.read(session_id, lo, k, incarnation=state.incarnation)
        except SessionReplacedError:
            return ArchiveResult(session_id, "replaced")
        except SessionNotFoundError:
            return ArchiveResult(session_id, "absent")
        if len(entries) != k - lo or entries[0].n != lo:
            raise SessionError(f"session {session_id!r}: read [{lo}, {k}) returned {len(entries)} entries")
        merged: builtins.list[ColdSegment] = []
        last = state.cold[-1] if state.cold else None
        if last is not None and last.hi - last.lo < self.merge_below and k - last.lo <= self.segment_entries:
            # a small segment before the range: one object for both (few segments, a compact header)
            try:
                entries = await tier.segment(session_id, state.incarnation, last) + entries
            except SegmentMissingError:
                # another archiver merged it (or a restore took it) since `state` was read: this
                # pass lost the race, and its script would refuse the stale cold list anyway
                return ArchiveResult(session_id, "moved", lo, k)
            merged = [last]
        seg, data = tier.encode(session_id, state.incarnation, entries)
        await self.hook("before_upload")
        await self.store.begin_upload(session_id, seg)  # before the object exists: never swept
        name = segment_name(seg)
        try:
            await tier.upload(session_id, state.incarnation, seg, data, entries)
        except SegmentMissingError:
            if await self.store.pending_upload(session_id, name) is None:
                return ArchiveResult(session_id, "slow", lo, k)  # a sweep released it and took the object
            raise
        await self.hook("after_upload")
        if 0 < self.grace_ms < (time.monotonic() - t0) * 2000 and await self.store.release_upload(session_id, name):
            return ArchiveResult(session_id, "slow", lo, k)  # given up: the sweep takes the object
        try:
            status = await self.store.commit_archive(session_id, state, seg)
        except SessionReplacedError:
            return ArchiveResult(session_id, "replaced", lo, k)  # the object is the old life's: swept
        except SessionNotFoundError:
            return ArchiveResult(session_id, "absent", lo, k)
        await self.hook("after_script")
        if status == "expired":
            return ArchiveResult(session_id, "slow", lo, k)  # a sweep released it: the hot copy stays
        if status not in ("done", "unconfirmed"):
            await self.store.release_upload(session_id, name)
            return ArchiveResult(session_id, "moved", lo, k)
        if merged and status == "done":
            await tier.drop(session_id, state.incarnation, merged)  # named by no header now
        elif merged:  # a failover may still bring back the header that names them: the sweep's
            log.warning("archive %s [%s, %s): not confirmed durable; the merged objects are left to the sweep",
                        session_id, lo, k)  # fmt: skip
        return ArchiveResult(session_id, "archived", lo, k, seg.size - sum(m.size for m in merged))

    async def _count(self, entries: int, cold_bytes: int) -> None:
        """The group's counters (``archive --status``), for every archive: one-pass or worker."""
        if entries > 0 and isinstance(self.store, RedisSessionStore):
            key = self.store.keys.archiver_stats(self.group)
            await self.store._pipeline(
                ("HINCRBY", key, "sessions", 1),
                ("HINCRBY", key, "entries", entries),
                ("HINCRBY", key, "cold_bytes", cold_bytes),
            )

    async def restore(self, session_id: str) -> ArchiveResult:
        """Bring every archived entry of a session back into its hot stream; the objects go after."""
        validate_session_id(session_id)
        for _attempt in range(5):
            state = await self.store.cold_state(session_id)
            if state is None or state.deleted:
                return ArchiveResult(session_id, "absent")
            if not state.cold:
                return ArchiveResult(session_id, "nothing")
            tier = await self._tier()
            try:
                entries = await tier.read(session_id, state.incarnation, state.cold, state.own_start, state.hot_start)
            except SegmentMissingError:
                # an archiver merged (or another restore took) a segment since `state` was read:
                # a loss only if the header still names it
                now = await self.store.cold_state(session_id)
                if now is not None and now.incarnation == state.incarnation and now.cold_raw == state.cold_raw:
                    raise
                continue
            status = await self.store.commit_restore(session_id, state, entries)
            if status in ("done", "unconfirmed"):
                if status == "done":
                    await tier.drop(session_id, state.incarnation, state.cold)
                else:  # a failover may still bring back the header that names them: the sweep's
                    log.warning("restore %s: not confirmed durable; the objects are left to the sweep", session_id)
                return ArchiveResult(session_id, "restored", state.own_start, state.hot_start)
        return ArchiveResult(session_id, "moved")

    async def run_policy(self, policy: Policy, *, limit: int | None = None) -> builtins.list[ArchiveResult]:
        """One pass over every session (the list index), archiving what `policy` selects."""
        out: builtins.list[ArchiveResult] = []
        cursor: str | None = None
        now = now_ms()
        while True:
            page = await self.store.list(limit=500, cursor=cursor)
            for h in page.items:
                res = await self.archive(h.id, policy=policy, now=now)
                if res.status != "nothing":
                    out.append(res)
                if limit is not None and sum(r.status == "archived" for r in out) >= limit:
                    return out
            cursor = page.cursor
            if cursor is None:
                return out

    async def sweep(self, *, now: int | None = None) -> builtins.list[str]:
        """Delete the objects no header names (a deleted session's, another life's, an archive
        that crashed before its script) once older than the grace; safe to re-run. The keys gone."""
        tier = await self._tier()
        if isinstance(self.store, RedisSessionStore):
            await claim_tier(self.store, tier)  # checked on every pass: it deletes what no header names
        now = now_ms() if now is None else now
        removed: builtins.list[str] = []
        named: dict[tuple[str, str], set[str]] = {}  # (session dir, incarnation dir) -> keys in use
        async for info in tier.objects.list(f"{tier.prefix}/"):
            if now - info.modified_ms < self.grace_ms:
                continue
            parts = info.key.split("/")
            if len(parts) != 4 or not parts[3].endswith(".jsonl.zst"):
                continue
            ident = await self._identity(tier.objects, info.key, parts[1], parts[2])
            if ident is None:
                continue
            sid, inc = ident
            used = named.get((parts[1], parts[2]))
            if used is None:
                # a hidden session (deleted, still read by its branches) keeps its segments too
                state = await self.store.cold_state(sid) if _valid(sid) else None
                used = set()
                if state is not None and state.incarnation == inc:
                    used = {tier.key(sid, inc, s) for s in state.cold}
                named[(parts[1], parts[2])] = used
            if info.key in used:
                continue
            # pending first, then a fresh header: an upload committed in between is named there
            valid = _valid(sid)
            began = await self.store.pending_upload(sid, parts[3]) if valid else None
            if began is not None and (
                now - began < self.grace_ms or not await self.store.release_upload(sid, parts[3])
            ):
                continue  # an archiver is between its upload and its script (or just committed)
            if began is None and valid:
                state = await self.store.cold_state(sid)
                if (
                    state is not None
                    and state.incarnation == inc
                    and info.key in {tier.key(sid, inc, s) for s in state.cold}
                ):
                    named[(parts[1], parts[2])].add(info.key)
                    continue
            await tier.objects.delete(info.key)
            removed.append(info.key)
        return removed

    @staticmethod
    async def _identity(objects: ObjectStore, key: str, sdir: str, idir: str) -> tuple[str, str] | None:
        """(session id, incarnation) of an object: from its folder names, or (a hashed long id)
        from its first line."""
        if sdir.startswith("s-"):
            return unquote(sdir[2:]), unquote(idir)
        try:
            data = await objects.get(key)
            first = zstandard.ZstdDecompressor().decompressobj().decompress(data[:65536]).partition(b"\n")[0]
            import msgspec

            head = msgspec.json.decode(first)
            return str(head["session"]), str(head["incarnation"])
        except Exception:
            return None


def _valid(sid: str) -> bool:
    try:
        validate_session_id(sid)
    except SessionError:
        return False
    return True


STORE_ID_OBJECT = "store-id"


async def store_id(store: RedisSessionStore) -> str:
    """This store's random id (``{prefix}:cold:store``: this server and prefix), made once."""
    mine = secrets.token_hex(8)
    for _ in range(3):
        if await store._raw("SET", store.keys.cold_store, mine, "NX"):
            return mine
        got = await store._raw("GET", store.keys.cold_store)
        if got is not None:
            return got.decode() if isinstance(got, bytes) else str(got)
    return mine


async def claim_tier(store: RedisSessionStore, tier: ColdTier) -> None:
    """Claim `tier`'s folder for this store: its ``<prefix>/store-id`` object is written with the
    store's id when absent, and a folder holding another store's id is refused (`ValueError`):
    two Redis servers (or databases) archiving to one URL under one prefix would each sweep the
    other's segments away as "named by no header"."""
    mine = await store_id(store)
    key = f"{tier.prefix}/{STORE_ID_OBJECT}"
    try:
        theirs = (await tier.objects.get(key)).decode("utf-8", "replace").strip()
    except ObjectMissing:
        # the first claim: written only if no other store's claim got there first (an object
        # store without a conditional put gets a plain one, read back)
        create = getattr(tier.objects, "create", None)
        if create is not None:
            await create(key, mine.encode())
        else:
            await tier.objects.put(key, mine.encode())
        theirs = (await tier.objects.get(key)).decode("utf-8", "replace").strip()
    if theirs != mine:
        raise ValueError(
            f"{tier.url}: the objects under {tier.prefix}/ belong to another store (store id {theirs}; this one "
            f"is {mine}): two Redis servers or databases must not share a cold folder under one prefix; give "
            "this store its own URL"
        )


async def set_cold_url(store: RedisSessionStore, url: str, *, replace: bool = False) -> ColdTier:
    """Record where this prefix's cold segments live (every store on the prefix finds it).

    Another URL already recorded is refused (`ValueError`) unless `replace`: the segments
    already archived stay where they are, and readers would look for them in the new place."""
    tier = ColdTier(open_objects(url), prefix=store.prefix)  # a bad URL fails here, before anything is recorded
    if not replace:
        await store.check_cold_url(tier)  # another URL recorded: refused before the claim writes to its folder
    await claim_tier(store, tier)
    await store.record_cold_url(tier, replace=replace)
    store.cold = tier
    return tier


async def status(store: RedisSessionStore, *, group: str = DEFAULT_GROUP) -> dict[str, Any]:
    """The tier, the group's counters (sessions, entries and compressed bytes moved cold), the
    sessions due for an idle archive and the server's memory in use (the hot side)."""
    tier = await store.cold_tier()
    raw, due, info = await store._pipeline(
        ("HGETALL", store.keys.archiver_stats(group)),
        ("ZCARD", f"{store.prefix}:archiver:{group}:due"),
        ("INFO", "memory"),
    )
    pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=False)
    counters = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in pairs}
    text = info.decode() if isinstance(info, bytes) else str(info)
    used = next((int(line.split(":")[1]) for line in text.splitlines() if line.startswith("used_memory:")), None)
    return {
        "prefix": store.prefix,
        "group": group,
        "cold": None if tier is None else tier.url,
        "counters": counters,
        "due": int(due),
        "redis_used_memory": used,
    }


# --------------------------------------------------------------------------- worker


class ArchiverMetrics:
    """The worker's Prometheus metrics, in their own registry (``metrics.registry``)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = "redis_session_archiver"
        self.processed = Counter(f"{p}_processed", "Feed entries handled and acked", registry=r)
        self.reclaimed = Counter(f"{p}_reclaimed", "Feed entries reclaimed from idle consumers", registry=r)
        self.outcomes = Counter(f"{p}_sessions", "Archive attempts by outcome", ["outcome"], registry=r)
        self.entries = Counter(f"{p}_entries", "Entries moved to the cold tier", registry=r)
        self.cold_bytes = Counter(f"{p}_cold_bytes", "Bytes written to the cold tier (compressed)", registry=r)
        self.segment_reads = Gauge(f"{p}_segment_reads", "Segment objects this process fetched", registry=r)
        self.read_seconds = Gauge(f"{p}_segment_read_seconds", "Total time of those fetches", registry=r)
        self.due = Gauge(f"{p}_due", "Sessions scheduled for an idle archive", registry=r)

    def value(self, name: str, **labels: str) -> float:
        got = self.registry.get_sample_value(f"redis_session_archiver_{name}", labels or None)
        return 0.0 if got is None else float(got)


class ArchiveWorker(FeedWorker):
    """Archive by `policy` as the change feed says sessions moved (see the module docstring)."""

    kind = "archiver"
    in_hand = "the sessions in hand"

    def __init__(
        self,
        store: RedisSessionStore,
        policy: Policy,
        *,
        tier: ColdTier | None = None,
        consumer: str | None = None,
        group: str = DEFAULT_GROUP,
        batch: int = 100,
        claim_idle_ms: int = 30_000,
        block_ms: int = 2_000,
        grace_ms: int = DEFAULT_GRACE_MS,
        metrics_port: int | None = None,
        metrics_addr: str = "0.0.0.0",
        registry: Any = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.group = validate_group(group)
        self.archiver = Archiver(store, tier, grace_ms=grace_ms, group=self.group)
        self.consumer = validate_group(consumer or default_consumer())
        self.batch = batch
        self.claim_idle_ms = claim_idle_ms
        self.block_ms = block_ms
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.metrics = ArchiverMetrics(registry)
        self.feeds = store.keys.all_feeds()
        self._r = feed_client_of(store)
        self._stats_key = store.keys.archiver_stats(self.group)
        self._due_key = f"{store.prefix}:archiver:{self.group}:due"
        self._stopping = False
        self._groups_ready = False
        self._idle_scope: anyio.CancelScope | None = None
        self._http: Any = None
        self._claim_cursor = {k: "0-0" for k in self.feeds}
        self._deferred: dict[str, Any] = {}
        self._next_claim = 0.0

    async def run(self) -> None:
        """`FeedWorker.run`; an ``idle`` policy first schedules every listed session (the feed
        only names sessions that moved since its entries were trimmed)."""
        if self.policy.idle_ms is not None and not self._stopping:
            await self.schedule_all()
        await super().run()

    async def schedule_all(self) -> int:
        """Put every session of the list index in the due set (idempotent: ZADD of its own
        score); the number scheduled."""
        assert self.policy.idle_ms is not None
        count, cursor = 0, None
        while True:
            page = await self.store.list(limit=500, cursor=cursor)
            for h in page.items:
                state = await self.store.cold_state(h.id)
                if state is not None and not (state.ephemeral or state.deleted) and state.n > state.hot_start:
                    await self.store._raw("ZADD", self._due_key, state.updated_at + self.policy.idle_ms, h.id)
                    count += 1
            cursor = page.cursor
            if cursor is None:
                return count

    async def run_once(self, *, block: bool = False) -> int:
        """One batch of feed entries (and the due idle sessions); the feed entries acked."""
        await self.ensure_groups()
        await self._run_due()
        rows = []
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + max(self.claim_idle_ms / 2000, 0.05)
            rows = await self._autoclaim()
        if not rows and not (block and self._stopping):
            wait = self.block_ms if block else None
            if self.policy.idle_ms is not None and block:
                wait = min(self.block_ms, max(50, self.policy.idle_ms))
            with anyio.CancelScope() as scope:
                self._idle_scope = scope
                rows = await self._read(dict.fromkeys(self.feeds, ">"), wait)
            self._idle_scope = None
            if scope.cancelled_caught:
                rows = []
        by_session: dict[str, builtins.list[tuple[str, str]]] = {}
        for key, rid, fields in rows:
            by_session.setdefault((fields or {}).get("s") or "", []).append((key, rid))
        acked = 0
        for sid, ids in by_session.items():
            if sid and _valid(sid) and not await self._consider(sid):
                continue  # left pending: reclaimed and tried again after claim_idle_ms
            pipe = self._r.pipeline(transaction=False)
            for key, rid in ids:
                pipe.execute_command("XACK", key, self.group, rid)
            await pipe.execute()
            acked += len(ids)
        self.metrics.processed.inc(acked)
        st = self.archiver.tier.stats if self.archiver.tier is not None else None
        if st is not None:
            self.metrics.segment_reads.set(st.segment_reads)
            self.metrics.read_seconds.set(st.read_seconds)
        return acked

    async def _consider(self, session_id: str) -> bool:
        """A session moved: archive it now (keep / before_last_cut) or schedule it for when it is
        idle. False: it failed (its feed entries stay pending)."""
        if self.policy.idle_ms is not None:
            state = await self.store.cold_state(session_id)
            if state is not None and not (state.ephemeral or state.deleted):
                await self.store._raw("ZADD", self._due_key, state.updated_at + self.policy.idle_ms, session_id)
            return True
        return await self._archive(session_id) is not None

    async def _run_due(self) -> None:
        if self.policy.idle_ms is None:
            return
        due = await self.store._raw("ZRANGEBYSCORE", self._due_key, "-inf", now_ms(), "LIMIT", 0, self.batch)
        for raw in due or ():
            sid = raw.decode() if isinstance(raw, bytes) else str(raw)
            if int(await self.store._raw("ZREM", self._due_key, sid)) != 1:
                continue  # another worker claimed it
            res = await self._archive(sid)
            if res is None:  # failed: due again in a while
                await self.store._raw("ZADD", self._due_key, now_ms() + self.claim_idle_ms, sid)
            elif res.status == "nothing":
                state = await self.store.cold_state(sid)
                if state is not None and not state.deleted and now_ms() - state.updated_at < self.policy.idle_ms:
                    await self.store._raw("ZADD", self._due_key, state.updated_at + self.policy.idle_ms, sid)
        self.metrics.due.set(int(await self.store._raw("ZCARD", self._due_key)))

    async def _archive(self, session_id: str) -> ArchiveResult | None:
        try:
            res = await self.archiver.archive(session_id, policy=self.policy)
        except Exception as e:  # an object store, the server or a damaged session: never the worker
            log.warning("archiver %s: %s: %s: %s", self.consumer, session_id, type(e).__name__, e)
            self.metrics.outcomes.labels("error").inc()
            return None
        self.metrics.outcomes.labels(res.status).inc()
        if res.status == "archived":  # the group's counters: Archiver.archive adds to them
            self.metrics.entries.inc(res.hi - res.lo)
            # net bytes: a merge can compress better than the segments it replaces (a counter
            # never goes down; the group's HINCRBY counter keeps the exact net)
            self.metrics.cold_bytes.inc(max(res.bytes, 0))
        return res
