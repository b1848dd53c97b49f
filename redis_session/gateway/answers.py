"""The streaming routes: one answer streamed over HTTP, as `Session.stream` streams it in Python
(docs/design.md §8.2), by any replica (the gateway keeps nothing per answer between requests).

``POST /sessions/{id}/answers`` ``{turn?, step?}``
    opens an answer: a ``begin`` record on the session's live stream; 201
    ``{answer, n, incarnation, begin_id}`` (the log's n when it began, the begin's live id).
    With an ``Idempotency-Key`` the answer id is derived from it (a retry gets the same answer).
``POST /sessions/{id}/answers/{answer}/deltas`` ``{first_index, deltas: [...], turn?, step?}``
    a batch of deltas (``{text}``, ``{kind: "reasoning", text}``, ``{kind: "tool-call", callId,
    name?, text}``) numbered from `first_index`: one packed ``assistant/chunk`` row in the log
    (``expected_n`` none, the session's incarnation, idempotency key
    ``answer:<answer>:<first_index>``), then the deltas on the live stream. A retried batch lands
    nowhere twice: its row is the one already there, and its deltas are not sent again.
``POST /sessions/{id}/answers/{answer}/end`` ``{reason, begun_at, begin_id?, content?, ...}``
    closes it: ``committed`` appends the ``assistant/message`` (content assembled from the
    answer's chunk rows in the log since `begun_at`, unless given), ``interrupted`` the
    ``assistant/interrupted`` mark; ``If-Match`` (or ``expected_n``) as on ``/entries`` (412,
    nothing written); then the ``end`` record on the live stream (trimming what precedes
    `begin_id`, expiring after the grace period).

Records and rows are made by the same functions `AnswerStream` uses, so readers (`follow_deltas`,
SSE ``?deltas=1``, the viewer, `repair`) cannot tell an HTTP-streamed answer from a Python one.
The log is written before the live stream: a delta batch's row decides whether it is new.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidEntryError, SessionNotFoundError, SessionReplacedError
from ..model import Entry, NewEntry, SessionHead
from ..projection.chunks import TOOL_CALL, LiveRecord, assemble, chunk_row, new_answer_id, replay
from ..streaming import (
    DEFAULT_GRACE,
    DEFAULT_LIVE_TTL,
    answer_message,
    begin_record,
    end_record,
    interrupted_mark,
)
from .body import (
    NonNeg,
    Preconditions,
    TooLarge,
    Unprocessable,
    convert,
    decode_json,
    entry_error,
    preconditions,
    read_body,
)
from .common import _JSON, _BadRequest, _session_path, log, route_key
from .context import Gateway
from .writes import _tags, _written

MAX_DELTAS = 4096
"""Deltas per batch request (a client batches ~75 ms of them; more answers 413)."""
LIVE_TTL_MS = round(DEFAULT_LIVE_TTL * 1000)
GRACE_MS = round(DEFAULT_GRACE * 1000)
_ANSWER = re.compile(r"[0-9A-Za-z_.-]{1,64}")
_LIVE_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


class BeginIn(Struct, forbid_unknown_fields=True, kw_only=True):
    turn: int | None = None
    step: int | None = None


class DeltaIn(Struct, forbid_unknown_fields=True, kw_only=True, rename={"call_id": "callId"}):
    text: str
    kind: Literal["text", "reasoning", "tool-call"] = "text"
    call_id: str | None = None
    name: str | None = None


class DeltasIn(Struct, forbid_unknown_fields=True, kw_only=True):
    first_index: NonNeg
    deltas: list[DeltaIn]
    turn: int | None = None
    step: int | None = None


class EndIn(Struct, forbid_unknown_fields=True, kw_only=True):
    reason: Literal["committed", "interrupted"]
    begun_at: NonNeg
    begin_id: str | None = None
    turn: int | None = None
    step: int | None = None
    content: list[dict[str, Any]] | None = None
    usage: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    cause: Literal["cancelled", "error"] = "cancelled"
    expected_n: NonNeg | None = None


def _answer_of(request: Request) -> str:
    answer = route_key(_session_path(request.scope)[1])[1] or ""
    if not _ANSWER.fullmatch(answer):
        raise _BadRequest("an answer id is 1-64 characters of [0-9A-Za-z_.-]")
    return answer


async def _head(gw: Gateway, sid: str, cond: Preconditions) -> SessionHead:
    """The session's head (404 when there is none; 409 when it is not the pinned incarnation)."""
    head = await gw.store.head(sid)
    if head is None:
        raise SessionNotFoundError(sid)
    if cond.incarnation is not None and head.header.incarnation != cond.incarnation:
        raise SessionReplacedError(sid)
    return head


async def _put(gw: Gateway, sid: str, expected: int | None, entry: NewEntry, key: str, inc: str | None) -> list[Entry]:
    try:
        return await gw.store.put(sid, expected, [entry], idempotency_key=key, incarnation=inc)
    except InvalidEntryError as e:
        raise entry_error(e, "") from None


async def _live(gw: Gateway, sid: str, records: list[LiveRecord], **kw: Any) -> list[str]:
    """Add live records; a failure only costs readers the live view (the log has it all), as in
    `AnswerStream`."""
    try:
        return await gw.store.live_add(sid, records, **kw)
    except Exception as e:
        log.warning("live records of %r (answer %s) were not sent: %s", sid, records[0].answer, e)
        return []


# --------------------------------------------------------------------------- begin


async def begin(gw: Gateway, request: Request, sid: str) -> Response:
    cond = preconditions(request)
    req = convert(decode_json(await read_body(request, gw.max_body)), BeginIn)
    head = await _head(gw, sid, cond)
    inc = head.header.incarnation or None
    answer = new_answer_id()
    if cond.idempotency_key is not None:
        answer = hashlib.sha256(f"{sid}\0{cond.idempotency_key}".encode()).hexdigest()[:10]
    ids = await _live(gw, sid, [begin_record(answer, req.turn, req.step, head.n, inc)], expire_ms=LIVE_TTL_MS)
    body = {"answer": answer, "n": head.n, "incarnation": inc, "begin_id": ids[0] if ids else None}
    return _JSON(body, status_code=201, headers=_tags(head.n, inc))


# --------------------------------------------------------------------------- deltas


def _record(answer: str, index: int, d: DeltaIn, path: str) -> LiveRecord:
    if d.kind == TOOL_CALL:
        if not d.call_id:
            raise Unprocessable("a tool-call delta names its call (a non-empty callId)", path + ".callId")
    elif d.call_id is not None or d.name is not None:
        field = "callId" if d.call_id is not None else "name"
        raise Unprocessable(f"only a tool-call delta has a {field}", f"{path}.{field}")
    return LiveRecord(answer=answer, kind=d.kind, index=index, text=d.text, call_id=d.call_id, name=d.name)


async def deltas(gw: Gateway, request: Request, sid: str) -> Response:
    answer = _answer_of(request)
    cond = preconditions(request)
    req = convert(decode_json(await read_body(request, gw.max_body)), DeltasIn)
    if not req.deltas:
        raise Unprocessable("a batch holds at least one delta", "$.deltas")
    if len(req.deltas) > MAX_DELTAS:
        raise TooLarge(f"a batch holds at most {MAX_DELTAS} deltas; this one has {len(req.deltas)}", "batch_too_large")
    records = [_record(answer, req.first_index + i, d, f"$.deltas[{i}]") for i, d in enumerate(req.deltas)]
    row = chunk_row(
        [r.delta().chunk() for r in records], turn=req.turn, step=req.step, answer=answer, seq=req.first_index
    )
    head = await _head(gw, sid, cond)
    inc = head.header.incarnation or None
    stored = await _put(gw, sid, None, row, f"answer:{answer}:{req.first_index}", inc)
    if stored[0].n >= head.n:  # a new row (a retry's row is behind the head it read): send them live
        await _live(gw, sid, records, expire_ms=LIVE_TTL_MS)
    return _written(stored, stored[-1].n + 1, inc)


# --------------------------------------------------------------------------- end


def _expected(cond: Preconditions, req: EndIn) -> int | None:
    if cond.expected is not None and req.expected_n is not None and cond.expected != req.expected_n:
        raise _BadRequest("If-Match and expected_n disagree")
    return cond.expected if cond.expected is not None else req.expected_n


def _closing(answer: str, req: EndIn, chunks: list[Any]) -> NewEntry:
    content = req.content if req.content is not None else assemble(chunks)
    if req.reason == "committed":
        return answer_message(answer, req.turn, req.step, content, req.usage, req.meta)
    return interrupted_mark(answer, req.turn, req.step, req.cause, len(chunks), content, req.meta)


async def end(gw: Gateway, request: Request, sid: str) -> Response:
    answer = _answer_of(request)
    cond = preconditions(request)
    req = convert(decode_json(await read_body(request, gw.max_body)), EndIn)
    if req.begin_id is not None and not _LIVE_ID.fullmatch(req.begin_id):
        raise Unprocessable("begin_id is a live stream id (<ms>-<seq>), as the begin answered", "$.begin_id")
    expected = _expected(cond, req)
    head = await _head(gw, sid, cond)
    if req.begun_at > head.n:
        raise Unprocessable(f"begun_at is the n the begin answered; the log is at {head.n}", "$.begun_at")
    inc = head.header.incarnation or None
    logged = await gw.store.read(sid, req.begun_at, head.n, incarnation=inc) if req.begun_at < head.n else []
    chunks = replay(logged).get(answer, [])
    closing = _closing(answer, req, chunks)
    stored = await _put(gw, sid, expected, closing, cond.idempotency_key or f"answer:{answer}:end", inc)
    if stored[0].n >= head.n:  # not a retry of an end that landed
        reason = "committed" if req.reason == "committed" else "interrupted"
        record = end_record(answer, len(chunks), stored[0].n, reason)
        await _live(gw, sid, [record], expire_ms=GRACE_MS, trim_before=req.begin_id)
    return _written(stored, stored[-1].n + 1, inc)
