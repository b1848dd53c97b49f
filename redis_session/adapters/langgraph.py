"""A LangGraph checkpointer on redis-session: `RedisEventSaver`.

A ``langgraph.checkpoint.base.BaseCheckpointSaver`` (sync and async)::

    store = redis_session.open_store("redis://localhost:6379/0")
    graph = builder.compile(checkpointer=RedisEventSaver(store))
    graph.invoke(inputs, {"configurable": {"thread_id": "t-1"}})

A thread is one session (id ``langgraph:<thread_id>``; a thread id that is not a valid session id
is hashed, and kept in the header's ``origin``), so every namespace of a thread (subgraphs) lives in
one log and `delete_thread` is the store's delete. The log is append-only; each write of the saver
is one batch, so readers never see half of one:

- ``langgraph/checkpoint`` ``{ns, id, parent, checkpoint, metadata, blobs}``: one per `put`. The
  checkpoint (without its channel values) and the metadata are stored as JSON when they are
  lossless JSON (``checkpoint_t``/``metadata_t``, the serializer's typed bytes, otherwise); the
  channel values that changed (``new_versions``) are the serializer's typed bytes, base64, in
  ``blobs {channel: [version, type, data]}``. A value too big to sit inside the entry goes in a
  ``langgraph/blob`` entry of its own, before it in the same batch.
- ``langgraph/write`` ``{ns, cp, task, path, idx, ch, t, b}``: one per pending write (`put_writes`
  appends all of a call's writes as one batch). As in LangGraph's savers, a regular write (idx >= 0)
  already stored for ``(task, idx)`` is kept, a special one (error, interrupt…) is replaced.
- A payload larger than the store's entry limit continues in ``langgraph/part`` entries that
  follow it in the batch (``"parts": k``); a checkpoint entry too large (big metadata) is
  ``{ns, id, packed: 1, b}``: its JSON, base64, continued the same way.

Every `put`/`put_writes` batch carries an idempotency key derived from the batch itself, so a
retry of a write whose reply was lost lands once (the first write of a thread creates its
session empty, then appends with the key).

Lives: `delete_thread` of a thread that has a live branch only hides its session (the branch reads
its entries; the id stays taken until the branches are gone). The thread's next write starts it
again, as InMemorySaver does, in a new session: ``<prefix>~<sha256 of the thread id>~<k>`` for
its k-th life (its header's origin names the thread). `_resolve` finds the current life: the
visible one, else the one after the last hidden one (it looks two ids at a time, so a thread whose
two consecutive earlier lives were both purged while a later one lives is not followed there).

Checkpoints do not depend on what came before them in the log (their parent is explicit), so
puts append with ``expected_n=None``: concurrent runs on one thread never conflict or retry.
Reads fold the log incrementally (per event loop, a bounded cache of threads): `get_tuple` of a
thread already seen costs one read of the entries appended since. `list` walks a thread's
checkpoints newest first (checkpoint ids are time-ordered), with ``filter`` (metadata equality),
``before`` and ``limit``. `copy_thread` and `fork` are branches of the session (O(1): the copy
shares the source's entries); time travel in place (invoking from a past checkpoint id) just
appends checkpoints whose parent is the past one.

Sync methods run on a private event loop thread; async ones on the caller's loop (a store per
loop, see `_loops`). Needs the ``langgraph`` extra.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import hashlib
import random
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, cast

import anyio
import msgspec
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    PendingWrite,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from ..errors import (
    InvalidSessionIdError,
    SessionAlreadyExistsError,
    SessionError,
    SessionNotFoundError,
    SessionReplacedError,
)
from ..keys import validate_session_id
from ..model import Entry, NewEntry, SessionHead, SessionHeader
from ..store import SessionStore
from ._log import resolve_store
from ._loops import LoopStores, run_sync

CHECKPOINT = "langgraph/checkpoint"
WRITE = "langgraph/write"
BLOB = "langgraph/blob"
PART = "langgraph/part"
#: A prune or a delete_for_runs: ``{"keep": {ns: checkpoint id}}`` (every other checkpoint of
#: those namespaces, as of this entry, is gone) or ``{"runs": [run id...]}`` (every checkpoint,
#: as of this entry, whose metadata names one of those runs is gone), with their pending writes.
DROP = "langgraph/drop"
THREAD_PREFIX = "langgraph:"
#: Threads whose fold a saver keeps per event loop (least recently used ones are dropped).
CACHE_THREADS = 1024
#: How many later lives of a thread `RedisEventSaver._resolve` looks at in one round trip.
_LIFE_WINDOW = 1

__all__ = ["BLOB", "CHECKPOINT", "DROP", "PART", "THREAD_PREFIX", "WRITE", "RedisEventSaver"]

_Blob = tuple[str, str]  # (serializer type, base64 data)
_Write = tuple[str, str, str, str, str]  # (task id, channel, type, base64 data, task path)


_MISSING = object()


def _json_copy(value: Any) -> Any:
    """A deep copy of `value` through JSON when that is lossless, else `_MISSING`. (A copy: the
    checkpoint's dicts are LangGraph's live ones, changed after `put` returns.)"""
    try:
        copy = msgspec.json.decode(msgspec.json.encode(value))
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError, RecursionError):
        return _MISSING
    return copy if copy == value else _MISSING


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


class _Thread:
    """One thread's log, folded: checkpoints per namespace (ids sorted), blobs, pending writes."""

    __slots__ = ("blobs", "cps", "ids", "incarnation", "lock", "n", "partial", "pos", "sid", "writes")

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.reset()

    def reset(self, sid: str | None = None) -> None:
        self.n = 0
        self.sid = sid  # the session id of the thread's current life (`RedisEventSaver._resolve`)
        self.incarnation: str | None = None  # the life of the thread's session this fold is of
        self.cps: dict[str, dict[str, dict[str, Any]]] = {}
        self.ids: dict[str, list[str]] = {}
        self.pos: dict[tuple[str, str], int] = {}  # (ns, checkpoint id) -> n of its entry
        self.blobs: dict[tuple[str, str, Any], _Blob] = {}
        self.writes: dict[tuple[str, str], dict[tuple[str, int], _Write]] = {}
        self.partial: tuple[str, dict[str, Any], int, list[str]] | None = None

    def fold(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            if self.partial is not None:
                kind, data, left, chunks = self.partial
                if e.type == PART:
                    chunks.append(str(e.data.get("b", "")))
                    if left <= 1:
                        self.partial = None
                        self._apply(kind, {**data, "b": "".join(chunks)}, e.n)
                    else:
                        self.partial = (kind, data, left - 1, chunks)
                    continue
                self.partial = None  # torn (cannot happen within a batch): drop it
            parts = e.data.get("parts")
            if e.type in (BLOB, WRITE, CHECKPOINT) and isinstance(parts, int) and parts > 0:
                self.partial = (e.type, e.data, parts, [str(e.data.get("b", ""))])
                continue
            self._apply(e.type, e.data, e.n)
        if entries:
            self.n = entries[-1].n + 1

    def _apply(self, kind: str, d: dict[str, Any], n: int) -> None:
        if kind == CHECKPOINT:
            if "packed" in d:  # a checkpoint too big for one entry: its JSON, base64, in parts
                d = msgspec.json.decode(base64.b64decode(d["b"]))
            ns, cid = d["ns"], d["id"]
            cps = self.cps.setdefault(ns, {})
            if cid not in cps:
                bisect.insort(self.ids.setdefault(ns, []), cid)
            cps[cid] = d
            self.pos[(ns, cid)] = n
            for ch, (ver, t, b) in (d.get("blobs") or {}).items():
                self.blobs[(ns, ch, ver)] = (t, b)
        elif kind == BLOB:
            self.blobs[(d["ns"], d["ch"], d["v"])] = (d["t"], d["b"])
        elif kind == DROP:
            keep = d.get("keep")
            if isinstance(keep, dict):
                for ns, cid in keep.items():
                    for other in [c for c in self.ids.get(ns, []) if c != cid]:
                        self._forget(ns, other)
            runs = d.get("runs")
            if isinstance(runs, list):
                wanted = set(runs)
                for ns, cps in list(self.cps.items()):
                    for cid in [c for c, cd in cps.items() if _run_id(cd) in wanted]:
                        self._forget(ns, cid)
        elif kind == WRITE:
            stored = self.writes.setdefault((d["ns"], d["cp"]), {})
            key = (d["task"], int(d["idx"]))
            if key[1] >= 0 and key in stored:
                return
            stored[key] = (d["task"], d["ch"], d["t"], d["b"], d.get("path", ""))

    def _forget(self, ns: str, cid: str) -> None:
        """Drop one checkpoint and its pending writes from the fold (its blobs stay: a later
        checkpoint may share a channel version)."""
        self.cps.get(ns, {}).pop(cid, None)
        ids = self.ids.get(ns)
        if ids is not None and cid in ids:
            ids.remove(cid)
        self.pos.pop((ns, cid), None)
        self.writes.pop((ns, cid), None)


class _SaverContext:
    """What `RedisEventSaver.from_conn_string` returns: a context manager, sync and async."""

    def __init__(self, saver: RedisEventSaver) -> None:
        self.saver = saver

    def __enter__(self) -> RedisEventSaver:
        return self.saver

    def __exit__(self, *exc: object) -> None:
        self.saver.close()

    async def __aenter__(self) -> RedisEventSaver:
        return self.saver

    async def __aexit__(self, *exc: object) -> None:
        await self.saver.aclose()


def _origin_thread(header: SessionHeader) -> str | None:
    origin = header.origin if isinstance(header.origin, dict) else {}
    thread = origin.get("thread_id")
    return thread if isinstance(thread, str) else None


def _run_id(d: dict[str, Any]) -> Any:
    """The run id in a stored checkpoint's metadata (None when it has none, or the metadata is
    not JSON: LangGraph's own metadata always is)."""
    metadata = d.get("metadata")
    return metadata.get("run_id") if isinstance(metadata, dict) else None


class _Ctx:
    """What a saver keeps on one event loop: its store and the threads it has folded."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.threads: OrderedDict[str, _Thread] = OrderedDict()

    def thread(self, sid: str) -> _Thread:
        th = self.threads.get(sid)
        if th is None:
            th = self.threads[sid] = _Thread()
            while len(self.threads) > CACHE_THREADS:
                self.threads.popitem(last=False)
        else:
            self.threads.move_to_end(sid)
        return th


class RedisEventSaver(BaseCheckpointSaver[str]):
    """LangGraph checkpoints on a redis-session store (see the module docstring).

    `store` is a `SessionStore` or a `Sessions` service. `thread_prefix` starts every thread's
    session id; `ttl_ms` makes every new thread ephemeral (all its keys expire `ttl_ms` after its
    last write); `serde` is LangGraph's serializer (its default when None).
    """

    def __init__(
        self,
        store: Any,
        *,
        thread_prefix: str = THREAD_PREFIX,
        ttl_ms: int | None = None,
        serde: SerializerProtocol | None = None,
    ) -> None:
        super().__init__(serde=serde)
        self._owns_store = False
        self._closed = False
        self._stores = LoopStores(resolve_store(store))
        self.thread_prefix = thread_prefix
        validate_session_id(thread_prefix + "x")
        self.ttl_ms = ttl_ms
        self._ctxs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Ctx] = weakref.WeakKeyDictionary()
        vocabulary = self._stores.store.vocabulary
        for t in (CHECKPOINT, WRITE, BLOB, PART, DROP):
            if t not in vocabulary:
                vocabulary.define(t, None)
        self._max_bytes = self._stores.store.max_entry_bytes

    @property
    def store(self) -> SessionStore:
        return self._stores.store

    @classmethod
    def from_conn_string(
        cls,
        conn_string: str | None = None,
        *,
        prefix: str = "rs",
        cluster: bool | None = None,
        thread_prefix: str = THREAD_PREFIX,
        ttl_ms: int | None = None,
        serde: SerializerProtocol | None = None,
    ) -> _SaverContext:
        """A saver on its own store for `conn_string` (a Redis URL; None: ``$REDIS_URL``, else
        the embedded server), as every LangGraph saver offers it: ``with
        RedisEventSaver.from_conn_string(url) as saver:`` or ``async with …``; leaving closes
        the store's connections."""
        from ..redis.connect import open_store

        store = open_store(conn_string, prefix=prefix, cluster=cluster, announce=None)
        saver = cls(store, thread_prefix=thread_prefix, ttl_ms=ttl_ms, serde=serde)
        saver._owns_store = True
        return _SaverContext(saver)

    async def aclose(self) -> None:
        """Close the store when this saver opened it (`from_conn_string`; a store given to the
        constructor is the caller's): the connections it holds on the running event loop and on
        the sync methods' private loop. The saver is closed then: a later call raises
        `SessionError`."""
        if self._owns_store:
            self._closed = True
            await self._stores.aclose()
            if self._stores.loops():
                await anyio.to_thread.run_sync(lambda: run_sync(self._stores.aclose))

    def close(self) -> None:
        """`aclose`, blocking (what leaving a sync ``with`` block calls)."""
        if self._owns_store:
            self._closed = True
            run_sync(self._stores.aclose)

    # ------------------------------------------------------------------ plumbing

    def session_id(self, thread_id: str) -> str:
        """The session id of a thread (a hash when the thread id cannot be a session id)."""
        sid = f"{self.thread_prefix}{thread_id}"
        try:
            return validate_session_id(sid)
        except InvalidSessionIdError:
            digest = hashlib.sha256(str(thread_id).encode("utf-8", "surrogatepass")).hexdigest()
            return f"{self.thread_prefix}~{digest}"

    def _life_id(self, thread_id: str, life: int) -> str:
        """The session id of a thread's `life` (0: `session_id`; a later life, after a delete that
        only hid the thread's session because branches still read it: a hash of the thread id
        and the life's number)."""
        if life == 0:
            return self.session_id(thread_id)
        digest = hashlib.sha256(str(thread_id).encode("utf-8", "surrogatepass")).hexdigest()
        return f"{self.thread_prefix}~{digest}~{life}"

    def _header(self, sid: str, thread_id: str, **fields: Any) -> SessionHeader:
        return SessionHeader(id=sid, origin={"adapter": "langgraph", "thread_id": thread_id}, **fields)

    async def _resolve(self, store: SessionStore, thread_id: str) -> tuple[str, SessionHead | None]:
        """The session id of the thread's current life, and its head (None: the thread does not
        exist now, and its next write creates that id).

        `delete_thread` of a thread that has branches (`copy_thread`, `fork`) only hides its
        session: the branches read its entries, and the id stays taken until they are gone. The
        thread then goes on in a new session (`_life_id` 1, 2…), as InMemorySaver starts a new
        thread: the current life is the visible one, else the one after the last hidden one."""
        base = self.session_id(thread_id)
        head = await store.head(base)
        if head is not None:
            return base, head
        first = 0
        while first < 10_000:
            ids = [self._life_id(thread_id, k) for k in range(first, first + _LIFE_WINDOW + 1)]
            heads: list[SessionHead | None] = [None] * len(ids)
            hidden = [False] * len(ids)

            async with anyio.create_task_group() as tg:
                for i, sid in enumerate(ids):
                    tg.start_soon(self._probe, store, sid, head if sid == base else _MISSING, heads, hidden, i)
            for i in reversed(range(len(ids))):
                h = heads[i]
                if h is not None and (ids[i] == base or _origin_thread(h.header) == thread_id):
                    return ids[i], h  # a visible life is the latest (a hidden one never comes back)
            last = max((i for i in range(len(ids)) if hidden[i]), default=-1)
            if last < len(ids) - 1:
                return ids[last + 1], None
            first += len(ids)
        raise SessionError(f"thread {thread_id!r}: too many lives")

    @staticmethod
    async def _probe(
        store: SessionStore, sid: str, known: Any, heads: list[SessionHead | None], hidden: list[bool], i: int
    ) -> None:
        """One id of `_resolve`'s window: its head, and when it has none whether it is hidden (a
        deleted session kept for its branches: it still has links)."""
        heads[i] = h = await store.head(sid) if known is _MISSING else known
        if h is None:
            live, stale = await store.links(sid)
            hidden[i] = bool(live or stale)

    def _ctx(self) -> _Ctx:
        if self._closed:
            raise SessionError("this RedisEventSaver is closed (its from_conn_string block has ended)")
        loop = asyncio.get_running_loop()
        ctx = self._ctxs.get(loop)
        if ctx is None:
            ctx = self._ctxs[loop] = _Ctx(self._stores.get())
        return ctx

    async def _caught_up(self, thread_id: str) -> tuple[_Thread, str, _Ctx]:
        ctx = self._ctx()
        th = ctx.thread(self.session_id(str(thread_id)))
        async with th.lock:
            # The fold is of one life of the thread's session: read against its incarnation, and a
            # thread deleted and written again (whatever its length now) is folded afresh.
            for _ in range(5):
                if th.incarnation is None:
                    sid, head = await self._resolve(ctx.store, str(thread_id))
                    if head is None:
                        th.reset(sid)
                        return th, sid, ctx
                    th.reset(sid)
                    th.incarnation = head.header.incarnation
                assert th.sid is not None
                try:
                    entries = await ctx.store.read(th.sid, th.n, incarnation=th.incarnation)
                except SessionNotFoundError:  # also SessionReplacedError: that life is over
                    th.reset()
                    continue
                th.fold(entries)
                return th, th.sid, ctx
            raise SessionReplacedError(self.session_id(str(thread_id)), "re-created during each of 5 reads")

    async def _append(
        self, thread_id: str, entries: list[NewEntry], *, pinned: bool = False, key: str | None = None
    ) -> None:
        """Append at the end of the thread's log (creating it on its first write). The batch goes
        to the life our fold is of when there is one (then it is folded without a read); a
        thread deleted and written again since takes it in its new life, unfolded — unless
        `pinned` (a drop computed from our fold): then `SessionReplacedError`, nothing written,
        and a missing thread takes nothing. `key` is the batch's idempotency key: a retry of a
        write whose reply was lost lands once."""
        ctx = self._ctx()
        th = ctx.threads.get(self.session_id(str(thread_id)))
        sid = th.sid if th is not None else None
        inc = th.incarnation if th is not None else None
        for _ in range(5):
            if sid is None:
                sid, _ = await self._resolve(ctx.store, str(thread_id))
                th, inc = None, None
            try:
                try:
                    stored = await ctx.store.put(sid, None, entries, idempotency_key=key, incarnation=inc)
                except SessionReplacedError:
                    if pinned:
                        raise
                    th = None
                    stored = await ctx.store.put(sid, None, entries, idempotency_key=key)
            except SessionReplacedError:
                raise
            except SessionNotFoundError:
                if pinned:
                    return
                # The thread's first write: an empty session, then the batch with its key (a
                # create takes no idempotency key, a put does).
                try:
                    await ctx.store.create(self._header(sid, str(thread_id)), ttl_ms=self.ttl_ms)
                except SessionAlreadyExistsError:
                    pass
                try:
                    await ctx.store.put(sid, None, entries, idempotency_key=key)
                except SessionNotFoundError:  # that id is hidden (deleted with branches): next life
                    sid = None
                    continue
                return
            if th is not None and th.incarnation == inc and stored and stored[0].n == th.n and not th.lock.locked():
                th.fold(stored)  # our own batch, next in line in the life we folded: no read needed
            return
        raise SessionReplacedError(self.session_id(str(thread_id)), "deleted during each of 5 writes")

    @staticmethod
    def _key(kind: str, thread_id: str, entries: Sequence[NewEntry]) -> str:
        """An idempotency key derived from the write itself (a retry of it is the same write)."""
        h = hashlib.sha256(kind.encode())
        h.update(str(thread_id).encode("utf-8", "surrogatepass"))
        for e in entries:
            h.update(b"\x00" + e.type.encode() + b"\x00")
            h.update(msgspec.json.encode(e.data))
        return f"lg:{h.hexdigest()}"

    def _payload(self, kind: str, head: dict[str, Any], b: str) -> list[NewEntry]:
        """`head` plus base64 data `b`, split into ``langgraph/part`` entries when too large."""
        size = max(1024, self._max_bytes // 2)
        if len(b) <= size:
            return [NewEntry(kind, {**head, "b": b})]
        chunks = [b[i : i + size] for i in range(0, len(b), size)]
        return [
            NewEntry(kind, {**head, "b": chunks[0], "parts": len(chunks) - 1}),
            *(NewEntry(PART, {"b": c}) for c in chunks[1:]),
        ]

    def _encode(self, name: str, value: Any) -> dict[str, Any]:
        copy = _json_copy(value)
        if copy is not _MISSING:
            return {name: copy}
        t, raw = self.serde.dumps_typed(value)
        return {f"{name}_t": [t, _b64(raw)]}

    def _decode(self, name: str, data: dict[str, Any], *, copy: bool = True) -> Any:
        """The value `_encode` stored; a fresh copy unless `copy` is False (LangGraph changes the
        checkpoints it loads in place, and the fold is shared by every read)."""
        if name in data:
            return msgspec.json.decode(msgspec.json.encode(data[name])) if copy else data[name]
        t, b = data[f"{name}_t"]
        return self.serde.loads_typed((t, base64.b64decode(b)))

    def _tuple(self, th: _Thread, thread_id: str, ns: str, cid: str) -> CheckpointTuple:
        d = th.cps[ns][cid]
        checkpoint = self._decode("checkpoint", d)
        values: dict[str, Any] = {}
        for ch, ver in (checkpoint.get("channel_versions") or {}).items():
            blob = th.blobs.get((ns, ch, ver))
            if blob is None or blob[0] == "empty":
                continue
            values[ch] = self.serde.loads_typed((blob[0], base64.b64decode(blob[1])))
        checkpoint["channel_values"] = values
        parent = d.get("parent")
        return CheckpointTuple(
            config={"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid}},
            checkpoint=cast(Checkpoint, checkpoint),
            metadata=cast(CheckpointMetadata, self._decode("metadata", d)),
            parent_config=(
                {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": parent}}
                if parent
                else None
            ),
            pending_writes=self._pending(th, ns, cid),
        )

    def _pending(self, th: _Thread, ns: str, cid: str) -> list[PendingWrite]:
        stored = th.writes.get((ns, cid), {})
        ordered = sorted(stored.items(), key=lambda kv: writes_sort_key(kv[1][4], kv[0][0], kv[0][1]))
        return [(w[0], w[1], self.serde.loads_typed((w[2], base64.b64decode(w[3])))) for _, w in ordered]

    # ------------------------------------------------------------------ async API

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        ns = conf.get("checkpoint_ns", "")
        th, _, _ = await self._caught_up(thread_id)
        cid = get_checkpoint_id(config)
        if cid is None:
            ids = th.ids.get(ns)
            if not ids:
                return None
            cid = ids[-1]
        elif cid not in th.cps.get(ns, {}):
            return None
        return self._tuple(th, thread_id, ns, cid)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        if config is not None:
            thread_ids = [str(config["configurable"]["thread_id"])]
            want_ns = config["configurable"].get("checkpoint_ns")
            want_id = get_checkpoint_id(config)
        else:
            thread_ids = await self._thread_ids()
            want_ns = want_id = None
        before_id = get_checkpoint_id(before) if before else None
        for thread_id in thread_ids:
            th, _, _ = await self._caught_up(thread_id)
            found = [(cid, ns) for ns, ids in th.ids.items() if want_ns is None or ns == want_ns for cid in ids]
            found.sort(reverse=True)
            for cid, ns in found:
                if want_id and cid != want_id:
                    continue
                if before_id and cid >= before_id:
                    continue
                if filter:
                    metadata = self._decode("metadata", th.cps[ns][cid], copy=False)
                    if not all(metadata.get(k) == v for k, v in filter.items()):
                        continue
                if limit is not None:
                    if limit <= 0:
                        return
                    limit -= 1
                yield self._tuple(th, thread_id, ns, cid)

    async def _thread_ids(self) -> list[str]:
        """Every thread of this saver in the store (for ``list(None)``)."""
        store = self._ctx().store
        out: list[str] = []
        cursor: str | None = None
        while True:
            page = await store.list(limit=1000, cursor=cursor)
            for h in page.items:
                origin = h.origin if isinstance(h.origin, dict) else {}
                if h.id.startswith(self.thread_prefix) and origin.get("adapter") == "langgraph":
                    out.append(str(origin.get("thread_id", h.id[len(self.thread_prefix) :])))
            cursor = page.cursor
            if cursor is None:
                return out

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        ns = conf.get("checkpoint_ns", "")
        body: dict[str, Any] = dict(checkpoint)
        values: dict[str, Any] = body.pop("channel_values", None) or {}
        budget = self._max_bytes // 2
        inline: dict[str, list[Any]] = {}
        extra: list[NewEntry] = []
        for ch, ver in new_versions.items():
            t, raw = self.serde.dumps_typed(values[ch]) if ch in values else ("empty", b"")
            b = _b64(raw)
            if len(b) <= budget:
                inline[ch] = [ver, t, b]
                budget -= len(b) + len(ch) + 64
            else:
                extra.extend(self._payload(BLOB, {"ns": ns, "ch": ch, "v": ver, "t": t}, b))
        data = {
            "ns": ns,
            "id": checkpoint["id"],
            "parent": conf.get("checkpoint_id"),
            **self._encode("checkpoint", body),
            **self._encode("metadata", get_checkpoint_metadata(config, metadata)),
            "blobs": inline,
        }
        if len(msgspec.json.encode(data)) > self._max_bytes - 4096:  # big metadata (or checkpoint)
            packed = {"ns": ns, "id": checkpoint["id"], "packed": 1}
            extra.extend(self._payload(CHECKPOINT, packed, _b64(msgspec.json.encode(data))))
            batch = extra
        else:
            batch = [*extra, NewEntry(CHECKPOINT, data)]
        await self._append(thread_id, batch, key=self._key("put", thread_id, batch))
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        head = {"ns": conf.get("checkpoint_ns", ""), "cp": conf["checkpoint_id"], "task": task_id, "path": task_path}
        entries: list[NewEntry] = []
        for idx, (ch, value) in enumerate(writes):
            t, raw = self.serde.dumps_typed(value)
            entries.extend(
                self._payload(WRITE, {**head, "idx": WRITES_IDX_MAP.get(ch, idx), "ch": ch, "t": t}, _b64(raw))
            )
        if entries:
            await self._append(thread_id, entries, key=self._key("writes", thread_id, entries))

    async def adelete_thread(self, thread_id: str) -> None:
        """Delete the thread's session (the store's delete: hidden at once; a copy or fork made
        from it keeps what it shares)."""
        ctx = self._ctx()
        sid, head = await self._resolve(ctx.store, str(thread_id))
        if head is not None:
            await ctx.store.delete(sid)
        base = self.session_id(str(thread_id))
        for c in list(self._ctxs.values()):
            c.threads.pop(base, None)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """LangGraph's prune. ``"keep_latest"`` appends one ``langgraph/drop`` entry per thread
        naming the latest checkpoint of each namespace: every earlier one (and its pending writes)
        is gone for every reader from that entry on, atomically, with no rewrite (the log's
        entries stay stored until the thread is deleted or expires). ``"delete"`` deletes the
        threads. A thread that does not exist is skipped."""
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"unknown prune strategy {strategy!r} (keep_latest or delete)")
        for thread_id in thread_ids:
            if strategy == "delete":
                await self.adelete_thread(str(thread_id))
                continue
            for _ in range(5):  # a drop names checkpoints of one life: computed again on another
                th, _, _ = await self._caught_up(str(thread_id))
                keep = {ns: ids[-1] for ns, ids in th.ids.items() if len(ids) > 1}
                try:
                    if keep:
                        await self._append(str(thread_id), [NewEntry(DROP, {"keep": keep})], pinned=True)
                    break
                except SessionReplacedError:
                    continue

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their pending writes) of these runs (``metadata["run_id"]``)
        in every thread of this saver: a ``langgraph/drop`` entry in each thread that holds one.
        Walks every thread (``list(None)``'s cost)."""
        wanted = [str(r) for r in run_ids]
        if not wanted:
            return
        wanted_set = set(wanted)
        for thread_id in await self._thread_ids():
            for _ in range(5):
                th, _, _ = await self._caught_up(thread_id)
                try:
                    if any(_run_id(d) in wanted_set for cps in th.cps.values() for d in cps.values()):
                        await self._append(thread_id, [NewEntry(DROP, {"runs": wanted})], pinned=True)
                    break
                except SessionReplacedError:
                    continue

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """The target becomes a branch of the source at its current end: O(1), whatever the
        source's length (the branch shares the source's entries). Nothing happens for a source
        that does not exist; a target that exists already raises `SessionAlreadyExistsError`."""
        store = self._ctx().store
        src, head = await self._resolve(store, str(source_thread_id))
        if head is None:
            return
        await self._branch(store, src, head.n, str(target_thread_id))

    async def _branch(self, store: SessionStore, src: str, at: int, target_thread_id: str) -> None:
        target, head = await self._resolve(store, target_thread_id)
        if head is not None:
            raise SessionAlreadyExistsError(target)
        await store.create(self._header(target, target_thread_id, parent=src, at=at), ttl_ms=self.ttl_ms)
        base = self.session_id(target_thread_id)
        for c in list(self._ctxs.values()):
            c.threads.pop(base, None)

    async def afork(self, config: RunnableConfig, target_thread_id: str) -> RunnableConfig:
        """A new thread whose history ends at the checkpoint `config` names (its latest when no
        checkpoint id): an O(1) branch of the session just after that checkpoint's entry. Invoke
        the graph with the returned config to go on from there; the source thread is untouched."""
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        ns = conf.get("checkpoint_ns", "")
        th, sid, ctx = await self._caught_up(thread_id)
        ids = th.ids.get(ns)
        cid = get_checkpoint_id(config) or (ids[-1] if ids else None)
        if cid is None or (ns, cid) not in th.pos:
            raise ValueError(f"no checkpoint {cid!r} in thread {thread_id!r} (namespace {ns!r})")
        await self._branch(ctx.store, sid, th.pos[(ns, cid)] + 1, str(target_thread_id))
        return {"configurable": {"thread_id": str(target_thread_id), "checkpoint_ns": ns, "checkpoint_id": cid}}

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """The parent-chain walk of `BaseCheckpointSaver`, on one read of the log."""
        if not channels:
            return {}
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        ns = conf.get("checkpoint_ns", "")
        th, _, _ = await self._caught_up(thread_id)
        cps = th.cps.get(ns, {})
        cid = get_checkpoint_id(config) or (th.ids.get(ns) or [""])[-1]
        target = cps.get(cid)
        collected: dict[str, list[PendingWrite]] = {c: [] for c in channels}
        seed: dict[str, Any] = {}
        remaining = set(channels)
        current = target.get("parent") if target is not None else None
        while current is not None and remaining and current in cps:
            d = cps[current]
            versions = (self._decode("checkpoint", d, copy=False).get("channel_versions")) or {}
            found: dict[str, Any] = {}
            for ch in remaining:
                ver = versions.get(ch)
                blob = th.blobs.get((ns, ch, ver)) if ver is not None else None
                if blob is not None and blob[0] != "empty":
                    found[ch] = self.serde.loads_typed((blob[0], base64.b64decode(blob[1])))
            for w in reversed(self._pending(th, ns, current)):
                if w[1] in remaining:
                    collected[w[1]].append(w)
            for ch, value in found.items():
                seed[ch] = value
                remaining.discard(ch)
            current = d.get("parent")
        out: dict[str, DeltaChannelHistory] = {}
        for ch in channels:
            entry: DeltaChannelHistory = {"writes": list(reversed(collected[ch]))}
            if ch in seed:
                entry["seed"] = seed[ch]
            out[ch] = entry
        return out

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Versions as LangGraph's own savers make them: a zero-padded counter, then a random
        tie-breaker (so two forks of one checkpoint never share a version)."""
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(current.split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"

    # ------------------------------------------------------------------ sync API (private loop)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return run_sync(lambda: self.aget_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        async def collect() -> list[CheckpointTuple]:
            return [t async for t in self.alist(config, filter=filter, before=before, limit=limit)]

        yield from run_sync(collect)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return run_sync(lambda: self.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        run_sync(lambda: self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        run_sync(lambda: self.adelete_thread(thread_id))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        run_sync(lambda: self.acopy_thread(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        run_sync(lambda: self.aprune(thread_ids, strategy=strategy))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        run_sync(lambda: self.adelete_for_runs(run_ids))

    def fork(self, config: RunnableConfig, target_thread_id: str) -> RunnableConfig:
        """Sync `afork`."""
        return run_sync(lambda: self.afork(config, target_thread_id))

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return run_sync(lambda: self.aget_delta_channel_history(config=config, channels=channels))
