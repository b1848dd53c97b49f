"""The streaming writer: one streamed answer, live for readers and packed into the log
(docs/design.md §8.2).

>>> async with s.stream(turn=1, step=1) as w:      # `Session.stream`
...     async for piece in model_stream:
...         await w.delta(piece)
>>> # on exit: the remaining chunk rows and the assistant/message, in one append

Each delta goes two ways:

- **live**: a record on the session's ``live`` stream (a plain ``XADD``, no script), sent by a
  background task that pipelines whatever is queued, so `delta` never waits for Redis;
- **durable**: buffered and appended as packed ``assistant/chunk`` rows (`chunk_row`) every
  `flush_interval` seconds or `max_chunks` deltas, whichever comes first, with
  ``expected_n=None`` (a chunk depends on nothing; the handle's write lock orders them).

A clean exit appends the last chunk rows and the ``assistant/message`` (content assembled from the
deltas, ``meta.answer`` = the answer id) in one batch with the handle's n as ``expected_n``, then
closes the answer on the live stream (an ``end`` record naming the message's n; older records are
trimmed and the stream expires after `grace`). An error or a cancellation instead appends the last
rows and an ``assistant/interrupted`` mark carrying what was streamed (the turn itself is left to
the caller: dsh closes it ``aborted`` or ``error``), then closes the live answer as interrupted.
A writer that dies without either leaves an open answer; its live records expire (`live_ttl`) and
`Sessions.repair` closes it from what the live stream and the log still hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Protocol

import anyio

from .errors import SessionConflictError, StoreUnavailableError
from .model import Entry, NewEntry, NewEntryLike
from .projection.chunks import (
    CHUNK,
    INTERRUPTED,
    REASONING,
    TEXT,
    TOOL_CALL,
    Delta,
    LiveRecord,
    answers_to_skip,
    assemble,
    chunk_row,
    delta_chunk,
    new_answer_id,
    open_answers,
    replay,
)
from .store.memory import SessionStore

log = logging.getLogger(__name__)

DEFAULT_FLUSH_INTERVAL = 0.1
DEFAULT_MAX_CHUNKS = 64
DEFAULT_LIVE_TTL = 60.0
DEFAULT_GRACE = 30.0
# the live stream's expiry is pushed forward at most this often (a PEXPIRE with the records)
_EXPIRE_EVERY = 1.0


class _Write(Protocol):
    def __call__(
        self, items: Iterable[NewEntryLike], *, expected: bool = True, idempotency_key: str | None = None
    ) -> Awaitable[list[Entry]]: ...


class AnswerStream:
    """One streamed answer (``async with s.stream(turn=, step=) as w``); see the module docs.

    `answer` is its id: the live records, the chunk rows (``data.answer``) and the closing entry
    (``meta.answer``) all carry it. After a clean exit `message` holds the stored
    ``assistant/message``; after an error or cancellation, `interrupted` holds the mark."""

    def __init__(
        self,
        store: SessionStore,
        session_id: str,
        *,
        write: _Write,
        position: Callable[[], int],
        incarnation: str | None,
        turn: int | None,
        step: int | None,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        live_ttl: float = DEFAULT_LIVE_TTL,
        grace: float = DEFAULT_GRACE,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if not flush_interval > 0 or max_chunks < 1 or not live_ttl > 0 or not grace > 0:
            raise ValueError("flush_interval, live_ttl and grace must be > 0, max_chunks >= 1")
        self.store = store
        self.session_id = session_id
        self.answer = new_answer_id()
        self.turn, self.step = turn, step
        self.flush_interval, self.max_chunks = flush_interval, max_chunks
        self.live_ttl_ms, self.grace_ms = round(live_ttl * 1000), round(grace * 1000)
        self.usage: dict[str, Any] | None = None
        self.message: Entry | None = None
        self.interrupted: Entry | None = None
        self._write, self._position, self._incarnation = write, position, incarnation
        self._meta = dict(meta or {})
        self._chunks: list[dict[str, Any]] = []  # every delta's dsh chunk, in order
        self._flushed = 0  # chunks [0, _flushed) are in the log
        self._outbox: list[LiveRecord] = []
        self._send_wake = anyio.Event()
        self._have_chunks = anyio.Event()
        self._full = anyio.Event()
        self._expired_at = 0.0
        self._begin_id: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # ------------------------------------------------------------------ writing

    @property
    def count(self) -> int:
        """Deltas so far."""
        return len(self._chunks)

    @property
    def text(self) -> str:
        """The answer's text so far (text deltas only)."""
        return "".join(c["text"] for c in self._chunks if c["type"] == "text-delta")

    def content(self) -> list[dict[str, Any]]:
        """The answer so far as message content blocks (reasoning, text, tool calls)."""
        return assemble(self._chunks)

    async def delta(self, text: str) -> None:
        """A piece of the answer's text."""
        self._add(TEXT, text, None, None)

    async def reasoning(self, text: str) -> None:
        """A piece of the model's reasoning."""
        self._add(REASONING, text, None, None)

    async def tool_call_delta(self, call_id: str, name: str | None, args_delta: str) -> None:
        """A piece of a tool call's JSON arguments (`name` may be given on the first one only)."""
        if not isinstance(call_id, str) or not call_id:
            raise ValueError("call_id must be a non-empty str")
        self._add(TOOL_CALL, args_delta, call_id, name)

    def _add(self, kind: str, text: str, call_id: str | None, name: str | None) -> None:
        if not isinstance(text, str):
            raise TypeError(f"a delta is a str, got {type(text).__name__}")
        if self._closed or not self._tasks:
            raise RuntimeError("this answer stream is not open (use `async with s.stream(...)`)")
        index = len(self._chunks)
        self._chunks.append(delta_chunk(kind, text, call_id, name))
        self._outbox.append(
            LiveRecord(answer=self.answer, kind=kind, index=index, text=text, call_id=call_id, name=name)
        )
        self._send_wake.set()
        self._have_chunks.set()
        if len(self._chunks) - self._flushed >= self.max_chunks:
            self._full.set()

    # ------------------------------------------------------------------ live path

    def _expiry(self) -> int | None:
        now = anyio.current_time()
        if now - self._expired_at < _EXPIRE_EVERY:
            return None
        self._expired_at = now
        return self.live_ttl_ms

    async def _send_loop(self) -> None:
        while not self._closed:
            await self._send_wake.wait()
            self._send_wake = anyio.Event()
            if self._closed:
                return  # what is left goes out with the close
            await self._send_pending()

    async def _send_pending(self, *extra: LiveRecord, expire_ms: int | None = None, trim: bool = False) -> None:
        batch, self._outbox = [*self._outbox, *extra], []
        if not batch and expire_ms is None:
            return
        try:
            await self.store.live_add(
                self.session_id,
                batch,
                expire_ms=expire_ms if expire_ms is not None else self._expiry(),
                trim_before=self._begin_id if trim else None,
            )
        except Exception as e:  # readers miss these deltas live; the log still gets them
            log.warning("live deltas of %r (answer %s) were not sent: %s", self.session_id, self.answer, e)

    # ------------------------------------------------------------------ durable path

    def _rows(self, upto: int) -> list[NewEntry]:
        rows = []
        for lo in range(self._flushed, upto, self.max_chunks):
            hi = min(upto, lo + self.max_chunks)
            rows.append(chunk_row(self._chunks[lo:hi], turn=self.turn, step=self.step, answer=self.answer, seq=lo))
        return rows

    async def _flush_loop(self) -> None:
        while not self._closed:
            await self._have_chunks.wait()
            with anyio.move_on_after(self.flush_interval):
                await self._full.wait()
            if self._closed:
                return  # the last rows go with the closing entry
            self._have_chunks, self._full = anyio.Event(), anyio.Event()
            await self._flush()
            if len(self._chunks) > self._flushed:
                self._have_chunks.set()

    async def _flush(self) -> None:
        """Append the buffered chunks as rows (expected_n=None). A lost reply is checked against
        the log before the rows are sent again, so a chunk never lands twice."""
        upto = len(self._chunks)
        if upto <= self._flushed:
            return
        try:
            await self._write(self._rows(upto), expected=False)
        except StoreUnavailableError as e:
            log.warning("chunks of %r (answer %s) not flushed yet: %s", self.session_id, self.answer, e)
            with anyio.CancelScope(shield=True):
                self._flushed = await _landed(self.store, self.session_id, self.answer, self._flushed)
            return
        self._flushed = upto

    # ------------------------------------------------------------------ open and close

    async def __aenter__(self) -> AnswerStream:
        begin = begin_record(self.answer, self.turn, self.step, self._position(), self._incarnation)
        self._expired_at = anyio.current_time()
        try:
            ids = await self.store.live_add(self.session_id, [begin], expire_ms=self.live_ttl_ms)
            self._begin_id = ids[0] if ids else None
        except Exception as e:
            log.warning("the live stream of %r is unavailable: %s", self.session_id, e)
        # plain asyncio tasks, not a task group: the block's own cancellation must not cut a
        # write in flight short, and its exit must wait for them (see __aexit__)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send_loop()), loop.create_task(self._flush_loop())]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Stop both loops, letting a flush or a send in flight finish (a write is never cut
        # short: its outcome would be unknown), even while this task is being cancelled.
        self._closed = True
        self._send_wake.set()
        self._have_chunks.set()
        self._full.set()
        with anyio.CancelScope(shield=True):
            for result in await asyncio.gather(*self._tasks, return_exceptions=True):
                if isinstance(result, BaseException):
                    log.warning("answer %s of %r: a background write failed: %r", self.answer, self.session_id, result)
            # every delta is live before the entry that closes the answer lands
            await self._send_pending()
            if exc_type is None:
                await self._commit()
            else:
                reason = "cancelled" if exc is not None and _is_cancel(exc) else "error"
                try:
                    await self._interrupt(reason)
                except Exception:
                    log.exception("closing the interrupted answer %s of %r failed", self.answer, self.session_id)

    async def _commit(self) -> None:
        message = answer_message(self.answer, self.turn, self.step, self.content(), self.usage, self._meta)
        rows = self._rows(len(self._chunks))
        try:
            stored = await self._write([*rows, message])
        except SessionConflictError:
            # someone wrote since our last flush: keep the deltas, let the caller retry the message
            if rows:
                await self._write(rows, expected=False)
            self._flushed = len(self._chunks)
            await self._close_live(None, "conflict")
            raise
        except BaseException:
            await self._close_live(None, "interrupted")
            raise
        self._flushed = len(self._chunks)
        self.message = stored[-1]
        await self._close_live(self.message.n, "committed")

    async def _interrupt(self, reason: str) -> None:
        mark = interrupted_mark(
            self.answer, self.turn, self.step, reason, len(self._chunks), self.content(), self._meta
        )
        try:
            stored = await self._write([*self._rows(len(self._chunks)), mark], expected=False)
        except BaseException:
            await self._close_live(None, "interrupted")
            raise
        self._flushed = len(self._chunks)
        self.interrupted = stored[-1]
        await self._close_live(self.interrupted.n, "interrupted")

    async def _close_live(self, n: int | None, reason: str) -> None:
        end = end_record(self.answer, len(self._chunks), n, reason)
        await self._send_pending(end, expire_ms=self.grace_ms, trim=True)


def answer_message(
    answer: str,
    turn: int | None,
    step: int | None,
    content: Sequence[Any],
    usage: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> NewEntry:
    """The ``assistant/message`` that commits an answer: its content blocks (`assemble` of its
    deltas), ``meta.answer`` naming it (its chunk rows and live records carry the same id)."""
    data: dict[str, Any] = {}
    if turn is not None:
        data["turn"] = turn
    if step is not None:
        data["step"] = step
    data["content"] = list(content)
    if usage is not None:
        data["usage"] = usage
    return NewEntry("assistant/message", data, {**(meta or {}), "answer": answer})


def begin_record(answer: str, turn: int | None, step: int | None, n: int, incarnation: str | None) -> LiveRecord:
    """The live record that opens an answer: begun when the log was at `n`, in `incarnation`."""
    return LiveRecord(answer=answer, kind="begin", turn=turn, step=step, n=n, incarnation=incarnation)


def end_record(answer: str, deltas: int, n: int | None, reason: str) -> LiveRecord:
    """The live record that closes an answer of `deltas` deltas: `n` is the entry that closed it
    (its message or its interrupted mark; None when none landed), `reason` ``committed`` or
    ``interrupted`` (``conflict``: the message was refused)."""
    return LiveRecord(answer=answer, kind="end", index=deltas, n=n, reason=reason)


def interrupted_mark(
    answer: str,
    turn: int | None,
    step: int | None,
    reason: str,
    deltas: int,
    content: Sequence[Any],
    meta: dict[str, Any] | None = None,
) -> NewEntry:
    """The ``assistant/interrupted`` mark that closes an answer cut short: `reason` (cancelled,
    error, crashed), how many deltas it had and the content they make (the chunk rows before it
    hold every delta)."""
    data: dict[str, Any] = {}
    if turn is not None:
        data["turn"] = turn
    if step is not None:
        data["step"] = step
    data.update({"answer": answer, "reason": reason, "deltas": deltas, "content": list(content)})
    return NewEntry(INTERRUPTED, data, {**(meta or {}), "answer": answer})


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, anyio.get_cancelled_exc_class()) or isinstance(exc, KeyboardInterrupt)


async def _landed(store: SessionStore, session_id: str, answer: str, flushed: int, window: int = 64) -> int:
    """How many of `answer`'s chunks the log holds (after a lost reply): scans the last `window`
    entries; `flushed` when none is found there."""
    try:
        head = await store.head(session_id)
        if head is None:
            return flushed
        rows = await store.read(session_id, max(0, head.n - window), head.n)
    except Exception:
        return flushed
    best = flushed
    for e in rows:
        if e.type == CHUNK and e.data.get("answer") == answer:
            best = max(best, int(e.data.get("seq", 0)) + len(e.data.get("chunks") or ()))
    return best


def dead_answers(records: Sequence[LiveRecord], *, stale_ms: int, now_ms: int) -> list[str]:
    """Answers of a live backlog whose writer is gone: no end record, and no record for
    `stale_ms` (stream ids are the server's ms)."""
    last_seen: dict[str, int] = {}
    for r in records:
        last_seen[r.answer] = _id_ms(r.id)
    return [a for a in open_answers(records) if now_ms - last_seen.get(a, 0) >= stale_ms]


async def close_dead_answers(
    store: SessionStore,
    session_id: str,
    write: _Write,
    entries: Sequence[Entry],
    records: Sequence[LiveRecord],
    answers: Sequence[str],
) -> list[Entry]:
    """Close `answers` (see `dead_answers`): pack the deltas the log lacks (the live stream still
    has them) into chunk rows, append them with an ``assistant/interrupted`` mark (reason
    ``crashed``), and end the answer on the live stream. `entries` is the log, to find what was
    flushed already. Returns the entries appended."""
    opened = open_answers(records)
    logged = replay(entries)
    out: list[Entry] = []
    for answer in answers:
        begin, deltas = opened.get(answer, (None, []))
        turn = begin.turn if begin is not None else None
        step = begin.step if begin is not None else None
        have = logged.get(answer, [])
        chunks = list(have)
        for d in deltas:  # the live stream holds them from some index on (all unless capped)
            if d.index == len(chunks):
                chunks.append(d.chunk())
        size = DEFAULT_MAX_CHUNKS * 4
        rows = [
            chunk_row(chunks[lo : lo + size], turn=turn, step=step, answer=answer, seq=lo)
            for lo in range(len(have), len(chunks), size)
        ]
        mark = interrupted_mark(answer, turn, step, "crashed", len(chunks), assemble(chunks))
        stored = await write([*rows, mark], expected=False)
        out.extend(stored)
        end = end_record(answer, len(chunks), stored[-1].n, "interrupted")
        await store.live_add(session_id, [end], expire_ms=round(DEFAULT_GRACE * 1000))
    return out


async def tail_deltas(
    store: SessionStore,
    session_id: str,
    start: int = 0,
    *,
    incarnation: str | None = None,
    live_after: str | None = None,
) -> AsyncGenerator[Entry | Delta, None]:
    """Entries from `start` as `SessionStore.tail` gives them, and the deltas of streamed
    answers as they are streamed (one connection; `live.follow_deltas` survives drops).

    Without `live_after` (a fresh reader) the live stream is read from its start, so a reader
    that arrives mid-answer gets the answer so far, then the rest. With `live_after` (the cursor
    of the last delta delivered), delivery resumes right after it. Either way, answers the live
    stream shows closed before `start` (their entries are behind the reader) and answers begun by
    another incarnation are not sent. Each delta once, in order."""
    records = await store.read_live(session_id, live_after)
    skip = answers_to_skip(records, start, incarnation)
    for r in records:
        if r.is_delta and r.answer not in skip:
            yield r.delta()
    cursor = records[-1].id if records else (live_after or "0-0")
    async for item in store.tail_live(session_id, start, live_after=cursor, incarnation=incarnation):
        if not isinstance(item, LiveRecord):
            yield item
        elif item.is_delta:
            if item.answer not in skip:
                yield item.delta()
        elif item.kind == "begin" and incarnation and item.incarnation and item.incarnation != incarnation:
            skip.add(item.answer)


def _id_ms(rid: str) -> int:
    head = rid.partition("-")[0]
    return int(head) if head.isdigit() else 0


__all__ = [
    "AnswerStream",
    "answer_message",
    "begin_record",
    "close_dead_answers",
    "dead_answers",
    "end_record",
    "interrupted_mark",
    "tail_deltas",
]
