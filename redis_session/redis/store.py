"""`RedisSessionStore`: the `SessionStore` contract on Redis Streams.

Every write is one Lua script (``lua/*.lua``) in one hash slot; reads are one round trip
(a pipelined ``HMGET`` + ``XRANGE``) decoded straight into `Entry` Structs by msgspec.

Hot paths skip redis-py's command layer on a standalone server: commands are packed to RESP here
(one `bytes.join`, keys cached per session) and sent on a connection of the client's own pool,
and replies come back from hiredis undecoded. Writes are never retried behind the caller's back:
a script whose reply was lost may have run, so that surfaces as `StoreUnavailableError` (retry
with the same ``idempotency_key`` to make it safe). On Redis Cluster, reads go through redis-py's
routing, and scripts are sent by this module to the node that owns the session's slot: a MOVED,
ASK, TRYAGAIN or CLUSTERDOWN reply, or a connection that could not be opened (the script did not
run), is followed in redis-py's slot table and re-sent; a lost connection is never re-sent, but the
topology is reloaded before the next call (see `cluster.py`).

Durability (``durability=``): ``"none"`` acknowledges once the primary ran the script (with AOF
``appendfsync everysec`` at most a second of writes can be lost on a crash); ``"aof"`` also waits
(WAITAOF) until the primary fsynced it to its AOF; ``"replica"`` waits (WAIT) until at least one
replica has it, so a failover keeps it. The wait runs on the same connection right after the
script, in the same round trip.
"""

from __future__ import annotations

import builtins
import contextlib
import heapq
import itertools
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn, cast

import anyio
import msgspec
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    NoScriptError,
    ResponseError,
)

from ..checks import MAX_N
from ..cold.segments import ColdTier, hot_start
from ..errors import (
    DurabilityError,
    IdempotencyKeyReusedError,
    InvalidEntryError,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionCorruptError,
    SessionError,
    SessionNotFoundError,
    SessionReplacedError,
    SessionRewoundError,
    StoreUnavailableError,
)
from ..keys import GONE_TTL_MS, Keys, id_from_index_member, index_member, is_staging_id, validate_session_id
from ..model import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_ENTRY_BYTES,
    EncodedEntry,
    Entry,
    NewEntryLike,
    Page,
    SessionHead,
    SessionHeader,
    Vocabulary,
    batch_digest,
    bound_error,
    legacy_incarnation,
    new_incarnation,
    now_ms,
)
from ..projection.chunks import (
    CHUNK,
    REASONING,
    TEXT,
    LiveRecord,
    live_draft,
    merge_live,
)
from ..projection.invariants import Problem
from ..store.protocol import IDEMPOTENCY_WINDOW, MAX_READ_RANGE, StorageCheck
from ..store.rules import Segment, check_list, check_read, lineage_for, plan_read, tail_start
from .answers import AnswerOps
from .cluster import ClusterRouter
from .coldtier import ColdTierOps
from .doctor import ColdCheck, stream_problems
from .replies import IO_ERRORS as _IO_ERRORS
from .replies import as_int as _i
from .replies import as_str as _s
from .replies import confirmed as _confirmed
from .replies import io_guard as _io
from .replies import typed_reply_error as _typed
from .replies import unavailable as _unavailable
from .rows import corrupt, rows_to_entries, take_entries
from .scripts import SCRIPTS as _SCRIPTS
from .scripts import Script as _Script
from .wire import (
    EVAL,
    EVALSHA,
    RAW,
    HeldWire,
    PooledWire,
    bulks,
    pack,
    pool_size,
    raw_client,
    read_replies,
    settle_client,
    socket_timeout,
)

_json = msgspec.json.Encoder()
_decode_any = msgspec.json.Decoder()
_segments_decoder = msgspec.json.Decoder(list[tuple[str, int, int]])
_draft_decoder = msgspec.json.Decoder(dict[str, Any])


log = logging.getLogger(__name__)


# An unlink that leaves a hidden or ephemeral parent with at most this many links checks them.
_REPAIR_ON_UNLINK = 64

# --------------------------------------------------------------------------- RESP (see wire.py)

_ENTRY_RESP = b"$%d\r\n%b\r\n" * 6
_PLAIN_RESP = b"$%d\r\n%b\r\n" * 3


def _entry_fields(e: EncodedEntry) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes]:
    """The six ARGV values of one entry in ``lua/append.lua``."""
    return (
        e.type.encode(),
        b"" if e.time is None else b"%d" % e.time,
        e.data_raw,
        e.meta_raw or b"",
        e.surface_raw or b"",
        b"" if e.bound is None else b"%d" % e.bound,
    )


def _pack_entries(batch: Sequence[EncodedEntry]) -> tuple[bytes, int]:
    """Every entry's ARGV values as RESP, and how many each takes: three (type, time, data) when
    no entry of the batch has meta, surface or a bound (append.lua reads the layout off ARGV's
    length), else six. Fewer arguments are the cheapest server CPU an append can save."""
    out = []
    if all(e.meta_raw is None and e.surface_raw is None and e.bound is None for e in batch):
        for e in batch:
            t, tm, d = e.type.encode(), b"" if e.time is None else b"%d" % e.time, e.data_raw
            out.append(_PLAIN_RESP % (len(t), t, len(tm), tm, len(d), d))
        return b"".join(out), 3
    for e in batch:
        t, tm, d, m, s, c = _entry_fields(e)
        out.append(_ENTRY_RESP % (len(t), t, len(tm), tm, len(d), d, len(m), m, len(s), s, len(c), c))
    return b"".join(out), 6


def _xread_rows(resp: Any) -> builtins.list[Any]:
    if not resp:
        return []
    if isinstance(resp, dict):  # RESP3: {key: rows}
        return [row for rows in resp.values() for row in rows]
    return cast(builtins.list[Any], resp[0][1])


def _xread_by_key(resp: Any, *keys: str) -> builtins.list[builtins.list[Any]]:
    """An XREAD reply over several streams, as each key's rows (in `keys` order)."""
    out: builtins.list[builtins.list[Any]] = [[] for _ in keys]
    if not resp:
        return out
    pairs = resp.items() if isinstance(resp, dict) else resp
    for k, rows in pairs:
        name = _s(k)
        for i, key in enumerate(keys):
            if name == key:
                out[i] = builtins.list(rows)
    return out


def _own_rows(batch: Sequence[Entry], records: Sequence[LiveRecord], life: str | None, own: set[str]) -> bool:
    """Whether `batch` holds only chunk rows of answers begun in `life` (noted in `own` from the
    begin records among `records`, or earlier ones): those need no header check."""
    for r in records:
        if r.kind == "begin" and r.incarnation == life:
            own.add(r.answer)
    return all(e.type == CHUNK and e.data.get("answer") in own for e in batch)


_COMPACT_KINDS = {b"t": TEXT, b"r": REASONING}


def _live_records(rows: Any) -> builtins.list[LiveRecord]:
    """The live stream's rows as records: a text or reasoning delta in one field (``t`` / ``r``
    -> ``"<answer> <index> <life> <text>"``, `compact_value`) split here directly; the four
    fields of older writers (``a i t l``) built directly too; any other record by its fields."""
    out: builtins.list[LiveRecord] = []
    append = out.append
    kinds = _COMPACT_KINDS
    for rid, f in rows or ():
        listed = type(f) is builtins.list
        if listed and len(f) == 2:
            kind = kinds.get(f[0])
            if kind is not None:
                p = f[1].split(b" ", 3)
                if len(p) == 4 and p[1].isdigit():
                    append(LiveRecord(
                        answer=p[0].decode(), kind=kind, id=rid.decode(), index=int(p[1]), text=p[3].decode(),
                        incarnation=p[2].decode(),
                    ))  # fmt: skip
                    continue
        elif listed and len(f) == 8 and f[0] == b"a" and f[2] == b"i" and f[4] == b"t" and f[6] == b"l":
            # the commonest record, a plain text delta ("a i t l"): built directly
            i = f[3]
            if i.isdigit():
                append(LiveRecord(
                    answer=f[1].decode(), kind=TEXT, id=rid.decode(), index=int(i), text=f[5].decode(),
                    incarnation=f[7].decode(),
                ))  # fmt: skip
                continue
        d = f if isinstance(f, dict) else dict(zip(f[::2], f[1::2], strict=False))
        append(LiveRecord.from_fields(_s(rid) or "", {_s(k) or "": _s(v) or "" for k, v in d.items()}))
    return out


class _Hdr(msgspec.Struct):
    header: SessionHeader
    n: int
    updated_at: int
    last_cut: int | None
    segments: builtins.list[Segment]
    deleted: bool
    ttl_ms: int | None
    cold_end: int = 0  # the end of the archived range (0: nothing archived)


_COUNT = re.compile(rb"0|[1-9][0-9]{0,15}")
"""A count, an n or a time in ms as the scripts write it (``%d`` of a number in [0, 2^53 - 1])."""


def _count(raw: Any, field: str) -> int:
    """A header field that is a count (n, at, created_at …) as redis-session writes it, else the
    corruption error naming it: never a sign, a space, a fraction or a number past 2^53 - 1 read as
    if it were one."""
    b = raw.encode() if isinstance(raw, str) else raw
    if not isinstance(b, bytes) or not _COUNT.fullmatch(b) or int(b) > MAX_N:
        shown = "missing" if raw is None else repr(bytes(b)[:40]) if isinstance(b, (bytes, bytearray)) else repr(raw)
        raise corrupt(f"the header's {field} is {shown}, not a count in [0, 2^53 - 1]")
    return int(b)


def _not_found_or_corrupt(session_id: str, n_raw: Any, inc_raw: Any, born_raw: Any) -> NoReturn:
    """Raise for a header read without its n or deleted: `SessionNotFoundError`, unless the header
    is there without its n (edited outside redis-session): the corruption error."""
    if n_raw is None and (inc_raw is not None or born_raw is not None):
        raise corrupt(f"the header of {session_id!r} has no n")
    raise SessionNotFoundError(session_id)


def _segments_of(session_id: str, raw: bytes | None) -> builtins.list[Segment]:
    """A branch header's ``segments`` (where it reads its prefix), else the corruption error."""
    try:
        return [] if raw is None else _segments_decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise corrupt(f"the header's segments of {session_id!r} are not what redis-session writes: {e}") from None


def _ttl(raw: bytes | None) -> int | None:
    """A header's ``ttl_ms``: None (no expiry) or a count of at least 1 ms."""
    if raw is None:
        return None
    ttl = _count(raw, "ttl_ms")
    if ttl < 1:
        raise corrupt("the header's ttl_ms is 0, not a duration of at least 1 ms")
    return ttl


def _parse_hdr(raw: dict[bytes, bytes], session_id: str | None = None) -> _Hdr | None:
    """A header hash as read (None: no session), or the corruption error of one that is not what
    redis-session writes: a hash without its ``n``, a count that is no count, an origin that is no
    JSON, an ``id`` that is not the session's own (`session_id`, when given) …"""
    if not raw:
        return None
    if session_id is not None and raw.get(b"id") != session_id.encode():
        raise corrupt(f"the header of {session_id!r} names the session {_s(raw.get(b'id'))!r}")
    try:
        return _hdr_fields(raw)
    except (ValueError, msgspec.DecodeError) as e:
        raise corrupt(f"a header field is not what redis-session writes: {e}") from None


def _hdr_fields(raw: dict[bytes, bytes]) -> _Hdr:
    g = raw.get

    def count(field: bytes, default: int | None = None) -> int | None:
        value = g(field)
        return default if value is None else _count(value, field.decode())

    origin_raw = g(b"origin")
    seg_raw = g(b"segments")
    created_at = _count(g(b"created_at"), "created_at")
    header = SessionHeader(
        id=_s(g(b"id")) or "",
        format_version=cast(int, count(b"format_version", 1)),
        created_at=created_at,
        parent=_s(g(b"parent")),
        at=count(b"at"),
        delegation_depth=cast(int, count(b"delegation_depth", 0)),
        title=_s(g(b"title")),
        origin=None if origin_raw is None else _decode_any.decode(origin_raw),
        incarnation=_s(g(b"incarnation")) or legacy_incarnation(created_at),
        create_key=_s(g(b"create_key")),
    )
    return _Hdr(
        header=header,
        n=_count(g(b"n"), "n"),
        updated_at=cast(int, count(b"updated_at", 0)),
        last_cut=count(b"last_cut"),
        segments=[] if seg_raw is None else _segments_decoder.decode(seg_raw),
        deleted=b"deleted" in raw,
        ttl_ms=_ttl(g(b"ttl_ms")),
        cold_end=hot_start(raw[b"cold"]) if b"cold" in raw else 0,
    )


def _header_fields(header: SessionHeader, segments: Sequence[Segment]) -> builtins.list[str | bytes]:
    f: builtins.list[str | bytes] = [
        "id", header.id,
        "format_version", str(header.format_version),
        "created_at", str(header.created_at),
        "delegation_depth", str(header.delegation_depth),
        "incarnation", header.incarnation,
    ]  # fmt: skip
    if header.parent is not None and header.at is not None:
        f += ["parent", header.parent, "at", str(header.at)]
    if header.title is not None:
        f += ["title", header.title]
    if header.origin is not None:
        f += ["origin", _json.encode(header.origin)]
    if header.create_key is not None:
        f += ["create_key", header.create_key]
    if segments:
        f += ["segments", _json.encode([list(s) for s in segments])]
    return f


def _entry_args(batch: Sequence[EncodedEntry]) -> builtins.list[bytes]:
    return [v for e in batch for v in _entry_fields(e)]


# put's EVALSHA body: keys, "append", expected_n, idempotency key, count, the cached tail,
# the expected incarnation, entries
_PUT_BODY = b"%b$6\r\nappend\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n%b$%d\r\n%b\r\n%b"


# put's EVALSHA body in append.lua's short layout: numkeys and keys, expected_n, the expected
# incarnation, the feed's session id and maxlen (with a feed), entries
_SHORT_BODY = b"%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b%b"


class _SessionWire(msgspec.Struct, frozen=True, gc=False):
    """One session's keys as the fast path sends them (bytes only: no reference cycles)."""

    keys: bytes  # numkeys and the append script's KEYS, as RESP bulks
    nkeys: int  # how many bulks `keys` holds
    hdr: bytes
    log: bytes
    put_tail: bytes  # append's constant ARGV[5..8]: feed_maxlen, session id, ttl "", nhdr "0"
    # append.lua's short layout (a plain put): numkeys, hdr, log, feed?; b"" for a session seen
    # ephemeral (its TTL refresh needs the long layout)
    short: bytes
    short_tail: bytes  # the short layout's ARGV[3..4] (session id, feed_maxlen) with a feed, else b""
    short_nargs: int  # how many bulks `short` and the short layout's fixed ARGV hold together


def _whole(entries: builtins.list[Entry], start: int, end: int) -> bool:
    """Whether `entries` are exactly entries [start, end): the rows' IDs rise (a stream's do) and
    each names its n (`rows`), so the first n, the last and the count tell a row deleted
    (``XDEL``, a trim) or added outside redis-session, which a read must not pass on as a shorter
    or longer log (`redis-session doctor` names the row)."""
    want = max(end - start, 0)
    return len(entries) == want and (not want or (entries[0].n == start and entries[-1].n == end - 1))


class RedisSessionStore(ColdTierOps, AnswerOps):
    """Sessions on Redis Streams (see the README for the key layout).

    Build it with `RedisSessionStore.from_url("redis://localhost:6379/0")` or around an existing
    ``redis.asyncio`` client (its connection pool is shared; replies are read undecoded whatever
    the client's ``decode_responses``).
    """

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        prefix: str = "rs",
        vocabulary: Vocabulary | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        max_batch: int = DEFAULT_MAX_BATCH,
        feed: bool = True,
        feed_shards: int = 4,
        index_shards: int = 4,
        feed_maxlen: int = 100_000,
        block_ms: int = 5_000,
        live_maxlen: int = 100_000,
        durability: str = "none",
        wait_timeout_ms: int = 2_000,
        owns_client: bool = False,
        cold: ColdTier | str | None = None,
    ) -> None:
        if durability not in ("none", "aof", "replica"):
            raise ValueError("durability must be 'none', 'aof' or 'replica'")
        self.durability = durability
        self.wait_timeout_ms = wait_timeout_ms
        self._durable = {
            "none": b"",
            "aof": pack(("WAITAOF", 1, 0, wait_timeout_ms)),
            "replica": pack(("WAIT", 1, wait_timeout_ms)),
        }[durability]
        if not 1 <= max_batch <= 65_535:
            raise ValueError("max_batch must be in [1, 65535] (append.lua packs the batch length in 16 bits)")
        self.cluster = isinstance(client, RedisCluster)
        settle_client(client)  # no package-metadata lookup per new connection (on the loop)
        self._user_client = client
        self.client = raw_client(client)
        self.keys = Keys(prefix, feed_shards, index_shards)
        self.prefix = prefix
        self.vocabulary = vocabulary if vocabulary is not None else Vocabulary()
        self.max_entry_bytes = max_entry_bytes
        self.max_batch = max_batch
        self.feed = feed
        self.feed_maxlen = feed_maxlen
        self.block_ms = block_ms
        self.live_maxlen = live_maxlen
        self._owns_client = owns_client
        # the cold tier (archived segments): given, or found at first need under {prefix}:cold:url
        self.cold: ColdTier | None = ColdTier(cold, prefix=prefix) if isinstance(cold, str) else cold
        if self.cold is not None:
            self.cold.bind(prefix)  # its objects live under this prefix (one tier, one prefix)
        # The fast path: the pool of a standalone client (None on a cluster: redis-py routes).
        self._pool = None if isinstance(self.client, RedisCluster) else PooledWire(self.client)
        self._router = ClusterRouter(self.client, read_replies) if isinstance(self.client, RedisCluster) else None
        self._packed_keys: dict[str, _SessionWire] = {}  # caches keys, feed and feed_maxlen: fixed
        # Plain puts in append.lua's short layout (False: always the long one; tests compare both)
        self._short_puts = True
        # `tail_live` holds one pooled connection for its loop (False: one per call; a bench compares)
        self._hold_tails = True
        self._last_acks: Any = None
        self._hints: dict[str, int] = {}  # cluster feed hints waiting for the background flush
        self._hint_task: Any = None
        self._socket_timeout = socket_timeout(client)

    @property
    def _tail_block_ms(self) -> int:
        """How long a tail's XREAD blocks: `block_ms` (read at each call, so a change to it takes
        effect on the next block), below the socket timeout, or an idle tail on a healthy server
        would look like a dead one."""
        timeout = self._socket_timeout
        return self.block_ms if timeout is None else max(100, min(self.block_ms, int(timeout * 1000) - 1000))

    @classmethod
    def from_url(cls, url: str, prefix: str = "rs", cluster: bool = False, **kwargs: Any) -> RedisSessionStore:
        """Connect to ``redis://``, ``rediss://`` or ``unix://``; `cluster=True` for Redis Cluster.

        `client_options` go to redis-py (``pool_timeout``: how long a command waits for a pooled
        connection when all are in use, default 5 s)."""
        opts: dict[str, Any] = {
            "socket_connect_timeout": 5,
            "socket_timeout": 10,
            "health_check_interval": 30,
        }
        opts.update(kwargs.pop("client_options", {}))
        client: aioredis.Redis | RedisCluster
        if cluster:
            client = RedisCluster.from_url(url, **opts)
        else:
            # A burst past the pool's size (a hundred SSE readers joining at once, a pod's writers
            # all at the same moment) waits up to `pool_timeout` seconds for a connection instead
            # of failing at once with "Too many connections" (`?max_connections=` sets the size).
            timeout = opts.pop("pool_timeout", 5.0)
            opts.setdefault("max_connections", 100)
            client = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(url, timeout=timeout, **opts))
        return cls(client, prefix=prefix, owns_client=True, **kwargs)

    @property
    def max_connections(self) -> int | None:
        """The size of the connection pool (None: unbounded, or a cluster client): each live tail
        holds one connection in XREAD BLOCK, so servers of many tails bound them by it."""
        return None if self.cluster else pool_size(self.client)

    async def aclose(self) -> None:
        if self._hint_task is not None and not self._hint_task.done():
            with anyio.move_on_after(5), contextlib.suppress(Exception):
                await self._hint_task  # the queued feed hints go out before the client closes
        if self._pool is not None:
            await self._pool.aclose()  # the kept connection back to the pool (the client may go on)
        if self._owns_client:
            await self._user_client.aclose()

    # ------------------------------------------------------------------ plumbing

    async def _send(
        self, packed: bytes, count: int, *, retry: bool = False, soft_tail: bool = False
    ) -> builtins.list[Any]:
        """Write `count` packed commands at once on one pooled connection; their raw replies
        (`PooledWire.send`).

        Every reply is read even when one is an error, so the connection goes back to the pool
        in step; the first error is raised after. Scripts are never re-sent (see the module
        docstring); with `retry` (commands that are safe to repeat: reads, index upkeep), a
        connection the server closed while it sat idle in the pool (a restart, CLIENT KILL, an
        idle timeout) costs one retry on a fresh connection instead of an error. With `soft_tail`
        an error reply of the last command is returned in place (a durability wait's failure must
        not hide the script's own reply)."""
        assert self._pool is not None
        try:
            return await self._pool.send(packed, count, retry=retry, soft_tail=soft_tail)
        except ResponseError as e:
            raise _typed(e) from None

    async def _raw(self, *args: Any) -> Any:
        if self._pool is None:
            assert self._router is not None
            return await self._router.call(lambda: self.client.execute_command(*args, **RAW))
        return (await self._send(pack(args), 1, retry=True))[0]

    async def _pipeline(self, *commands: Sequence[Any]) -> builtins.list[Any]:
        """Several commands in one round trip (not a transaction); their raw replies."""
        if self._pool is None:
            assert self._router is not None

            async def run() -> builtins.list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for c in commands:
                    pipe.execute_command(*c, **RAW)
                replies: builtins.list[Any] = await pipe.execute()
                return replies

            return await self._router.call(run)
        return await self._send(b"".join([pack(c) for c in commands]), len(commands), retry=True)

    async def _eval(self, name: str, keys: Sequence[str], args: Sequence[Any], *, durable: bool = False) -> Any:
        script = _SCRIPTS[name]
        body = bulks([len(keys), *keys, *args])
        return await self._eval_packed(script, 1 + len(keys) + len(args), body, keys[0], durable=durable)

    async def _eval_packed(
        self, script: _Script, count: int, body: bytes, route: str | bytes, durable: bool = False
    ) -> Any:
        """EVALSHA with `body` (numkeys, keys and ARGV: `count` packed bulks); EVAL if unknown.

        `route` is a key of the script (its slot picks the node on a cluster). With `durable`, the
        store's WAIT/WAITAOF follows in the same round trip; a shortfall raises `DurabilityError`
        once the caller has seen the script's own reply (see `_check_durable`)."""
        wait = self._durable if durable else b""
        try:
            packed = b"*%d\r\n%b%b%b" % (count + 2, EVALSHA, script.sha_bulk, body)
            replies = await self._send_write(route, packed + wait, 2 if wait else 1, bool(wait))
        except NoScriptError:
            packed = b"*%d\r\n%b%b%b" % (count + 2, EVAL, script.source_bulk, body)
            replies = await self._send_write(route, packed + wait, 2 if wait else 1, bool(wait))
        self._last_acks = replies[1] if wait else None
        return replies[0]

    async def _send_write(
        self, route: str | bytes, packed: bytes, count: int, soft_tail: bool = False
    ) -> builtins.list[Any]:
        if self._pool is not None:
            return await self._send(packed, count, soft_tail=soft_tail)
        return await self._cluster_send(route, packed, count, soft_tail=soft_tail)

    def _check_durable(self, session_id: str, entries: builtins.list[Entry], acks: Any) -> builtins.list[Entry]:
        if isinstance(acks, ResponseError):  # e.g. WAITAOF on a server without AOF
            raise DurabilityError(session_id, entries, self.durability, self.wait_timeout_ms, str(acks))
        if not _confirmed(acks):
            raise DurabilityError(session_id, entries, self.durability, self.wait_timeout_ms)
        return entries

    async def _cluster_ready(self) -> None:
        """Load the cluster topology once (and again when redis-py asks for it)."""
        assert self._router is not None
        await self._router.ready()

    async def _cluster_send(
        self, route: str | bytes, packed: bytes, count: int, *, soft_tail: bool = False
    ) -> builtins.list[Any]:
        """Send packed commands to the node owning `route`'s slot (`ClusterRouter.send`)."""
        assert self._router is not None
        try:
            return await self._router.send(route, packed, count, soft_tail)
        except ResponseError as e:
            raise _typed(e) from None

    def _keys_of(self, session_id: str) -> _SessionWire:
        """The session's keys, packed once; validates the id the first time it is seen."""
        try:
            return self._packed_keys[session_id]
        except (KeyError, TypeError):  # TypeError: an unhashable "id", rejected just below
            pass
        validate_session_id(session_id)
        keys = [*self.keys.session_keys(session_id), self.keys.gone(session_id)]
        if self.feed and not self.cluster:
            keys.append(self.keys.feed(self.keys.feed_shard(session_id)))
        short = keys[:2] + keys[9:]  # hdr, log and the feed shard (standalone with a feed)
        tail: builtins.list[str | int] = [session_id, self.feed_maxlen] if len(short) == 3 else []
        wire = _SessionWire(
            keys=bulks([len(keys), *keys]),
            nkeys=1 + len(keys),
            hdr=keys[0].encode(),
            log=keys[1].encode(),
            put_tail=bulks([self.feed_maxlen, session_id, b"", b"0"]),
            short=bulks([len(short), *short]) if self._short_puts else b"",
            short_tail=bulks(tail),
            short_nargs=1 + len(short) + 2 + len(tail),
        )
        if len(self._packed_keys) >= 4096:  # a bound, not an LRU: hot sessions come right back
            self._packed_keys.clear()
        self._packed_keys[session_id] = wire
        return wire

    def _long_puts(self, session_id: str) -> None:
        """Send `session_id`'s plain puts in append.lua's long layout from now on (it is ephemeral:
        each write restarts the TTL of every key)."""
        k = self._keys_of(session_id)
        if k.short:
            self._packed_keys[session_id] = msgspec.structs.replace(k, short=b"")

    async def _hdr(self, session_id: str) -> _Hdr | None:
        raw = await self._raw("HGETALL", self.keys.hdr(session_id))
        return _parse_hdr(_as_dict(raw), session_id)

    # ------------------------------------------------------------------ contract

    async def head(self, session_id: str) -> SessionHead | None:
        validate_session_id(session_id)
        with _io():
            h = await self._hdr(session_id)
        if h is None or h.deleted:
            return None
        return SessionHead(header=h.header, n=h.n, updated_at=h.updated_at, last_cut=h.last_cut)

    async def read(
        self, session_id: str, start: int = 0, stop: int | None = None, *, incarnation: str | None = None
    ) -> builtins.list[Entry]:
        check_read(session_id, start, stop)
        with _io():
            # One round trip in the common case: the header check and the own-stream range together,
            # and the header's identity again after the range. Incarnations are never reused, so the
            # same one on both sides means the range was read from that session's log, not from one
            # that took its id in between (a pipeline is not a transaction).
            k = self._keys_of(session_id)
            hdr_key, log_key = k.hdr, k.log
            for _attempt in range(3):
                (n_raw, deleted, at_raw, seg_raw, inc_raw, born_raw, cold_raw), rows, after = await self._pipeline(
                    ("HMGET", hdr_key, b"n", b"deleted", b"at", b"segments", b"incarnation", b"created_at", b"cold"),
                    (
                        "XRANGE",
                        log_key,
                        b"%d-1" % start,
                        b"+" if stop is None else b"%d-1" % max(stop - 1, 0),
                        b"COUNT",
                        MAX_READ_RANGE,
                    ),
                    ("HMGET", hdr_key, b"incarnation", b"created_at", b"cold"),
                )
                if n_raw is None or deleted is not None:
                    _not_found_or_corrupt(session_id, n_raw, inc_raw, born_raw)
                inc = self._check_incarnation(session_id, incarnation, inc_raw, born_raw)
                if after[0] == inc_raw and after[1] == born_raw and after[2] == cold_raw:
                    break  # the same life, and no archive or restore moved entries in between
                if incarnation is not None and (after[0] != inc_raw or after[1] != born_raw):
                    raise SessionReplacedError(session_id)
            else:
                raise StoreUnavailableError(f"session {session_id!r} was replaced during every read attempt")
            n = _count(n_raw, "n")
            if stop is not None and stop <= start:
                return []
            if stop is None and len(rows) == MAX_READ_RANGE:  # a long log: page on, no giant reply
                paged = await self._page_on(session_id, rows, (inc_raw, born_raw, cold_raw))
                if paged is None:  # archived (or restored) under the pages: read again
                    return await self.read(session_id, start, stop, incarnation=incarnation)
                rows = paged
            # The reply's ~9 objects per row are dropped as they are decoded, so the collector
            # passes that the new entries trigger do not walk them.
            own = take_entries(rows if isinstance(rows, builtins.list) else builtins.list(rows))
            del rows
            if stop is not None and own and own[-1].n >= stop:
                own = [e for e in own if e.n < stop]
            if own and own[-1].n >= n:  # written after our HMGET: not part of this snapshot
                own = [e for e in own if e.n < n]
            at = 0 if at_raw is None else _count(at_raw, "at")
            # an archived prefix (the header's `cold` field): stitched in front of the hot stream
            own = await self._with_cold(session_id, inc, cold_raw, max(start, at), stop, n, own, incarnation)
            end = n if stop is None else min(stop, n)
            if start >= at:
                out = own
            else:
                segments = _segments_of(session_id, seg_raw)
                out = []
                for anc, lo, hi2 in plan_read(segments, at, n, start, stop):
                    if anc:
                        out.extend(await self._own_range(anc, lo, hi2))
                out.extend(own)
            if not _whole(out, start, end):
                await self._not_whole(session_id, inc, out, start, end)
            return out

    async def _not_whole(self, session_id: str, inc: str, got: builtins.list[Entry], start: int, end: int) -> None:
        """Raise for a read that did not come out as entries [start, end): the session deleted or
        replaced while its branch's prefix was read (its last branch gone, a parent's log goes
        too), else a log edited outside redis-session."""
        head = await self.head(session_id)
        if head is None:
            raise SessionNotFoundError(session_id)
        if (head.header.incarnation or legacy_incarnation(head.header.created_at)) != inc:
            raise SessionReplacedError(session_id)
        shown = f"n={got[0].n}..{got[-1].n}" if got else "nothing"
        raise corrupt(
            f"the log of {session_id!r} holds {len(got)} entries ({shown}) where [{start}, {end}) has "
            f"{max(end - start, 0)}; `redis-session doctor {session_id}` names the rows"
        )

    async def _page_on(self, session_id: str, rows: Any, seen: tuple[Any, Any, Any]) -> builtins.list[Any] | None:
        """The rest of a long log after its first page `rows`, then the header checked against
        `seen` (incarnation, created_at, cold as read before the first page): None when an
        archive or restore moved entries meanwhile (the caller reads again)."""
        k = self._keys_of(session_id)
        rows = builtins.list(rows)
        while True:
            more = await self._raw("XRANGE", k.log, b"(" + rows[-1][0], b"+", b"COUNT", MAX_READ_RANGE)
            rows.extend(more)
            if len(more) < MAX_READ_RANGE:
                break
        after = await self._raw("HMGET", k.hdr, b"incarnation", b"created_at", b"cold")
        if after[0] != seen[0] or after[1] != seen[1]:
            raise SessionReplacedError(session_id, "replaced while a long log was read")
        return rows if after[2] == seen[2] else None

    @staticmethod
    def _check_incarnation(session_id: str, expected: str | None, inc_raw: Any, born_raw: Any) -> str:
        """The incarnation of a header read as raw `incarnation` and `created_at` values; raises
        `SessionReplacedError` when it is not `expected` (None: any)."""
        inc = _s(inc_raw) or legacy_incarnation(_count(born_raw, "created_at"))
        if expected is not None and inc != expected:
            raise SessionReplacedError(session_id)
        return inc

    async def put(
        self,
        session_id: str,
        expected_n: int | None,
        entries: Sequence[NewEntryLike],
        *,
        idempotency_key: str | None = None,
        incarnation: str | None = None,
    ) -> builtins.list[Entry]:
        k = self._keys_of(session_id)  # validates the id the first time it is seen
        batch = self._put_batch(expected_n, entries, idempotency_key, incarnation)
        expected = b"" if expected_n is None else b"%d" % expected_n
        # "<window>:<digest>:<key>": append.lua keeps the digest of the batch with its key
        idem = (
            b""
            if idempotency_key is None
            else b"%d:%b:%b" % (IDEMPOTENCY_WINDOW, batch_digest(batch), idempotency_key.encode())
        )
        inc = b"" if incarnation is None else incarnation.encode()
        script, durable = _SCRIPTS["append"], bool(self._durable)
        try:
            # The whole EVALSHA body in one format: keys and the per-session ARGV are cached.
            packed, stride = _pack_entries(batch)
            res = None
            if k.short and stride == 3 and batch and not idem:
                # a plain put: append.lua's short layout (hdr, log, feed; no idempotency window)
                body = _SHORT_BODY % (k.short, len(expected), expected, len(inc), inc, k.short_tail, packed)
                res = await self._eval_packed(script, k.short_nargs + 3 * len(batch), body, k.hdr, durable)
                if int(res[0]) == 9:  # ephemeral: its TTL refresh needs every key (nothing was written)
                    self._long_puts(session_id)
                    res = None
            if res is None:  # the long layout: an idempotency key, meta, surface, bound, a TTL
                count = b"%d" % len(batch)
                body = _PUT_BODY % (
                    k.keys, len(expected), expected, len(idem), idem, len(count), count, k.put_tail,
                    len(inc), inc, packed,
                )  # fmt: skip
                res = await self._eval_packed(script, k.nkeys + 9 + stride * len(batch), body, k.hdr, durable)
            code = int(res[0])
            acks = self._last_acks  # taken before any other await: other tasks share the store
            if code == 0:
                first, now = int(res[1]), int(res[2])
                if self.feed and self.cluster and any(enc.type != "assistant/chunk" for enc in batch):
                    self._feed_cluster(session_id, first + len(batch))  # chunk rows change no projection
                if len(res) > 3 and 0 < int(res[3]) <= _REPAIR_ON_UNLINK:
                    # an ephemeral session kept for its branches: those that expired never unlinked
                    # themselves; dropping their links lets it expire again (the write stands
                    # whatever becomes of this clean-up: the next write or a repair redoes it)
                    with contextlib.suppress(SessionError, *_IO_ERRORS):
                        await self.repair_links(session_id)
                return self._check_durable(
                    session_id, [enc.stored(first + i, now) for i, enc in enumerate(batch)], acks
                )
            if code == 1:
                first, landed_count = int(res[1]), int(res[2])
                landed = await self.read(session_id, first, first + landed_count, incarnation=incarnation)
                return self._check_durable(session_id, landed, acks)
        except _IO_ERRORS as e:
            raise _unavailable(e) from e
        if code == 7:
            raise IdempotencyKeyReusedError(session_id, cast(str, idempotency_key))
        self._raise(code, res, session_id, expected_n, batch)
        raise AssertionError("unreachable")

    async def _append_script(
        self,
        session_id: str,
        argv: Sequence[bytes | str | int],
        batch: Sequence[EncodedEntry],
        *,
        durable: bool = False,
    ) -> Any:
        """Run ``lua/append.lua`` on `session_id` with the fixed `argv` followed by the entries."""
        k = self._keys_of(session_id)
        packed, stride = _pack_entries(batch)
        body = b"%b%b%b" % (k.keys, bulks(argv), packed)
        return await self._eval_packed(
            _SCRIPTS["append"], k.nkeys + len(argv) + stride * len(batch), body, k.hdr, durable
        )

    def _feed_cluster(self, session_id: str, n: int) -> None:
        """Queue the change-feed hint "session reached n" (a cluster only).

        On a cluster the feed shard lives in another slot than the session, so the append script
        cannot write it. Awaiting it would add a round trip to every append, so hints are queued,
        coalesced per session and sent by one background task in a pipeline. A hint is not the
        truth: one lost (a crash before the flush) costs the projector speed, never correctness."""
        self._hints[session_id] = max(n, self._hints.get(session_id, 0))
        if self._hint_task is None or self._hint_task.done():
            import asyncio

            self._hint_task = asyncio.get_running_loop().create_task(self._flush_hints())

    async def _flush_hints(self) -> None:
        while self._hints:
            hints, self._hints = self._hints, {}
            with contextlib.suppress(Exception):  # never turn an append that landed into an error
                await self._cluster_ready()
                pipe = self.client.pipeline(transaction=False)
                for sid, n in hints.items():
                    pipe.execute_command(
                        "XADD", self.keys.feed(self.keys.feed_shard(sid)),
                        "MAXLEN", "~", str(self.feed_maxlen), "*", "s", sid, "n", str(n),
                    )  # fmt: skip
                await pipe.execute(raise_on_error=False)

    @staticmethod
    def _raise(code: int, res: Any, session_id: str, expected_n: int | None, batch: Sequence[EncodedEntry]) -> None:
        if code == 2:
            raise SessionConflictError(session_id, cast(int, expected_n), int(res[1]))
        if code == 3:
            raise SessionNotFoundError(session_id)
        if code == 4:
            index = int(res[1])
            raise bound_error(batch[index], int(res[2]), index)
        if code == 5:
            raise SessionAlreadyExistsError(session_id)
        if code == 8:
            raise SessionReplacedError(session_id, "this write was meant for the session before")
        if code == 10:
            raise SessionReplacedError.created_and_deleted(session_id)
        if code == 11:
            raise SessionCorruptError.header_field(session_id, _s(res[1]) or "")
        if code == 6:
            raise SessionError(
                f"session {session_id!r}: the stream is ahead of the header (last ID {_s(res[1])}); "
                "run `redis-session doctor`"
            )
        raise SessionError(f"unexpected reply from append.lua: {res!r}")

    async def create(
        self,
        header: SessionHeader,
        entries: Sequence[NewEntryLike] = (),
        *,
        ttl_ms: int | None = None,
        parent_incarnation: str | None = None,
    ) -> SessionHead:
        batch = self._create_batch(header, entries, ttl_ms)
        first_n = header.at or 0
        if header.created_at == 0:
            header = msgspec.structs.replace(header, created_at=now_ms())
        header = msgspec.structs.replace(header, incarnation=new_incarnation())  # every create: a new life
        member = index_member(header.created_at, header.id)
        sid = header.id
        segments: builtins.list[Segment] = []
        settle = ephemeral_parent = False  # a branch: whatever stops it after its link settles the link
        with _io():
            if header.parent is not None:
                settle = True
                segments, ephemeral_parent = await self._create_link(header, member, parent_incarnation)
            argv = self._create_argv(header, segments, batch, ttl_ms)
            res, acks = await self._create_script(header, member, argv, batch, settle)
            if ttl_ms is not None:
                self._long_puts(sid)  # its puts restart every key's TTL: no redirect from the short layout
            now = int(res[2])
            await self._create_index(header, member, ephemeral_parent, parent_incarnation)
            if self.feed and self.cluster and batch:
                self._feed_cluster(sid, first_n + len(batch))
            self._check_durable(sid, [enc.stored(first_n + i, now) for i, enc in enumerate(batch)], acks)
        n = first_n + len(batch)
        last_cut = None
        for i, enc in enumerate(batch):
            if enc.type == "cut":
                last_cut = first_n + i
        return SessionHead(header=header, n=n, updated_at=now, last_cut=last_cut)

    async def _create_link(
        self, header: SessionHeader, member: str, parent_incarnation: str | None = None
    ) -> tuple[builtins.list[Segment], bool]:
        """A branch's first step: link `member` in its parent's kids (settled, shielded, if that
        is stopped), only into the parent's life `parent_incarnation` when given (checked in
        link.lua: `SessionReplacedError`, nothing linked); the child's lineage and whether the
        parent is ephemeral."""
        assert header.parent is not None and header.at is not None
        sid = header.id
        # The id first, as the memory store and dsh do: a taken id wins over a bad parent; before
        # it, a create key of a life that ended (append.lua's first check, made here before the link)
        if header.create_key is None:
            taken = await self._raw("EXISTS", self.keys.hdr(sid))
        else:
            taken, gone = await self._pipeline(
                ("EXISTS", self.keys.hdr(sid)), ("SISMEMBER", self.keys.gone(sid), header.create_key.partition(".")[0])
            )
            if int(gone):
                raise SessionReplacedError.created_and_deleted(sid)
        if int(taken):
            await self._raise_taken(sid)
            raise SessionAlreadyExistsError(sid)
        p = header.parent
        try:
            res = await self._link(p, header.at, member, parent_incarnation)
        except BaseException:
            await self._settle_branch(p, header, member, created=False, shielded=True)
            raise
        if int(res[0]) == 3:
            raise SessionNotFoundError(header.parent)
        if int(res[0]) == 8:
            raise SessionReplacedError(
                header.parent, f"the parent is incarnation {_s(res[1])} now, not {parent_incarnation}: not branched"
            )
        if int(res[0]) == 4:
            raise InvalidEntryError(f"branch point at={header.at} is beyond the parent's n={int(res[1])}")
        ephemeral_parent = len(res) > 5 and bool(res[5])
        parent_at = _i(res[2] or None)
        parent_segments = _segments_decoder.decode(res[3]) if res[3] else []
        return lineage_for(header.parent, parent_at, parent_segments, header.at), ephemeral_parent

    def _create_argv(
        self,
        header: SessionHeader,
        segments: Sequence[Segment],
        batch: Sequence[EncodedEntry],
        ttl_ms: int | None,
    ) -> builtins.list[Any]:
        """append.lua's fixed argv for a create (the header fields last)."""
        hdr_fields = _header_fields(header, segments)
        return [
            "create",
            "",
            "",
            str(len(batch)),
            str(self.feed_maxlen),
            header.id,
            "" if ttl_ms is None else str(ttl_ms),
            str(len(hdr_fields) // 2),
            "",
            *hdr_fields,
        ]

    async def _create_script(
        self,
        header: SessionHeader,
        member: str,
        argv: builtins.list[Any],
        batch: Sequence[EncodedEntry],
        settle: bool,
    ) -> tuple[Any, Any]:
        """Run the create script: its reply (success only) and the durability acks. A branch
        (`settle`) that fails or is stopped here settles its link first (shielded)."""
        sid = header.id
        try:
            res = await self._append_script(sid, argv, batch, durable=bool(self._durable))
            acks = self._last_acks  # taken before any other await: other tasks share the store
        except BaseException:
            if settle:  # an error, a cancellation, a lost reply: did the child land?
                await self._settle_branch(header.parent or "", header, member, created=None, shielded=True)
            raise
        code = int(res[0])
        if code != 0:
            if settle:
                await self._settle_branch(header.parent or "", header, member, created=None, shielded=True)
            if code == 5:
                await self._raise_taken(sid)
            self._raise(code, res, sid, None, batch)
        return res, acks

    async def _raise_taken(self, sid: str) -> None:
        """A create found the id taken: by a deleted session its live branches still read, say so."""
        if await self._raw("HGET", self.keys.hdr(sid), "deleted"):
            live, _stale = await self._link_members(sid)
            if live:
                raise SessionAlreadyExistsError.held_by_branches(sid, [id_from_index_member(m) for m in live])

    async def _create_index(
        self, header: SessionHeader, member: str, ephemeral_parent: bool, parent_incarnation: str | None = None
    ) -> None:
        """The created session gets its index entry; a branch also keeps (or gets back) its link."""
        if header.parent is None:
            if not is_staging_id(header.id):  # a replacing import's staging copy is never listed
                await self._raw("ZADD", self.keys.sessions(header.id), "0", member)
        else:
            with anyio.CancelScope(shield=True):  # the child landed: it gets listed and linked
                await self._settle_branch(
                    header.parent, header, member, created=True, parent_incarnation=parent_incarnation
                )
            if ephemeral_parent:
                await self.repair_links(header.parent)  # its TTL waits for its branches: none stale

    async def _link(self, parent: str, at: int, member: str, parent_incarnation: str | None = None) -> Any:
        """link.lua: check the parent (its life, when given) and the branch point, record
        `member` in its kids."""
        k = self.keys
        return await self._eval(
            "link", [k.hdr(parent), k.kids(parent), k.log(parent), k.idem(parent), k.proj(parent), k.draft(parent)],
            [at, member, parent_incarnation or ""],
        )  # fmt: skip

    async def _settle_branch(
        self,
        parent: str,
        header: SessionHeader,
        member: str,
        *,
        created: bool | None,
        shielded: bool = False,
        parent_incarnation: str | None = None,
    ) -> None:
        """After a branch's create: a child that exists gets its index entry and keeps (or gets
        back) its link; otherwise the link goes. `created` None: unknown (a lost reply).

        The link is checked after the create because a repair of the parent's links running
        between the two steps takes an in-flight link for stale; then the child links again,
        or, when its parent went meanwhile, is removed and `SessionNotFoundError` raised."""
        if shielded:  # a clean-up: cancellation must not stop it, and the original error matters more
            with anyio.CancelScope(shield=True):
                try:
                    await self._settle_branch(
                        parent, header, member, created=created, parent_incarnation=parent_incarnation
                    )
                except Exception:
                    pass  # what is left is a stale link: repaired by the parent's next delete or repair
            return
        sid = header.id
        if created is None:
            raw = await self._raw("HMGET", self.keys.hdr(sid), "created_at", "parent")
            created = raw[0] is not None and int(raw[0]) == header.created_at and _s(raw[1]) == parent
        if not created:
            await self._unlink(parent, member)
            return
        _, linked = await self._pipeline(
            ("ZADD", self.keys.sessions(sid), "0", member), ("ZSCORE", self.keys.kids(parent), member)
        )
        # linked again only into the life it was made from: a parent whose link a repair took for
        # stale may have been deleted and created again meanwhile
        if linked is None and int((await self._link(parent, header.at or 0, member, parent_incarnation))[0]) != 0:
            with anyio.CancelScope(shield=True):
                await self.delete(sid)
            raise SessionNotFoundError(parent)

    async def _unlink(self, parent_id: str, member: str) -> None:
        """Drop a child link; purge hidden ancestors that no longer have branches."""
        while parent_id:
            res = await self._eval("unlink", self.keys.session_keys(parent_id), [member])
            if int(res[0]) != 1:
                # a hidden or ephemeral parent still linked to a few branches: if those are stale
                # (expired, or cut short by a crash) they keep it for nothing
                if member and len(res) > 2 and int(res[2]) and 0 < int(res[1]) <= _REPAIR_ON_UNLINK:
                    await self.repair_links(parent_id)
                return
            grandparent = _s(res[1]) or ""
            if len(res) > 4 and res[4]:  # the purged parent's segments go with it (as on delete)
                await self._drop_cold(parent_id, _s(res[3]) or legacy_incarnation(int(res[2])), res[4])
            member = index_member(int(res[2]), parent_id)
            parent_id = grandparent

    async def _link_members(self, session_id: str) -> tuple[builtins.list[str], builtins.list[str]]:
        """The session's kids members, split into (live, stale)."""
        members = [m.decode() if isinstance(m, bytes) else m for m in await self._raw(
            "ZRANGE", self.keys.kids(session_id), 0, -1
        )]  # fmt: skip
        if not members:
            return [], []
        raws = await self._pipeline(
            *[("HMGET", self.keys.hdr(id_from_index_member(m)), "created_at", "parent") for m in members]
        )
        live: builtins.list[str] = []
        stale: builtins.list[str] = []
        for m, (created_at, parent) in zip(members, raws, strict=True):
            ok = created_at is not None and _s(parent) == session_id
            (live if ok and index_member(int(created_at), id_from_index_member(m)) == m else stale).append(m)
        return live, stale

    async def links(self, session_id: str) -> tuple[builtins.list[str], builtins.list[str]]:
        validate_session_id(session_id)
        with _io():
            live, stale = await self._link_members(session_id)
        return [id_from_index_member(m) for m in live], [id_from_index_member(m) for m in stale]

    async def repair_links(self, session_id: str) -> builtins.list[str]:
        validate_session_id(session_id)
        with _io():
            _, stale = await self._link_members(session_id)
            if not stale:
                return []
            kids = self.keys.kids(session_id)
            await self._raw("ZREM", kids, *stale)
            # A branch that was between its two steps may have created its child since: it keeps
            # its link (its own check after the create would restore it too).
            raws = await self._pipeline(
                *[("HMGET", self.keys.hdr(id_from_index_member(m)), "created_at", "parent") for m in stale]
            )
            removed: builtins.list[str] = []
            for m, (created_at, parent) in zip(stale, raws, strict=True):
                if (
                    created_at is not None
                    and _s(parent) == session_id
                    and index_member(int(created_at), id_from_index_member(m)) == m
                ):
                    await self._raw("ZADD", kids, "0", m)
                else:
                    removed.append(id_from_index_member(m))
            # no member named: purge the session if hidden and now without branches, or restart
            # an ephemeral one's clock (and unlink it from its own parent when purged)
            await self._unlink(session_id, "")
            return removed

    async def list(
        self, *, parent: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[SessionHeader]:
        check_list(parent, limit, cursor)
        # The list index is sharded (no single key takes every create); a page is the k-way merge
        # of the shards' pages. A parent's branches are one key in the parent's slot.
        keys = self.keys.all_sessions() if parent is None else [self.keys.kids(parent)]
        items: builtins.list[SessionHeader] = []
        unreadable: builtins.list[str] = []
        with _io():
            while True:
                # only as many members as the page still lacks: the cursor is the last member looked
                # at, so no member past it may have been read and left out (one skipped as stale or
                # unreadable made the next round read more than the page had room for)
                want = limit - len(items)
                lo = "-" if cursor is None else "(" + cursor
                pages = await self._pipeline(*[("ZRANGE", k, lo, "+", "BYLEX", "LIMIT", 0, want + 1) for k in keys])
                merged = heapq.merge(*[[bytes(m) for m in page] for page in pages])
                members = [m.decode() for m in itertools.islice(merged, want + 1)]
                more = len(members) > want
                members = members[:want]
                hgets = [("HGETALL", self.keys.hdr(id_from_index_member(m))) for m in members]
                try:
                    with _io():  # typed here on every path (a cluster's pipeline raises them raw)
                        raws = await self._pipeline(*hgets) if hgets else []
                except SessionCorruptError:  # one header is no hash: read them one by one to tell which
                    raws = [await self._header_or_error(cmd[1]) for cmd in hgets]
                stale = []
                for m, raw in zip(members, raws, strict=True):
                    try:
                        if isinstance(raw, SessionCorruptError):
                            raise raw
                        h = _parse_hdr(_as_dict(raw), id_from_index_member(m))
                    except SessionCorruptError:
                        # one session edited outside redis-session: listed as unreadable, never
                        # the end of the listing of every other one
                        unreadable.append(id_from_index_member(m))
                        continue
                    if h is None:
                        stale.append(m)  # expired (TTL) or half-deleted: heal the index lazily
                    elif index_member(h.header.created_at, h.header.id) != m and await self._indexed(h.header, keys):
                        # the member of an earlier life of the id (it expired, and the id was created
                        # again), beside the member of this one: listed once, by its own
                        stale.append(m)
                    elif not h.deleted:
                        items.append(h.header)
                if stale and parent is None:
                    await self._pipeline(*[("ZREM", self.keys.sessions(id_from_index_member(m)), m) for m in stale])
                cursor = members[-1] if more and members else None
                if cursor is None or len(items) >= limit:
                    return Page(items=items, cursor=cursor, unreadable=unreadable)

    async def _indexed(self, header: SessionHeader, keys: Sequence[str]) -> bool:
        """Whether the index (`keys`: the list shards, or a parent's branch set) holds the member
        of this life of the session: a member of the id that is not it is an earlier life's."""
        member = index_member(header.created_at, header.id)
        key = self.keys.sessions(header.id) if len(keys) > 1 else keys[0]
        return await self._raw("ZSCORE", key, member) is not None

    async def _header_or_error(self, key: str) -> Any:
        """A header's raw hash, or the `SessionCorruptError` of a key holding another kind of value."""
        try:
            with _io():
                return await self._raw("HGETALL", key)
        except SessionCorruptError as e:
            return e

    async def delete(self, session_id: str, *, incarnation: str | None = None) -> bool:
        validate_session_id(session_id)
        with _io():
            res = await self._eval("delete", self.keys.delete_keys(session_id), [incarnation or "", GONE_TTL_MS])
            code = int(res[0])
            if code == 3:
                raise SessionReplacedError(session_id, f"it is incarnation {_s(res[1])} now; nothing was deleted")
            if code == 0:
                # absent, or hidden already: a hidden one kept only by stale links goes now
                await self.repair_links(session_id)
                return False
            try:
                born = _count(res[1], "created_at")
            except SessionCorruptError:  # edited outside redis-session: deleted all the same; its
                born = None  # index member (which names created_at) is healed by the next list()
            member = None if born is None else index_member(born, session_id)
            if member is not None:
                await self._raw("ZREM", self.keys.sessions(session_id), member)
            if code == 2 and len(res) > 4 and res[4] and (res[3] or born is not None):
                await self._drop_cold(session_id, _s(res[3]) or legacy_incarnation(cast(int, born)), res[4])
            if code == 2 and res[2] and member is not None:
                await self._unlink(_s(res[2]) or "", member)
            if code == 1:
                await self.repair_links(session_id)  # hidden for branches: only for live ones
            return True

    async def swap_session(
        self,
        session_id: str,
        staged_id: str,
        *,
        incarnation: str,
        staged_incarnation: str | None = None,
        replaced_created_at: int | None = None,
        replaced_parent: str | None = None,
    ) -> SessionHead:
        """Make the complete session `staged_id` the session `session_id`, in one atomic step:
        the life `incarnation` of `session_id` is removed (its log, draft, projection, lease and
        answers in flight) and the staged header and log take its place under the id, keeping the
        staged incarnation; `staged_id` is gone after. Both ids must hash to one cluster slot
        (`importers.common.staging_id` picks such a staging id). Raises `SessionNotFoundError`
        (either is absent), `SessionReplacedError` (`session_id` names another life now) or
        `SessionAlreadyExistsError` (it has live branches); nothing changes then.

        Safe to retry after a lost reply: given `staged_incarnation` (and the replaced session's
        `replaced_created_at`, for its list entry), a retry that finds the swap landed finishes
        it (the list index) and answers the head.

        The staged session (created with a TTL, unlisted: `keys.is_staging_id`) becomes lasting
        and listed. A replaced branch is unlinked from its parent as its delete would (a hidden
        parent whose last branch it was is purged); a retry after a lost reply unlinks from
        `replaced_parent`."""
        validate_session_id(session_id)
        validate_session_id(staged_id)
        with _io():
            res = await self._eval(
                "swap",
                [*self.keys.session_keys(session_id), *self.keys.session_keys(staged_id), self.keys.gone(session_id)],
                [incarnation, session_id, staged_incarnation or "", GONE_TTL_MS],
            )  # fmt: skip
            code = int(res[0])
            if code == 3:
                raise SessionNotFoundError(session_id)
            if code == 8:
                raise SessionReplacedError(session_id, "it was replaced while the import ran")
            if code == 9:
                raise SessionAlreadyExistsError(session_id, "it has live branches, so it cannot be replaced")
            if code == 10:
                raise SessionNotFoundError(staged_id)
            if code == 11:  # landed before: a retry after a lost reply
                new_created, n = int(res[1]), int(res[2])
                old_created, old_parent = replaced_created_at, replaced_parent
            else:
                old_created, new_created, n = int(res[1]), int(res[2]), int(res[3])
                old_parent = _s(res[4]) if len(res) > 4 else None
            if old_parent and old_created is not None:
                with anyio.CancelScope(shield=True):  # the old branch is gone: its link goes too
                    await self._unlink(old_parent, index_member(old_created, session_id))
            if old_created is not None and old_created != new_created:
                await self._raw("ZREM", self.keys.sessions(session_id), index_member(old_created, session_id))
            await self._raw("ZREM", self.keys.sessions(staged_id), index_member(new_created, staged_id))
            await self._raw("ZADD", self.keys.sessions(session_id), "0", index_member(new_created, session_id))
            if self.feed:
                await self._raw(
                    "XADD", self.keys.feed(self.keys.feed_shard(session_id)),
                    "MAXLEN", "~", str(self.feed_maxlen), "*", "s", session_id, "n", str(n),
                )  # fmt: skip
        head = await self.head(session_id)
        if head is None:  # deleted by someone else right after the swap
            raise SessionNotFoundError(session_id)
        return head

    async def tail(
        self, session_id: str, start: int = 0, *, incarnation: str | None = None, resumed: bool = False
    ) -> AsyncIterator[Entry]:
        """Every entry with n >= start, then each new one as it lands (XREAD BLOCK).

        Resumable from any n; ends when the session is deleted. Raises `SessionReplacedError`
        when the id names another incarnation than `incarnation` (None: the one met at the
        start), at the start or at any later point: the header's identity is read right after
        every XREAD (same round trip), so no entry of a session that took the id is yielded."""
        inc, given, at = await self._tail_start(session_id, start, incarnation, resumed)
        nxt = start
        if nxt < at:
            for e in await self.read(session_id, nxt, at, incarnation=inc):
                yield e
            nxt = at
        key = self.keys.log(session_id)
        hdr_key = self.keys.hdr(session_id)
        last_id = "0-0" if nxt == 0 else f"{nxt - 1}-1"
        while True:
            with _io():
                resp, (deleted, inc_raw, born_raw, n_raw) = await self._pipeline(
                    ("XREAD", "COUNT", 1000, "BLOCK", self._tail_block_ms, "STREAMS", key, last_id),
                    ("HMGET", hdr_key, "deleted", "incarnation", "created_at", "n"),
                )
            if inc_raw is None and born_raw is None:
                return  # deleted: rows read just before may be of a session that came and went
            self._check_incarnation(session_id, inc, inc_raw, born_raw)
            self._check_rewound(session_id, nxt, given, n_raw)
            rows = _xread_rows(resp)
            if rows:
                batch = rows_to_entries(rows)
                batch = await self._in_sequence(session_id, nxt, batch, inc)
                for e in batch:
                    yield e
                nxt = batch[-1].n + 1
                given = max(given, nxt)
                last_id = _s(rows[-1][0]) or last_id
            if deleted is not None:
                return

    async def _tail_start(
        self, session_id: str, start: int, incarnation: str | None, resumed: bool
    ) -> tuple[str, int, int]:
        """A tail's first header read and `rules.tail_start`: the life it follows, the n the log was
        seen at (`given`, see `_check_rewound`), and where the hot stream starts (a branch; an archive)."""
        check_read(session_id, start, None)
        with _io():
            h = await self._hdr(session_id)
        if h is None or h.deleted:
            raise SessionNotFoundError(session_id)
        life = h.header.incarnation
        given = tail_start(session_id, start, h.n, life, incarnation, resumed)
        return life, given, max(h.header.at or 0, h.cold_end)

    @staticmethod
    def _check_rewound(session_id: str, nxt: int, given: int, n_raw: Any) -> None:
        """A tail at `nxt` on a log that was at `given` once, whose header n (`n_raw`, read after
        its XREAD) is now below both: the log lost entries the reader may have been given (a
        failover took them back), `SessionRewoundError`. A tail started ahead of its log is not
        behind anything: it waits."""
        n = _i(n_raw)
        if n is not None and n < nxt and n < given:
            raise SessionRewoundError(session_id, nxt, n)

    async def get_draft(
        self, session_id: str, *, live: bool = True, incarnation: str | None = None
    ) -> dict[str, Any] | None:
        """The open streamed answer so far (from the live stream, see `live_draft`), else the
        legacy draft `set_draft` wrote; with ``live=False`` only the latter; with `incarnation`,
        only of that life (read in the same round trip as the header: else `SessionReplacedError`)."""
        validate_session_id(session_id)
        with _io():
            (n_raw, deleted, inc_raw, born_raw), raw, *rows = await self._pipeline(
                ("HMGET", self.keys.hdr(session_id), "n", "deleted", "incarnation", "created_at"),
                ("GET", self.keys.draft(session_id)),
                *([("XRANGE", self.keys.live(session_id), "-", "+")] if live else []),
            )
        if n_raw is None or deleted is not None:
            raise SessionNotFoundError(session_id)
        life = self._check_incarnation(session_id, incarnation, inc_raw, born_raw)
        if rows:
            streamed = live_draft(_live_records(rows[0]), life)
            if streamed is not None:
                return streamed
        return None if raw is None else _draft_decoder.decode(raw)

    async def set_draft(self, session_id: str, draft: dict[str, Any] | None, *, incarnation: str | None = None) -> None:
        validate_session_id(session_id)
        raw = self._draft_bytes(draft) or b""
        with _io():
            ok = int(
                await self._eval(
                    "draft", [self.keys.hdr(session_id), self.keys.draft(session_id)], [raw, incarnation or ""]
                )
            )
        if ok == 2:
            raise SessionReplacedError(session_id, "this draft was meant for the session before")
        if ok == 3:
            raise SessionCorruptError.header_field(session_id, "ttl_ms")
        if ok != 1:
            raise SessionNotFoundError(session_id)

    # ------------------------------------------------------------------ live stream (§8.2)

    async def read_live(self, session_id: str, after: str | None = None) -> builtins.list[LiveRecord]:
        """The live stream's records (after stream id `after`, else all), oldest first."""
        validate_session_id(session_id)
        lo = "-" if after is None else "(" + after
        with _io():
            rows = await self._raw("XRANGE", self.keys.live(session_id), lo, "+")
        return _live_records(rows)

    async def tail_live(
        self,
        session_id: str,
        start: int = 0,
        *,
        live_after: str = "0-0",
        incarnation: str | None = None,
        resumed: bool = False,
    ) -> AsyncIterator[Entry | LiveRecord]:
        """`tail`, plus the live stream's records after stream id `live_after`: one XREAD BLOCK
        on both keys (one slot), so entries and live records come in the order they landed."""
        inc, given, at = await self._tail_start(session_id, start, incarnation, resumed)
        nxt = start
        if nxt < at:
            for e in await self.read(session_id, nxt, at, incarnation=inc):
                yield e
            nxt = at
        key, live_key, hdr_key = self.keys.log(session_id), self.keys.live(session_id), self.keys.hdr(session_id)
        last_id = "0-0" if nxt == 0 else f"{nxt - 1}-1"
        own: set[str] = set()  # answers whose begin record names this life
        # one pooled connection for the whole loop (a standalone server), not one per XREAD
        held = None if self._pool is None or not self._hold_tails else self._pool.hold()
        try:
            while True:
                xread = ("XREAD", "COUNT", 1000, "BLOCK", self._tail_block_ms, "STREAMS", key, live_key)
                with _io():
                    resp = await self._held_raw(held, *xread, last_id, live_after)
                log_rows, live_rows = _xread_by_key(resp, key, live_key)
                records = _live_records(live_rows) if live_rows else []
                batch = rows_to_entries(log_rows) if log_rows else []
                deleted = None
                if not _own_rows(batch, records, inc, own) or not (log_rows or live_rows):
                    # Entries, or an idle wake-up: is it still this session? (A delta needs no such
                    # round trip: after a re-creation the live stream starts with a begin record of
                    # the new incarnation, which `tail_deltas` refuses; nor do the chunk rows of an
                    # answer begun in this life: answer.lua writes them only into the life they began in.)
                    gone, deleted = await self._tail_check(held, session_id, hdr_key, inc, nxt, given)
                    if gone:
                        return
                if log_rows:
                    batch = await self._in_sequence(session_id, nxt, batch, inc)
                # in the order they happened (`merge_live`); what a COUNT cut short waits for the next read
                merged = merge_live(
                    batch, records, more_entries=len(log_rows or ()) >= 1000, more_records=len(live_rows or ()) >= 1000
                )
                for item in merged.items:
                    yield item
                if merged.records:
                    live_after = records[merged.records - 1].id
                if merged.entries:
                    nxt = batch[merged.entries - 1].n + 1
                    given = max(given, nxt)
                    last_id = f"{nxt - 1}-1"
                if deleted is not None and merged.entries == len(batch) and merged.records == len(records):
                    return
        finally:
            if held is not None:
                await held.release()

    async def _in_sequence(
        self, session_id: str, nxt: int, batch: builtins.list[Entry], inc: str
    ) -> builtins.list[Entry]:
        """A tail's batch from the hot stream, with what was archived behind the tail before it,
        checked to continue at `nxt` without a hole."""
        batch = await self._cold_gap(session_id, nxt, batch, inc)
        if batch[0].n != nxt or batch[-1].n != nxt + len(batch) - 1:
            raise SessionError(
                f"session {session_id!r}: the stream's IDs are out of sequence after n={nxt - 1} "
                f"(got {batch[0].n}..{batch[-1].n}); run `redis-session doctor`"
            )
        return batch

    async def _tail_check(
        self, held: HeldWire | None, session_id: str, hdr_key: str, inc: str, nxt: int, given: int
    ) -> tuple[bool, Any]:
        """A tail's header read after its XREAD: (gone, deleted). Gone: the key is no more;
        `SessionReplacedError` for another life, `SessionRewoundError` for a log that ends
        before the tail (a failover took entries back)."""
        with _io():
            deleted, inc_raw, born_raw, n_raw = await self._held_raw(
                held, "HMGET", hdr_key, "deleted", "incarnation", "created_at", "n"
            )
        if inc_raw is None and born_raw is None:
            return True, None
        self._check_incarnation(session_id, inc, inc_raw, born_raw)
        self._check_rewound(session_id, nxt, given, n_raw)
        return False, deleted

    async def _held_raw(self, held: HeldWire | None, *args: Any) -> Any:
        if held is None:
            return await self._raw(*args)
        try:
            return (await held.send(pack(args), 1))[0]
        except ResponseError as e:
            raise _typed(e) from None

    async def acquire_lease(self, session_id: str, token: str, ttl_ms: int, *, incarnation: str | None = None) -> bool:
        validate_session_id(session_id)
        with _io():
            res = int(await self._eval(
                "lease", [self.keys.hdr(session_id), self.keys.lease(session_id)],
                ["acquire", token, ttl_ms, incarnation or ""],
            ))  # fmt: skip
        if res == -1:
            raise SessionNotFoundError(session_id)
        if res == -2:
            raise SessionReplacedError(session_id, "the lease was asked for an earlier life of the id")
        return res == 1

    async def release_lease(self, session_id: str, token: str) -> bool:
        validate_session_id(session_id)
        with _io():
            res = int(await self._eval(
                "lease", [self.keys.hdr(session_id), self.keys.lease(session_id)], ["release", token, 0]
            ))  # fmt: skip
        return res == 1

    async def get_projection(self, session_id: str, *, incarnation: str | None = None) -> tuple[int, bytes] | None:
        validate_session_id(session_id)
        with _io():
            n_raw, state, inc = await self._raw("HMGET", self.keys.proj(session_id), "n", "state", "incarnation")
        if n_raw is None or state is None:
            return None
        if incarnation is not None and _s(inc) != incarnation:
            return None  # another life's snapshot (or one written before incarnations): not this one
        try:
            return int(n_raw), bytes(state)
        except ValueError:
            return None  # a damaged snapshot is no snapshot: readers fold from the log

    async def put_projection(self, session_id: str, n: int, state: bytes, *, incarnation: str | None = None) -> bool:
        validate_session_id(session_id)
        with _io():
            res = int(await self._eval(
                "proj", [self.keys.hdr(session_id), self.keys.proj(session_id)], [n, state, incarnation or ""]
            ))  # fmt: skip
        if res == -1:
            raise SessionNotFoundError(session_id)
        if res == -3:
            raise SessionReplacedError(session_id, "the snapshot was folded from the session before")
        if res == -2:
            raise ValueError(f"snapshot n={n} is beyond the session's n")
        return res == 1

    async def storage_problems(self, session_id: str, n: int, at: int) -> StorageCheck:
        """Doctor's storage checks: the session's own stream walked raw (`redis.doctor`)."""
        validate_session_id(session_id)
        hdr = self.keys.hdr(session_id)

        async def header_n() -> int | None:
            return _i(await self._raw("HGET", hdr, "n"))

        with _io():
            kinds = await self._key_kinds(session_id)
            if kinds:  # a key of another kind than the layout's: the walk would only fail on it
                return StorageCheck(kinds)
            for _attempt in range(5):
                cold_raw, inc_raw, born_raw = await self._raw("HMGET", hdr, "cold", "incarnation", "created_at")
                cold = None
                if cold_raw is not None:
                    inc = self._check_incarnation(session_id, None, inc_raw, born_raw)
                    cold = ColdCheck(session_id, inc, cold_raw, await self.cold_tier())
                check = await stream_problems(self._raw, self.keys.log(session_id), n, at, cold, header_n)
                # an archive (or a restore) that moved entries between the header's cold field
                # and the walk of the stream is no gap: look again
                if not check.problems or await self._raw("HGET", hdr, "cold") == cold_raw:
                    return check
            return check

    async def _key_kinds(self, session_id: str) -> builtins.list[Problem]:
        """A ``key-type`` problem for each key of the session holding another kind of value than
        the layout's (README, Redis key layout): one TYPE of each, in one round trip."""
        k = self.keys
        layout = [
            (k.hdr(session_id), b"hash"), (k.log(session_id), b"stream"), (k.proj(session_id), b"hash"),
            (k.idem(session_id), b"zset"), (k.kids(session_id), b"zset"), (k.live(session_id), b"stream"),
            (k.draft(session_id), b"string"), (k.lease(session_id), b"string"),
            (k.cold_pending(session_id), b"zset"), (k.gone(session_id), b"set"),
        ]  # fmt: skip
        kinds = await self._pipeline(*(("TYPE", key) for key, _ in layout))
        return [
            Problem(None, "key-type", f"{key} holds a {_s(got)}, where the layout has a {kind.decode()}")
            for (key, kind), got in zip(layout, kinds, strict=True)
            if _s(got) not in ("none", kind.decode())
        ]

    async def publish(self, event: str, payload: dict[str, Any]) -> None:
        """Publish `event` on ``{prefix}:events`` and, for the projector, on the change feed."""
        body = _json.encode({"event": event, **payload})
        with _io():
            await self._raw("PUBLISH", self.keys.events, body)
            sid = payload.get("session")
            if self.feed and isinstance(sid, str):
                await self._raw(
                    "XADD", self.keys.feed(self.keys.feed_shard(sid)), "MAXLEN", "~", str(self.feed_maxlen),
                    "*", "s", sid, "ev", event,
                )  # fmt: skip


def _as_dict(raw: Any) -> dict[bytes, bytes]:
    if isinstance(raw, dict):
        return raw
    if not raw:
        return {}
    return dict(zip(raw[::2], raw[1::2], strict=False))
