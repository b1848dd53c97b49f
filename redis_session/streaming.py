"""The streaming writer: one streamed answer, live for readers and packed into the log
(docs/design.md §8.2), through the one answer protocol (``lua/answer.lua``).

>>> async with s.stream(turn=1, step=1) as w:      # `Session.stream`
...     async for piece in model_stream:
...         await w.delta(piece)
>>> # on exit: the remaining chunk rows, the assistant/message and the live end, in one script

Every write of an answer goes through the store's answer ops (`answer_begin`, `answer_deltas`,
`answer_beat`, `answer_end`), which keep its rules server-side: the life it began in, the next
live and logged delta index (a batch elsewhere is refused, a retry of what landed is a no-op),
and an end refused while the log lacks a delta. The gateway's answer routes (and through them the
TypeScript client) use the same ops, so the rules cannot drift between writers.

Each delta goes two ways:

- **live**: a record on the session's ``live`` stream, plain XADDs (no script per delta). When no
  live send is in flight `delta` writes it to the server itself, at once, and leaves the reply
  to a background task; while one is, the delta is queued and that task sends whatever is
  queued in one pipelined write after the reply. So `delta` never waits for Redis, a record
  never waits for a task's next turn, and one send is in flight at a time (order holds); after
  a lost reply the task reads what landed before it sends the rest (each delta once);
- **durable**: buffered and appended as packed ``assistant/chunk`` rows every `flush_interval`
  seconds or `max_chunks` deltas, whichever comes first — but a row of fewer than half of
  `max_chunks` (32 at most) waits for more, up to 4 × `flush_interval` (a row costs the log
  ~120 B besides its deltas); a row that failed is retried with the same bounds, so it lands once.

While the answer is open its writer beats every `heartbeat` seconds when it has nothing to send,
so `Sessions.repair` can tell a quiet writer (a slow model, a long tool call) from a dead one. A
clean exit appends the last rows and the ``assistant/message`` (content assembled from the
deltas, ``meta.answer`` = the answer id), checked so that nobody else wrote since the answer's own
rows (else `SessionConflictError`, the rows kept), and ends the answer on the live stream. An
error or a cancellation instead appends the last rows and an ``assistant/interrupted`` mark
carrying what was streamed (the turn itself is left to the caller: dsh closes it ``aborted`` or
``error``). A `DurabilityError` on a row means it landed; on the close it is raised after the
message is stored (`message` is set).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio
import msgspec

from .checks import check_int, check_optional_int, check_seconds
from .errors import (
    AnswerAliveError,
    AnswerError,
    AnswerIncompleteError,
    AnswerOrderError,
    AnswerTooLargeError,
    DurabilityError,
    InvalidArgumentError,
    InvalidEntryError,
    SessionConflictError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from .model import Entry, NewEntry, encode_entry, lossless_json, now_ms
from .projection.chunks import (
    CHUNK,
    INTERRUPTED,
    REASONING,
    TEXT,
    TOOL_CALL,
    AnswerAck,
    AnswerEnded,
    Delta,
    DeltaGap,
    LiveRecord,
    answer_budget,
    answers_to_skip,
    assemble,
    chunk_row,
    delta_chunk,
    delta_cost,
    end_row,
    entry_answer,
    new_answer_id,
    open_answers,
    replay,
    row_end,
    row_ended,
)
from .shield import finish_then_cancel
from .store.memory import SessionStore

log = logging.getLogger(__name__)

DEFAULT_FLUSH_INTERVAL = 1.0
DEFAULT_MAX_CHUNKS = 64
MAX_CHUNKS = 10_000  # deltas per chunk row at most (a row is one entry: within the entry limit anyway)
# a row of fewer than min(_MIN_ROW, max_chunks // 2) deltas is held for more, up to _ROW_WAIT
# flush intervals after its first delta
_MIN_ROW = 32
_ROW_WAIT = 4
# a writer whose deltas outrun the log by this many rows waits for the rows to land (backpressure)
_BACKLOG_ROWS = 4
DEFAULT_LIVE_TTL = 60.0
DEFAULT_GRACE = 30.0
DEFAULT_HEARTBEAT = 5.0
# a store op that failed for want of the server is tried again this many times (each op is
# idempotent: the script skips what landed), then the error is raised
_RETRIES = 8

T = TypeVar("T")


async def _retrying(op: Callable[[], Awaitable[T]]) -> T:
    delay = 0.02
    for attempt in range(_RETRIES):
        try:
            return await op()
        except StoreUnavailableError:
            if attempt == _RETRIES - 1:
                raise
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)
    raise AssertionError("unreachable")


class AnswerStream:
    """One streamed answer (``async with s.stream(turn=, step=) as w``); see the module docs.

    `answer` is its id: the live records, the chunk rows (``data.answer``) and the closing entry
    (``meta.answer``) all carry it. After a clean exit `message` holds the stored
    ``assistant/message``; after an error or cancellation, `interrupted` holds the mark. Once the
    session is replaced (or the answer closed by `repair`), `delta` raises that error."""

    def __init__(
        self,
        store: SessionStore,
        session_id: str,
        *,
        position: Callable[[], int],
        advance: Callable[[Sequence[Entry]], Awaitable[None]] | None = None,
        incarnation: str | None,
        turn: int | None,
        step: int | None,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        live_ttl: float = DEFAULT_LIVE_TTL,
        grace: float = DEFAULT_GRACE,
        heartbeat: float = DEFAULT_HEARTBEAT,
        meta: dict[str, Any] | None = None,
    ) -> None:
        # every argument checked before anything is written (a bad one raised from Redis, or from
        # the begin's own entry, after the answer's live records were written)
        check_optional_int(turn, "turn")
        check_optional_int(step, "step")
        for value, what in ((flush_interval, "flush_interval"), (live_ttl, "live_ttl"), (grace, "grace")):
            check_seconds(value, what)
        check_seconds(heartbeat, "heartbeat")
        check_int(max_chunks, "max_chunks", minimum=1, maximum=MAX_CHUNKS)
        if meta is not None:
            try:
                encoded = lossless_json(meta, "meta")
            except InvalidEntryError as e:
                raise InvalidArgumentError(f"the answer's {e}") from None
            if not encoded.startswith(b"{"):
                raise InvalidArgumentError(f"meta must be a JSON object, got {type(meta).__name__}")
        self.store = store
        self.session_id = session_id
        self.answer = new_answer_id()
        self.turn, self.step = turn, step
        self.flush_interval, self.max_chunks = flush_interval, max_chunks
        self.live_ttl_ms, self.grace_ms = round(live_ttl * 1000), round(grace * 1000)
        self.heartbeat = heartbeat
        self.usage: dict[str, Any] | None = None
        self.message: Entry | None = None
        self.interrupted: Entry | None = None
        self.begin_id: str | None = None
        self._position, self._advance, self._incarnation = position, advance, incarnation
        self._meta = dict(meta or {})
        self._deltas: list[Delta] = []  # every delta, in order (index = position)
        self._cost = 0  # their content cost (`delta_cost`): within `answer_budget`
        self._flushed = 0  # deltas [0, _flushed) are in the log
        self._live = 0  # deltas [0, _live) are on the live stream
        self._row: tuple[int, int] | None = None  # a row sent but not acknowledged: resent as it is
        self._rewound = False  # the log lost rows that had landed (a failover): the handle's n is off
        self._send_wake = anyio.Event()
        self._have_chunks = anyio.Event()
        self._full = anyio.Event()
        # a row of fewer deltas than this waits for more, up to _ROW_WAIT flush intervals
        self._min_row = max(1, min(_MIN_ROW, max_chunks // 2))
        self._enough = anyio.Event()
        self._wrote_at = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._broken: BaseException | None = None  # the session was replaced, the answer closed
        self._failed: InvalidEntryError | None = None  # a chunk row the store refused
        self._durability: DurabilityError | None = None
        self._live_unsure = False  # a live send's reply was lost: read what landed first
        self._live_id: str | None = None  # the live id of our last delta that landed
        # the one live send in flight: True from its write until its replies are read
        self._sending = False
        # a batch `delta` wrote itself: (read its replies, the live count once they are read)
        self._inflight: tuple[Callable[[], Awaitable[list[str]]], int] | None = None
        self._send_now_to = getattr(store, "answer_live_send", None)  # None: the task sends all
        self._expired_at = 0.0

    # ------------------------------------------------------------------ writing

    @property
    def count(self) -> int:
        """Deltas so far."""
        return len(self._deltas)

    @property
    def text(self) -> str:
        """The answer's text so far (text deltas only)."""
        return "".join(d.text for d in self._deltas if d.kind == TEXT)

    def content(self) -> list[dict[str, Any]]:
        """The answer so far as message content blocks (reasoning, text, tool calls)."""
        return assemble(d.chunk() for d in self._deltas)

    async def delta(self, text: str) -> None:
        """A piece of the answer's text."""
        self._add(TEXT, text, None, None)
        await self._pace()

    async def reasoning(self, text: str) -> None:
        """A piece of the model's reasoning."""
        self._add(REASONING, text, None, None)
        await self._pace()

    async def tool_call_delta(self, call_id: str, name: str | None, args_delta: str) -> None:
        """A piece of a tool call's JSON arguments (`name` may be given on the first one only)."""
        if not isinstance(call_id, str) or not call_id:
            raise ValueError("call_id must be a non-empty str")
        self._add(TOOL_CALL, args_delta, call_id, name)
        await self._pace()

    async def _pace(self) -> None:
        """After a delta: send it now if no send is in flight; else give the event loop a turn, so
        the sender and the rows' flusher run even under a caller that never waits for anything
        else (a model's tokens from memory); and while the log trails by `_BACKLOG_ROWS` rows,
        hold the caller until rows land (a dead or slow server must not let the answer pile up
        in memory, nor into one closing row over the entry limit)."""
        if not await self._send_now():
            await anyio.lowlevel.checkpoint()
        limit = _BACKLOG_ROWS * self.max_chunks
        while (
            len(self._deltas) - self._flushed >= limit
            and self._broken is None and self._failed is None and not self._closed
        ):  # fmt: skip
            self._full.set()
            await anyio.sleep(min(0.05, self.flush_interval))

    def _add(self, kind: str, text: str, call_id: str | None, name: str | None) -> None:
        if not isinstance(text, str):
            raise TypeError(f"a delta is a str, got {type(text).__name__}")
        if self._broken is not None:
            raise self._broken
        if self._failed is not None:
            raise self._failed
        if self._closed or not self._tasks:
            raise RuntimeError("this answer stream is not open (use `async with s.stream(...)`)")
        delta_chunk(kind, text, call_id, name)  # validates the kind
        # refused here, to the caller, before anything is queued: a delta no row could carry (a
        # lone surrogate) would otherwise fail in the background, and one that takes the answer
        # over what its closing message can hold (the protocol's size rule, `answer_budget`)
        # would be refused with its row: the writer learns it now and can end with what it has
        try:
            cost = delta_cost(kind, text, call_id, name)
        except UnicodeEncodeError as e:
            raise InvalidEntryError(f"a delta must be valid UTF-8 text: {e.reason}") from None
        budget = answer_budget(self.store.max_entry_bytes)
        if self._cost + cost > budget:
            raise AnswerTooLargeError(self.session_id, self.answer, self._cost + cost, budget, len(self._deltas))
        self._cost += cost
        index = len(self._deltas)
        self._deltas.append(Delta(answer=self.answer, index=index, kind=kind, text=text, call_id=call_id, name=name))
        self._send_wake.set()
        self._have_chunks.set()
        pending = len(self._deltas) - self._flushed
        if pending >= self._min_row:
            self._enough.set()
            if pending >= self.max_chunks:
                self._full.set()

    def _break(self, e: BaseException) -> None:
        if self._broken is None:
            log.warning("answer %s of %r cannot go on: %s", self.answer, self.session_id, e)
            self._broken = e

    def _common(self) -> dict[str, Any]:
        return {"incarnation": self._incarnation, "turn": self.turn, "step": self.step}

    # ------------------------------------------------------------------ live path

    async def _send_now(self) -> bool:
        """Write the deltas not live yet from the caller's task when no live send is in flight,
        so the record leaves now and not on the sender task's next turn (on a loaded event loop,
        milliseconds later); the sender task reads the reply (`_settle`). Otherwise, or when the
        store cannot write at once, the sender task sends them."""
        send = self._send_now_to
        first, upto = self._live, len(self._deltas)
        if (
            send is None or self._sending or self._live_unsure or self._closed or self._broken is not None
            or first >= upto
        ):  # fmt: skip
            return False
        self._sending = True
        expired_at = self._expired_at
        try:
            replies = await send(
                self.session_id, self.answer, first, self._deltas[first:upto],
                incarnation=self._incarnation or "", expire_ms=self._expiry(),
            )  # fmt: skip
        except StoreUnavailableError as e:  # a write that failed may have landed in part
            log.warning("live deltas of %r (answer %s) not sent yet: %s", self.session_id, self.answer, e)
            self._live_unsure = True
            replies = None
        except BaseException:  # cancelled while writing: what landed is read before the rest goes
            self._live_unsure = True
            self._sending = False
            self._send_wake.set()
            raise
        if replies is None:  # nothing written (or unsure): the sender task takes over
            if not self._live_unsure:
                self._expired_at = expired_at
            self._sending = False
        else:
            self._inflight = (replies, upto)
        self._send_wake.set()
        return True

    async def _settle(self) -> None:
        """Read the replies of the batch `_send_now` wrote."""
        if self._inflight is None:
            return
        replies, upto = self._inflight
        self._inflight = None
        try:
            ids = await replies()
        except StoreUnavailableError as e:
            log.warning("live deltas of %r (answer %s) may not have landed: %s", self.session_id, self.answer, e)
            self._live_unsure = True
            return
        except (AnswerError, SessionNotFoundError) as e:
            self._break(e)
            return
        except BaseException:
            self._live_unsure = True
            raise
        finally:
            self._sending = False
        self._went_live(upto, ids)

    def _went_live(self, upto: int, ids: Sequence[str]) -> None:
        """The deltas before `upto` are on the live stream, the last of them at `ids[-1]`."""
        self._live = upto
        if ids and ids[-1]:
            self._live_id = ids[-1]
        self._wrote_at = anyio.current_time()

    async def _send_loop(self) -> None:
        while True:
            await self._send_wake.wait()
            self._send_wake = anyio.Event()
            await self._settle()  # a batch in flight is always read, even on close
            if self._closed:
                return  # what is left goes out with the close
            if self._sending:
                continue  # `_send_now` is writing: it wakes this task once it has
            self._sending = True
            try:
                await self._send_pending()
            finally:
                self._sending = False

    async def _send_pending(self) -> None:
        """Send the deltas not live yet in one round trip; after a lost reply, first read what
        landed (so none goes live twice), then send the rest."""
        upto = len(self._deltas)
        if upto <= self._live or self._broken is not None:
            return
        try:
            if self._live_unsure:
                # the last send's outcome is unknown: what landed is on the live stream after the
                # last id we know, so each delta goes live once
                landed = [
                    r.index for r in await self.store.read_live(self.session_id, self._live_id)
                    if r.answer == self.answer and r.is_delta and r.index is not None
                ]  # fmt: skip
                self._live = max(self._live, max(landed, default=-1) + 1)
                self._live_unsure = False
            first = self._live
            if first < upto:
                # the hot path: plain XADDs, no script (this task is the answer's only sender, so
                # order holds; every record names the life, so no reader of another life takes it)
                ids = await self.store.answer_live(
                    self.session_id, self.answer, first, self._deltas[first:upto],
                    incarnation=self._incarnation or "", expire_ms=self._expiry(),
                )  # fmt: skip
                self._went_live(upto, ids)
        except StoreUnavailableError as e:
            log.warning("live deltas of %r (answer %s) not sent yet: %s", self.session_id, self.answer, e)
            self._live_unsure = True
            return
        except (AnswerError, SessionNotFoundError) as e:
            self._break(e)
            return

    def _expiry(self) -> int | None:
        """The live expiry, pushed forward with the records at most once a tenth of it (10 s at
        most): two PEXPIREs per answer and second were a quarter of a slow answer's commands."""
        now = anyio.current_time()
        if now - self._expired_at < min(10.0, max(1.0, self.live_ttl_ms / 10_000)):
            return None
        self._expired_at = now
        return self.live_ttl_ms

    # ------------------------------------------------------------------ durable path

    async def _flush_loop(self) -> None:
        while not self._closed:
            await self._have_chunks.wait()
            with anyio.move_on_after(self.flush_interval):
                await self._full.wait()
            if not self._closed and len(self._deltas) - self._flushed < self._min_row:
                # a small row waits for more deltas, up to _ROW_WAIT intervals in all: a row costs
                # the log ~120 B besides its deltas (a slow answer's rows of a few deltas each
                # made the log 0.26 of an entry per delta, rows of 32 make it 0.16)
                self._enough = anyio.Event()
                if len(self._deltas) - self._flushed < self._min_row:
                    with anyio.move_on_after(self.flush_interval * (_ROW_WAIT - 1)):
                        await self._enough.wait()
            if self._closed:
                return  # the last rows go with the closing entry
            self._have_chunks, self._full = anyio.Event(), anyio.Event()
            await self._flush()
            pending = len(self._deltas) - self._flushed
            if pending > 0:
                self._have_chunks.set()
            if pending >= self.max_chunks:
                # a full row's worth came in while this one was written: it goes now, not after
                # the interval (the signal `_add` gave went with the events replaced above)
                self._full.set()

    async def _flush(self) -> None:
        """Append the buffered deltas as one row (at most `max_chunks`). A row whose reply was
        lost is sent again with the same bounds: it lands once."""
        if self._broken is not None or self._failed is not None:
            return
        if self._row is None:
            if len(self._deltas) <= self._flushed:
                return
            self._row = (self._flushed, min(len(self._deltas), self._flushed + self.max_chunks))
        lo, hi = self._row
        ack: AnswerAck | None
        try:
            ack = await self.store.answer_deltas(
                self.session_id, self.answer, lo, self._deltas[lo:hi], live=False, log=True,
                ttl_ms=self.live_ttl_ms, **self._common(),
            )  # fmt: skip
        except DurabilityError as e:  # the row landed; the close's wait covers it again
            log.warning("chunks of %r (answer %s) landed unconfirmed: %s", self.session_id, self.answer, e)
            got = [x for x in e.entries if isinstance(x, Entry)]
            ack = AnswerAck(logged=hi, live=self._live, row_n=got[0].n) if got else None
        except StoreUnavailableError as e:
            log.warning("chunks of %r (answer %s) not flushed yet: %s", self.session_id, self.answer, e)
            await anyio.sleep(min(self.flush_interval, 0.2))
            return
        except AnswerOrderError as e:
            if not self._rewind(e.expected, lo):
                self._break(e)
            return
        except (AnswerError, SessionNotFoundError) as e:
            self._break(e)
            return
        except InvalidEntryError as e:  # a row the store refuses (never retried): the answer ends interrupted
            log.warning("chunks of %r (answer %s) refused: %s", self.session_id, self.answer, e)
            self._failed = e
            self._closed = True
            return
        self._row = None
        self._flushed = hi
        self._wrote_at = anyio.current_time()
        if ack is not None and ack.row_n is not None and self._advance is not None:
            # the handle moves past its answer's own row (a write through it stays in order)
            row = chunk_row([d.chunk() for d in self._deltas[lo:hi]], turn=self.turn, step=self.step,
                            answer=self.answer, seq=lo)  # fmt: skip
            await self._advance([Entry(n=ack.row_n, time=now_ms(), type=CHUNK, data=row.data)])

    def _rewind(self, expected: int, lo: int) -> bool:
        """The server's next logged index is `expected`, not `lo`, this writer's: a failover lost
        rows whose replies had come (the promoted replica never got them: replication is
        asynchronous), so they are sent again from there (the deltas are all here). Whether it
        could."""
        if not 0 <= expected <= len(self._deltas) or expected == lo:
            return False
        log.warning(
            "answer %s of %r: the log holds deltas [0, %d), not [0, %d) (rows lost in a failover): resending",
            self.answer, self.session_id, expected, lo,
        )  # fmt: skip
        self._flushed = expected
        self._row = None
        self._rewound = True
        self._have_chunks.set()
        return True

    async def _beat_loop(self) -> None:
        """Tell the server this writer is alive while it has nothing to send (a quiet writer is
        never repaired)."""
        while not self._closed and self._broken is None:
            await anyio.sleep(max(0.0, self._wrote_at + self.heartbeat - anyio.current_time()))
            if self._closed:
                return
            if anyio.current_time() - self._wrote_at < self.heartbeat:
                continue
            try:
                await self.store.answer_beat(
                    self.session_id, self.answer, incarnation=self._incarnation, ttl_ms=self.live_ttl_ms
                )
                self._wrote_at = anyio.current_time()
            except StoreUnavailableError as e:
                log.warning("heartbeat of answer %s of %r failed: %s", self.answer, self.session_id, e)
                await anyio.sleep(min(1.0, self.heartbeat))
            except (AnswerError, SessionNotFoundError) as e:
                self._break(e)

    # ------------------------------------------------------------------ open and close

    async def __aenter__(self) -> AnswerStream:
        # The begin runs to its end even if this task is cancelled meanwhile (once sent it may
        # land); cancelled with the answer begun, it is closed at once as interrupted, so no
        # begun answer is left open for a repair to find long after its turn ended.
        try:
            await finish_then_cancel(self._begin())
        except asyncio.CancelledError as e:
            if self.begin_id is not None:
                await finish_then_cancel(self._close(type(e), e))
            raise
        return self

    async def _begin(self) -> None:
        begun = await _retrying(
            lambda: self.store.answer_begin(
                self.session_id, self.answer, n=self._position(), ttl_ms=self.live_ttl_ms, **self._common()
            )
        )
        self.begin_id = begun.begin_id
        self._live_id = begun.begin_id or None
        self._incarnation = self._incarnation or begun.incarnation
        self._wrote_at = self._expired_at = anyio.current_time()
        # plain asyncio tasks, not a task group: the block's own cancellation must not cut a
        # write in flight short, and its exit must wait for them (see __aexit__)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._send_loop()),
            loop.create_task(self._flush_loop()),
            loop.create_task(self._beat_loop()),
        ]

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The close runs to its end even while this task is being cancelled (a write is never
        # cut short: its outcome would be unknown, and the handle must move past what landed).
        await finish_then_cancel(self._close(exc_type, exc))

    async def _close(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> None:
        """Stop the loops, letting a write in flight finish, then close the answer: committed on
        a clean exit, interrupted on an error or a cancellation."""
        self._closed = True
        self._send_wake.set()
        self._have_chunks.set()
        self._full.set()
        self._enough.set()
        self._tasks[2].cancel()  # the heartbeat has nothing in flight worth waiting for
        for result in await asyncio.gather(*self._tasks, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.warning("answer %s of %r: a background write failed: %r", self.answer, self.session_id, result)
        await self._settle()  # (the send loop reads it; this only if it ended early)
        if self._broken is not None:
            if exc_type is None:
                raise self._broken
            return
        if self._failed is not None:
            # close it interrupted with what the log holds (the refused row never lands),
            # then tell the block
            self._row = None
            del self._deltas[self._flushed :]
            self._live = min(self._live, self._flushed)
            try:
                await self._interrupt("error")
            except Exception:
                log.exception("closing the interrupted answer %s of %r failed", self.answer, self.session_id)
            if exc_type is None:
                raise self._failed
            return
        # every delta is live before the entry that closes the answer lands
        for _ in range(3):
            await self._send_pending()
            if self._live >= len(self._deltas) or self._broken is not None:
                break
        if exc_type is None:
            await self._commit()
        else:
            reason = "cancelled" if exc is not None and _is_cancel(exc) else "error"
            try:
                await self._interrupt(reason)
            except Exception:
                log.exception("closing the interrupted answer %s of %r failed", self.answer, self.session_id)

    async def _end(self, reason: str, closing: NewEntry | None, expected: int | str | None) -> tuple[AnswerEnded, bool]:
        """The end op (retried on a lost reply: an end that landed answers as a retry); whether
        its durability wait failed."""
        if self._row is not None:  # a row whose outcome is unknown: settle it first (same bounds)
            await _retrying(self._flush_strict)
        # the end carries at most one row of deltas: what is beyond goes in rows first (one row of
        # everything could outgrow the entry limit, and the answer would never close)
        while len(self._deltas) - self._flushed > self.max_chunks and self._broken is None and self._failed is None:
            await _retrying(self._flush_strict)
        try:
            return await self._end_once(reason, closing, expected)
        except (AnswerOrderError, AnswerIncompleteError) as e:
            # the log lacks rows that had landed (a failover lost them): send them again, in
            # rows of `max_chunks` as the flushes do, then end with the rest
            logged = e.expected if isinstance(e, AnswerOrderError) else e.logged
            if logged >= self._flushed or not self._rewind(logged, self._flushed):
                raise
            while len(self._deltas) - self._flushed > self.max_chunks:
                await _retrying(self._flush_strict)
            if isinstance(expected, int):
                expected = "answer"  # the handle counted the lost rows: only "nobody else wrote" holds
            return await self._end_once(reason, closing, expected)

    async def _end_once(
        self, reason: str, closing: NewEntry | None, expected: int | str | None
    ) -> tuple[AnswerEnded, bool]:
        rest = self._deltas[self._flushed :]
        unconfirmed = False

        async def op() -> AnswerEnded:
            return await self.store.answer_end(
                self.session_id, self.answer, deltas=len(self._deltas), reason=reason, closing=closing,
                expected=expected, rest_first=self._flushed, rest=rest, grace_ms=self.grace_ms, **self._common(),
            )  # fmt: skip

        try:
            ended = await _retrying(op)
        except DurabilityError as e:
            unconfirmed = True
            n = e.entries[-1].n if e.entries and isinstance(e.entries[-1], Entry) else None
            ended = AnswerEnded(n=n, reason=reason)
            self._durability = e
        self._flushed = len(self._deltas)
        return ended, unconfirmed

    def _expected(self) -> int | str:
        """The close's fence: the handle's n (it moved past the answer's own rows), else
        ``"answer"`` (nobody else wrote since the answer's own last row)."""
        return self._position() if self._advance is not None and not self._rewound else "answer"

    async def _flush_strict(self) -> None:
        await self._flush()
        if self._row is not None and self._broken is None:
            raise StoreUnavailableError("a chunk row is still unsettled")
        if self._broken is not None:
            raise self._broken

    async def _closing_entry(self, n: int | None) -> Entry | None:
        if n is None:
            return None
        got = await _retrying(lambda: self.store.read(self.session_id, n, n + 1, incarnation=self._incarnation))
        entry = got[0] if got else None
        if entry is not None and self._advance is not None:
            await self._advance([entry])
        return entry

    async def _commit(self) -> None:
        message = answer_message(self.answer, self.turn, self.step, self.content(), self.usage, self._meta)
        try:
            encode_entry(message, self.store.vocabulary, max_entry_bytes=self.store.max_entry_bytes)
        except InvalidEntryError:
            # its content fits (the size rule), so `usage` or `meta` make it too big: the answer
            # is not left open (nothing could close it but a repair), it ends interrupted, with
            # every delta in its rows, and the block is told
            try:
                await self._interrupt("error")
            except Exception:
                log.exception("closing the interrupted answer %s of %r failed", self.answer, self.session_id)
            raise
        try:
            try:
                ended, unconfirmed = await self._end("committed", message, self._expected())
            except SessionConflictError as e:
                # the handle may trail only this answer's own rows (a row whose reply was lost, then
                # settled): move past them and close once more; another writer's entry still conflicts
                if not await self._absorb_own_rows(e):
                    raise
                ended, unconfirmed = await self._end("committed", message, self._expected())
        except SessionConflictError:
            # someone wrote since the answer's rows: keep the deltas, close the answer with a row
            # that says so (readers that lagged behind learn it ended), let the caller retry the
            # message (`Session.commit`)
            await self._end("conflict", end_row(self.answer, self.turn, self.step, len(self._deltas), "conflict"), None)
            raise
        self.message = await self._closing_entry(ended.n)
        if unconfirmed and self._durability is not None:
            raise self._durability

    async def _absorb_own_rows(self, conflict: SessionConflictError) -> bool:
        """Whether every entry between the handle and the log's end is one of this answer's own
        chunk rows; if so the handle moves past them (a close can then be sent again)."""
        if self._advance is None or conflict.actual_n is None or conflict.expected_n is None:
            return False
        lo, hi = conflict.expected_n, conflict.actual_n
        if not 0 <= lo < hi or hi - lo > 64:
            return False
        got = await _retrying(lambda: self.store.read(self.session_id, lo, hi, incarnation=self._incarnation))
        if len(got) != hi - lo or any(e.type != CHUNK or e.data.get("answer") != self.answer for e in got):
            return False
        await self._advance(got)
        return True

    async def _interrupt(self, reason: str) -> None:
        mark = interrupted_mark(
            self.answer, self.turn, self.step, reason, len(self._deltas), self.content(), self._meta,
            max_bytes=self.store.max_entry_bytes,
        )  # fmt: skip
        ended, _ = await self._end("interrupted", mark, None)
        self.interrupted = await self._closing_entry(ended.n)


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


def interrupted_mark(
    answer: str,
    turn: int | None,
    step: int | None,
    reason: str,
    deltas: int,
    content: Sequence[Any],
    meta: dict[str, Any] | None = None,
    *,
    max_bytes: int | None = None,
) -> NewEntry:
    """The ``assistant/interrupted`` mark that closes an answer cut short: `reason` (cancelled,
    error, crashed), how many deltas it had and the content they make (the chunk rows before it
    hold every delta). With `max_bytes` (the store's entry limit) the mark always fits: when
    the content (or `meta`) would not, it goes without (``"truncated": true``; the rows still
    replay the answer), so an answer can always be closed."""
    data: dict[str, Any] = {}
    if turn is not None:
        data["turn"] = turn
    if step is not None:
        data["step"] = step
    data.update({"answer": answer, "reason": reason, "deltas": deltas, "content": list(content)})
    mark = NewEntry(INTERRUPTED, data, {**(meta or {}), "answer": answer})
    if max_bytes is None or _entry_size(mark) <= max_bytes:
        return mark
    data = {**data, "content": [], "truncated": True}
    mark = NewEntry(INTERRUPTED, data, mark.meta)
    if _entry_size(mark) <= max_bytes:
        return mark
    return NewEntry(INTERRUPTED, data, {"answer": answer})


def _entry_size(e: NewEntry) -> int:
    """The size the store measures (`model.EncodedEntry.size`), or more when it is not JSON."""
    try:
        return len(e.type) + len(msgspec.json.encode(e.data)) + len(msgspec.json.encode(e.meta))
    except (TypeError, UnicodeEncodeError, OverflowError):
        return 1 << 62


async def close_dead_answers(
    store: SessionStore,
    session_id: str,
    entries: Sequence[Entry],
    records: Sequence[LiveRecord],
    answers: Sequence[str],
    *,
    incarnation: str | None,
    stale_ms: int,
) -> tuple[list[int], bool]:
    """Close `answers` whose writer is gone through the answer protocol: the deltas the log
    lacks (the live stream still has them) as the last row, an ``assistant/interrupted`` mark
    (reason ``crashed``) and the live end, in one `answer_end` that the server refuses when the
    writer wrote or beat within `stale_ms` (`AnswerAliveError`: it is alive after all) or when
    the answer has ended (a second repair: nothing twice). `entries` is the log. Returns the n of
    each mark written, and whether an answer's writer is alive (it was left open)."""
    opened = open_answers(records)
    logged = replay(entries)
    out: list[int] = []
    alive = False
    states = await store.answer_states(session_id, answers)
    for answer in answers:
        begin, live = opened.get(answer, (None, []))
        turn = begin.turn if begin is not None else None
        step = begin.step if begin is not None else None
        chunks = list(logged.get(answer, []))
        have = len(chunks)
        st = states.get(answer)
        if st is None:
            continue  # its state expired: the protocol cannot close it (the turn closers still do)
        rest = [d for d in live if d.index >= have]
        rest = [d for i, d in enumerate(rest) if d.index == have + i]  # contiguous from the log's end
        while rest and _entry_size(chunk_row([d.chunk() for d in rest], turn=turn, step=step, answer=answer,
                                             seq=have)) > store.max_entry_bytes:  # fmt: skip
            rest = rest[: len(rest) // 2]  # the row that closes it must fit: what fits of the rest
        chunks.extend(d.chunk() for d in rest)
        mark = interrupted_mark(
            answer, turn, step, "crashed", len(chunks), assemble(chunks), max_bytes=store.max_entry_bytes
        )
        try:
            ended = await store.answer_end(
                session_id, answer, deltas=have + len(rest), reason="interrupted", closing=mark,
                rest_first=have, rest=rest, turn=turn, step=step, incarnation=incarnation,
                grace_ms=round(DEFAULT_GRACE * 1000), stale_ms=stale_ms,
            )  # fmt: skip
        except AnswerAliveError:
            alive = True
            continue
        except AnswerError as e:
            log.info("not repairing answer %s of %r: %s", answer, session_id, e)
            continue
        if not ended.retry and ended.n is not None:
            out.append(ended.n)
    return out, alive


async def forgotten_answer_marks(
    store: SessionStore, session_id: str, entries: Sequence[Entry], *, stale_ms: int
) -> list[NewEntry]:
    """The ``assistant/interrupted`` marks (reason ``crashed``) for the answers of the open turn
    that the protocol can no longer close: chunk rows in the log, no closing entry, and the server
    no longer holds their state — their writer neither wrote nor beat for the live TTL (a beat
    refreshes the state), so the state, the live stream and its last deltas are gone — and their
    last row older than `stale_ms`. Each mark holds the content the rows make: a writer that died
    and was repaired only later still leaves its partial answer to the projection, once."""
    start = 0
    for i in range(len(entries) - 1, -1, -1):
        if entries[i].type == "turn/start":
            start = i
            break
    rows: dict[str, list[Entry]] = {}
    closed: set[str] = set()
    for e in entries[start:]:
        if e.type == CHUNK and isinstance(e.data, dict) and isinstance(e.data.get("answer"), str):
            if row_ended(e.data):
                closed.add(e.data["answer"])  # ended without a message (its commit was refused)
            rows.setdefault(e.data["answer"], []).append(e)
        elif e.type in ("assistant/message", INTERRUPTED) and isinstance(e.meta, dict):
            answer = e.meta.get("answer")
            if isinstance(answer, str):
                closed.add(answer)
    now = now_ms()
    quiet = [a for a, got in rows.items() if a not in closed and now - got[-1].time >= stale_ms]
    if not quiet:
        return []
    held = await store.answer_states(session_id, quiet)
    marks: list[NewEntry] = []
    for answer in quiet:
        if answer in held:
            continue  # the protocol still can: `close_dead_answers` decides
        chunks = replay(rows[answer])[answer]
        last = rows[answer][-1].data
        turn, step = last.get("turn"), last.get("step")
        marks.append(interrupted_mark(
            answer, turn if isinstance(turn, int) else None, step if isinstance(step, int) else None,
            "crashed", len(chunks), assemble(chunks), max_bytes=store.max_entry_bytes,
        ))  # fmt: skip
    return marks


async def tail_deltas(
    store: SessionStore,
    session_id: str,
    start: int = 0,
    *,
    incarnation: str | None = None,
    live_after: str | None = None,
    delivered: dict[str, int] | None = None,
    resumed: bool = False,
) -> AsyncGenerator[Entry | Delta | DeltaGap, None]:
    """Entries from `start` as `SessionStore.tail` gives them, and the deltas of streamed
    answers as they are streamed (one connection; `live.follow_deltas` survives drops).

    Without `live_after` (a fresh reader) the live stream is read from its start, so a reader
    that arrives mid-answer gets the answer so far, then the rest. With `live_after` (the cursor
    of the last delta delivered), delivery resumes right after it. Every delta once and in
    order, per answer; where the live stream cannot give an answer's next delta (trimmed after
    its grace, capped, never sent live) a `DeltaGap` says which ones, so the reader re-reads the
    answer from the log's chunk rows; a resume whose cursor the live stream no longer holds gets
    a `DeltaGap` with an empty `answer` first (records after it may be gone too: re-read the
    answers it was following from the log). Answers closed before `start` (their entries are
    behind the reader) are not sent; a begin of another life raises `SessionReplacedError`.

    `delivered` (answer -> the next index owed, kept up to date as deltas are given) carries
    what a reader got over an earlier connection: a delta a failover lost from the live stream
    and its writer sent again, under a later id than the reader's cursor, is not given twice.
    `resumed`: `start` is the cursor of a reader given the entries before it (`SessionStore.tail`)."""
    records = await store.read_live(session_id)
    # the life, after the records: those were read from the stream of the life the header still
    # names, so a straggler of another life (an old writer's last live records land in whatever
    # stream holds the id now) never passes for this one's, nor does a reader resume on it
    head = await store.head(session_id)
    if head is None:
        raise SessionNotFoundError(session_id)
    if incarnation is not None and head.header.incarnation != incarnation:
        raise SessionReplacedError(session_id)
    # a fresh reader follows the session from the log's end now; a resumed one from its cursor
    following = start if (resumed or live_after is not None) else max(start, head.n)
    reader = LiveReader(session_id, start, head.header.incarnation or None, live_after, delivered, following=following)
    for given in reader.prime(records):
        yield given
    # the records after the cursor (a fresh reader: all of them) come from the tail, with the
    # entries in the order they happened (`merge_live`): never a later answer's deltas before an
    # earlier answer's message
    tail = store.tail_live(
        session_id, start, live_after=reader.cursor or "0-0", incarnation=incarnation, resumed=resumed
    )
    async for got in tail:
        if not isinstance(got, LiveRecord):
            if isinstance(got, Entry):
                for gap in reader.entry(got):
                    yield gap
            yield got
            continue
        for out in reader.feed(got):
            yield out


class LiveReader:
    """What one reader of a session's live stream is owed, record by record: the one place of
    the delivery rules behind `tail_deltas` and the gateway's shared tails. Every delta once and in
    order per answer; a `DeltaGap` where the stream cannot give the next one; nothing of an
    answer closed before `start` (its entries are behind the reader); a begin of another life
    raises `SessionReplacedError`, another life's other records are never taken.

    `prime` takes a read of the whole live stream (the first one: records up to `cursor` were
    seen, and a stream that no longer holds the cursor may have lost some after it: an
    empty-answer gap says so; again after the reader fell behind, the same check), `records`
    the same and every record after the cursor at once; `feed` takes each record as it lands,
    and `entry` each log entry given to the reader, in the order they happened
    (`projection.chunks.merge_live`: the tails give them so); `cursor` is the id of the last
    record taken, where a tail resumes.

    The log is the check on the live stream: an answer's deltas all come before the entry that
    closes it, so at that entry the reader knows how many it is owed (its chunk rows say) and
    gets a gap for those the live stream no longer held (trimmed after their grace while the
    reader lagged behind, capped) — whole answers included — when it was following the session
    as the answer ended (the entry is at or after `following`: the log's n when a fresh reader
    began, a resumed reader's own cursor) or had begun receiving the answer."""

    def __init__(
        self,
        session_id: str,
        start: int,
        incarnation: str | None,
        live_after: str | None,
        expect: dict[str, int] | None = None,
        *,
        following: int | None = None,
    ) -> None:
        self.session_id = session_id
        self.start = start
        self.incarnation = incarnation
        self.cursor = live_after  # None: nothing read yet (a fresh reader gets the answer so far)
        # answer -> the next index the reader is owed; shared with the reader's earlier
        # connections, so a record a failover lost and its writer sent again is never given twice
        self.expect: dict[str, int] = {} if expect is None else expect
        self.skip: set[str] | None = None  # answers it gets nothing more of
        self.following = start if following is None else following
        self.logged: dict[str, int] = {}  # answer -> deltas its chunk rows given so far hold
        self._gone: str | None = None  # the cursor an empty-answer gap was given for (once each)

    def records(self, records: Sequence[LiveRecord]) -> list[Delta | DeltaGap]:
        """`prime`, then `feed` of each record after the cursor (a read of the whole stream)."""
        floor = (-1, -1) if self.cursor is None else _id_key(self.cursor)
        out = self.prime(records)
        for r in records:
            if _id_key(r.id) > floor:
                out.extend(self.feed(r))
        return out

    def prime(self, records: Sequence[LiveRecord]) -> list[Delta | DeltaGap]:
        """Take a read of the whole live stream without delivering what is after the cursor
        (that is fed afterwards, in the order it happened with the log's entries: `merge_live`):
        the answers the reader gets nothing of, what a resumed reader was given up to its cursor,
        and an empty-answer gap when the stream no longer holds the cursor."""
        first = self.skip is None
        skip = self.skip = answers_to_skip(records, self.start, None) if self.skip is None else self.skip
        floor = (-1, -1) if self.cursor is None else _id_key(self.cursor)
        out: list[Delta | DeltaGap] = []
        if (
            self.cursor not in (None, "0-0", self._gone)
            and (not records or _id_key(records[0].id) > floor)
        ):  # fmt: skip
            # the records up to the cursor are gone (trimmed after their grace, or the stream
            # expired): some after it may be too (the answers they closed get gaps of their own
            # at their closing entries, `entry`)
            self._gone = self.cursor
            out.append(DeltaGap(answer="", start=0, stop=None, cursor=self.cursor))
        if first:
            for r in records:
                if _id_key(r.id) <= floor and self._ours(r):
                    _seen(self.expect, skip, r)  # delivered before the reader resumed
        if self.cursor is None:
            self.cursor = "0-0"
        return out

    def feed(self, r: LiveRecord) -> list[Delta | DeltaGap]:
        if self.skip is None:
            self.skip = set()
        if self.cursor is None or _id_key(r.id) > _id_key(self.cursor):
            self.cursor = r.id
        if not self._ours(r):
            return []  # a straggler of another life's answer: never this session's
        return _deliver(self.expect, r, self.skip)

    def entry(self, e: Entry) -> list[DeltaGap]:
        """What a log entry given to the reader says of the deltas it is owed: a chunk row, how
        many its answer has at least; the entry closing an answer, a gap for those the live
        stream never gave, when the reader follows that answer (see the class)."""
        a = entry_answer(e)
        if a is None:
            return []
        if self.skip is None:
            self.skip = set()
        if a in self.skip:
            return []
        if e.type == CHUNK:
            top = row_end(e.data)
            if top is not None and top > self.logged.get(a, 0):
                self.logged[a] = top
            if not row_ended(e.data):
                return []
        total = self.logged.pop(a, None)
        if e.type == INTERRUPTED and isinstance(e.data, dict):
            said = e.data.get("deltas")
            if isinstance(said, int) and not isinstance(said, bool):
                total = max(total or 0, said)
        followed = e.n >= self.following or a in self.expect
        nxt = self.expect.pop(a, 0)
        self.skip.add(a)  # nothing of it after its closing entry (its end record included)
        if followed and total is not None and nxt < total:
            return [DeltaGap(answer=a, start=nxt, stop=total, cursor=self.cursor or "0-0")]
        return []

    def _ours(self, r: LiveRecord) -> bool:
        if self.incarnation and r.incarnation and r.incarnation != self.incarnation:
            if r.kind == "begin":
                raise SessionReplacedError(self.session_id, "its live stream belongs to another life")
            return False
        return True


def _seen(expect: dict[str, int], skip: set[str], r: LiveRecord) -> None:
    if r.kind == "begin":
        expect.setdefault(r.answer, 0)
    elif r.is_delta and r.index is not None:
        expect[r.answer] = max(expect.get(r.answer, 0), r.index + 1)
    elif r.kind == "end":
        expect.pop(r.answer, None)
        skip.add(r.answer)


def _deliver(expect: dict[str, int], r: LiveRecord, skip: set[str]) -> list[Delta | DeltaGap]:
    """What one live record gives the reader: a delta (after a gap when indexes are missing),
    a gap at an end that names more deltas than were given, or nothing."""
    if r.answer in skip:
        return []
    if r.kind == "begin":
        expect.setdefault(r.answer, 0)
        return []
    if r.kind == "end":
        skip.add(r.answer)  # nothing of it after its end
        nxt = expect.pop(r.answer, None)
        total = r.index or 0
        if nxt is not None and nxt < total:
            return [DeltaGap(answer=r.answer, start=nxt, stop=None, cursor=r.id)]
        return []
    if not r.is_delta or r.index is None:
        return []
    nxt = expect.get(r.answer, 0)
    if r.index < nxt:
        return []  # never expected from the protocol (a duplicate): not given twice
    out: list[Delta | DeltaGap] = []
    if r.index > nxt:
        out.append(DeltaGap(answer=r.answer, start=nxt, stop=r.index, cursor=r.id))
    expect[r.answer] = r.index + 1
    out.append(r.delta())
    return out


def _id_key(rid: str) -> tuple[int, int]:
    ms, _, seq = rid.partition("-")
    return (int(ms) if ms.isdigit() else 0, int(seq) if seq.isdigit() else 0)


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, anyio.get_cancelled_exc_class()) or isinstance(exc, KeyboardInterrupt)


__all__ = [
    "AnswerStream",
    "answer_message",
    "close_dead_answers",
    "interrupted_mark",
    "tail_deltas",
]
