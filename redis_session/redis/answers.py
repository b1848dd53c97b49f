"""The streamed-answer half of `RedisSessionStore`: the one answer protocol (``lua/answer.lua``:
begin, delta batches, heartbeat, end, each checked against the answer's state and its life) and
the plain live-record writes of a single in-order sender (`answer_live`, `live_add`).

The answer's state is one hash per answer (``{prefix}:{id}:live:<answer>``); its live records go
to the session's live stream, its chunk rows and closing entry to the log, in one script call.
The store's connection primitives (`_eval_packed`, `_send_write`, `_pipeline`, the pool) come
from `store.py`.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from ..keys import Keys, validate_session_id
from ..model import Entry, NewEntryLike
from ..projection.chunks import (
    REASONING,
    TEXT,
    AnswerAck,
    AnswerBegun,
    AnswerEnded,
    AnswerState,
    Delta,
    LiveRecord,
    answer_budget,
    answer_refusal,
    chunk_row,
    deltas_cost,
)
from ..store.rules import StoreRules
from .replies import as_str as _s
from .replies import io_guard as _io
from .replies import typed_reply_error as _typed
from .scripts import SCRIPTS, Script
from .wire import PooledWire, bulks, pack

# the one-field live records' kind codes (`projection.chunks.compact_value`)
_COMPACT_CODES = {TEXT: "t", REASONING: "r"}


class AnswerOps(StoreRules):
    """Mixed into `RedisSessionStore`: the answer protocol and live-record writes."""

    if TYPE_CHECKING:  # provided by RedisSessionStore
        keys: Keys
        feed: bool
        cluster: bool
        feed_maxlen: int
        live_maxlen: int
        _durable: bytes
        _last_acks: Any
        _pool: PooledWire | None

        async def _pipeline(self, *commands: Sequence[Any]) -> builtins.list[Any]: ...
        async def _eval_packed(
            self, script: Script, count: int, body: bytes, route: str | bytes, durable: bool = False
        ) -> Any: ...
        async def _send_write(
            self, route: str | bytes, packed: bytes, count: int, soft_tail: bool = False
        ) -> builtins.list[Any]: ...
        def _check_durable(self, session_id: str, entries: builtins.list[Entry], acks: Any) -> builtins.list[Entry]: ...
        def _feed_cluster(self, session_id: str, n: int) -> None: ...

    async def live_add(
        self,
        session_id: str,
        records: Sequence[LiveRecord],
        *,
        expire_ms: int | None = None,
        trim_before: str | None = None,
    ) -> builtins.list[str]:
        """XADD `records` to the session's live stream in one round trip (plain commands, no
        script: MAXLEN-capped at `live_maxlen`), then trim records before stream id
        `trim_before` (XTRIM MINID) and set its expiry; the records' stream ids.

        Never re-sent: a lost reply raises `StoreUnavailableError` (a resend could repeat deltas)."""
        validate_session_id(session_id)
        key = self.keys.live(session_id)
        # "XADD key MAXLEN ~ <live_maxlen> *" packed once per call; then each record's fields
        head = bulks(("XADD", key, "MAXLEN", "~", self.live_maxlen, "*"))
        parts = [b"*%d\r\n%b%b" % (6 + len(f), head, bulks(f)) for f in (r.fields() for r in records)]
        if trim_before is not None:
            parts.append(pack(("XTRIM", key, "MINID", trim_before)))
        if expire_ms is not None:
            parts.append(pack(("PEXPIRE", key, expire_ms)))
        if not parts:
            return []
        with _io():
            replies = await self._send_write(key, b"".join(parts), len(parts))
        return [_s(r) or "" for r in replies[: len(records)]]

    # ------------------------------------------------------------------ streamed answers (lua/answer.lua)

    def _answer_keys(self, session_id: str, answer: str) -> builtins.list[str]:
        keys = self.keys.session_keys(session_id)
        keys.append(f"{self.keys.live(session_id)}:{answer}")
        if self.feed and not self.cluster:
            keys.append(self.keys.feed(self.keys.feed_shard(session_id)))
        return keys

    async def _answer(
        self, session_id: str, answer: str, args: Sequence[Any], *, durable: bool = False
    ) -> tuple[builtins.list[Any], Any]:
        validate_session_id(session_id)
        keys = self._answer_keys(session_id, answer)
        body = bulks([len(keys), *keys, *args])
        with _io():
            res = await self._eval_packed(SCRIPTS["answer"], 1 + len(keys) + len(args), body, keys[0], durable)
            acks = self._last_acks if durable else None
        if isinstance(res, ResponseError):
            raise _typed(res)
        return builtins.list(res), acks

    def _row_data(self, answer: str, first: int, deltas: Sequence[Delta], turn: int | None, step: int | None) -> bytes:
        if not deltas:
            return b""
        row = chunk_row([d.chunk() for d in deltas], turn=turn, step=step, answer=answer, seq=first)
        return self._put_batch(None, [row], None)[0].data_raw

    async def answer_begin(
        self,
        session_id: str,
        answer: str,
        *,
        turn: int | None = None,
        step: int | None = None,
        n: int | None = None,
        incarnation: str | None = None,
        ttl_ms: int,
    ) -> AnswerBegun:
        args = ["begin", answer, incarnation or "", ttl_ms, self.live_maxlen]
        args += ["" if turn is None else turn, "" if step is None else step, "" if n is None else n]
        res, _ = await self._answer(session_id, answer, args)
        code = int(res[0])
        if code in (0, 1):
            return AnswerBegun(
                answer=answer, n=int(res[1]), begin_id=_s(res[2]) or "", incarnation=_s(res[3]) or "", retry=code == 1
            )
        raise answer_refusal(code, res, session_id, answer)

    async def answer_deltas(
        self,
        session_id: str,
        answer: str,
        first: int,
        deltas: Sequence[Delta],
        *,
        live: bool = True,
        log: bool = True,
        turn: int | None = None,
        step: int | None = None,
        incarnation: str | None = None,
        ttl_ms: int,
    ) -> AnswerAck:
        cost = self._batch_cost(session_id, answer, first, deltas, log)  # the size rule (lua/answer.lua)
        budget = answer_budget(self.max_entry_bytes)
        data = self._row_data(answer, first, deltas, turn, step) if log else b""
        args: builtins.list[Any] = ["deltas", answer, incarnation or "", ttl_ms, self.live_maxlen]
        args += [first, len(deltas), data, cost, budget, len(deltas) if live else 0]
        if live:
            # a text or reasoning delta as 0, its kind code, "<answer> <index>", its text: the
            # script writes it as one field, "<answer> <index> <life> <text>" (`compact_value`)
            compact = bool(answer) and " " not in answer
            for i, d in enumerate(deltas):
                kc = _COMPACT_CODES.get(d.kind) if compact else None
                if kc is not None:
                    args += [0, kc, f"{answer} {first + i}", d.text]
                    continue
                f = LiveRecord(
                    answer=answer, kind=d.kind, index=first + i, text=d.text, call_id=d.call_id, name=d.name
                ).fields()
                args.append(len(f))
                args.extend(f)
        res, acks = await self._answer(session_id, answer, args, durable=bool(data) and bool(self._durable))
        code = int(res[0])
        if code in (0, 1):
            row_n = int(res[3])
            ack = AnswerAck(logged=int(res[1]), live=int(res[2]), row_n=None if row_n < 0 else row_n, retry=code == 1)
            if acks is not None:  # DurabilityError.entries: the row that landed unconfirmed
                row = [] if ack.row_n is None else [Entry(n=ack.row_n, time=0, type="assistant/chunk", data={})]
                self._check_durable(session_id, row, acks)
            return ack
        raise answer_refusal(code, res, session_id, answer, first)

    async def answer_live(
        self,
        session_id: str,
        answer: str,
        first: int,
        deltas: Sequence[Delta],
        *,
        incarnation: str,
        expire_ms: int | None = None,
    ) -> builtins.list[str]:
        """The hot path of one writer's live deltas: plain pipelined XADDs, each record tagged
        with the answer's life, no script (a script per delta costs several raw XADDs). Only for
        a single sender that keeps its order; it is never resent blindly: after a lost reply the
        sender reads what landed (`read_live` after its last id) and sends the rest. The ids
        ("" where the stream is gone: NOMKSTREAM, the answer's begin made it)."""
        validate_session_id(session_id)
        key, packed, count = self._live_packed(session_id, answer, first, deltas, incarnation, expire_ms)
        with _io():
            replies = await self._send_write(key, packed, count)
        return [_s(r) or "" for r in replies[: len(deltas)]]

    async def answer_live_send(
        self,
        session_id: str,
        answer: str,
        first: int,
        deltas: Sequence[Delta],
        *,
        incarnation: str,
        expire_ms: int | None = None,
    ) -> Callable[[], Awaitable[builtins.list[str]]] | None:
        """`answer_live` in two steps, when the records can be written at once (a standalone
        server and a pooled connection free; else None, nothing sent): they are written to the
        server now and the call returned reads their ids (await it exactly once: it gives the
        connection back to the pool). A writer sends a delta from its own task this way, without
        waiting for Redis."""
        validate_session_id(session_id)
        if self._pool is None or not self._pool.free():
            return None
        _, packed, count = self._live_packed(session_id, answer, first, deltas, incarnation, expire_ms)
        with _io():
            pending = await self._pool.begin(packed, count)

        async def read() -> builtins.list[str]:
            with _io():
                try:
                    replies = await pending()
                except ResponseError as e:
                    raise _typed(e) from None
            return [_s(r) or "" for r in replies[: len(deltas)]]

        return read

    def _live_packed(
        self,
        session_id: str,
        answer: str,
        first: int,
        deltas: Sequence[Delta],
        incarnation: str,
        expire_ms: int | None,
    ) -> tuple[str, bytes, int]:
        key = self.keys.live(session_id)
        head = bulks(("XADD", key, "NOMKSTREAM", "MAXLEN", "~", self.live_maxlen, "*"))
        parts = []
        for i, d in enumerate(deltas):
            f = LiveRecord(
                answer=answer, kind=d.kind, index=first + i, text=d.text, call_id=d.call_id, name=d.name,
                incarnation=incarnation,
            ).fields()  # fmt: skip
            parts.append(b"*%d\r\n%b%b" % (7 + len(f), head, bulks(f)))
        if expire_ms is not None:
            parts += [pack(("PEXPIRE", key, expire_ms)), pack(("PEXPIRE", f"{key}:{answer}", expire_ms))]
        return key, b"".join(parts), len(parts)

    async def answer_beat(self, session_id: str, answer: str, *, incarnation: str | None = None, ttl_ms: int) -> None:
        res, _ = await self._answer(session_id, answer, ["beat", answer, incarnation or "", ttl_ms, self.live_maxlen])
        if int(res[0]) != 0:
            raise answer_refusal(int(res[0]), res, session_id, answer)

    async def answer_end(
        self,
        session_id: str,
        answer: str,
        *,
        deltas: int,
        reason: str,
        closing: NewEntryLike | None = None,
        expected: int | str | None = None,
        rest_first: int = 0,
        rest: Sequence[Delta] = (),
        turn: int | None = None,
        step: int | None = None,
        incarnation: str | None = None,
        grace_ms: int,
        stale_ms: int | None = None,
    ) -> AnswerEnded:
        data = self._row_data(answer, rest_first, rest, turn, step)
        enc = self._put_batch(None, [closing], None)[0] if closing is not None else None
        args: builtins.list[Any] = ["end", answer, incarnation or "", grace_ms, self.live_maxlen]
        args += [deltas, reason, "" if expected is None else expected, rest_first, len(rest), data]
        args += [b"", b"", b""] if enc is None else [enc.type, enc.data_raw, enc.meta_raw or b""]
        args += ["" if stale_ms is None else stale_ms, self.feed_maxlen, session_id]
        args += [deltas_cost(rest), "" if stale_ms is not None else answer_budget(self.max_entry_bytes)]
        res, acks = await self._answer(session_id, answer, args, durable=bool(self._durable))
        code = int(res[0])
        if code == 0:
            n = int(res[1])
            ended = AnswerEnded(n=None if n < 0 else n, reason=reason)
            if enc is not None and n >= 0 and self.feed and self.cluster:
                self._feed_cluster(session_id, n + 1)
            if acks is not None and enc is not None:
                self._check_durable(session_id, [enc.stored(n, int(res[2]))], acks)
            return ended
        if code == 1:
            n = int(res[1])
            return AnswerEnded(n=None if n < 0 else n, reason=_s(res[2]) or reason, retry=True)
        exp = expected if isinstance(expected, int) else -1
        raise answer_refusal(code, res, session_id, answer, rest_first, exp)

    async def answer_states(self, session_id: str, answers: Sequence[str]) -> dict[str, AnswerState]:
        """The server's state of each of `answers` still known (see `AnswerState`)."""
        validate_session_id(session_id)
        if not answers:
            return {}
        live = self.keys.live(session_id)
        fields = ("inc", "n", "live", "log", "t", "e", "r")
        with _io():
            rows = await self._pipeline(*[("HMGET", f"{live}:{a}", *fields) for a in answers])
        out: dict[str, AnswerState] = {}
        for a, (inc, n, lv, lg, t, e, r) in zip(answers, rows, strict=True):
            if inc is None:
                continue
            out[a] = AnswerState(
                answer=a, incarnation=_s(inc) or "", n=int(n), live=int(lv), logged=int(lg), beat_ms=int(t),
                ended=None if e is None else int(e), reason=_s(r),
            )  # fmt: skip
        return out
