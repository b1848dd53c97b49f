"""The streaming routes: one answer streamed over HTTP through the same answer protocol as
`Session.stream` (``lua/answer.lua``: its rules are kept server-side, so an HTTP writer, a Python
one and the TypeScript client cannot drift apart), by any replica (the gateway keeps nothing per
answer between requests).

``POST /sessions/{id}/answers`` ``{turn?, step?}``
    opens an answer in the session's current life (or the ``X-Session-Incarnation`` one: 409
    ``session_replaced`` otherwise); 201 ``{answer, n, incarnation, begin_id}``. With an
    ``Idempotency-Key`` the answer id is derived from it and the life (a retry gets the same
    answer; the same key in a later life of the id another one; with another body 422
    ``idempotency_key_reused``).
``POST /sessions/{id}/answers/{answer}/deltas`` ``{first_index, deltas: [...], turn?, step?}``
    a batch of deltas (``{text}``, ``{kind: "reasoning", text}``, ``{kind: "tool-call", callId,
    name?, text}``) numbered from `first_index`: one packed ``assistant/chunk`` row in the log
    and the deltas on the live stream, in one script. It must start at the answer's next index:
    409 ``out_of_order`` with ``expected_index`` otherwise (never reordered, holes never
    accepted). A retry of a batch that landed is a no-op that still leaves its deltas on the
    live stream exactly once (two copies at once too); the same index with other deltas is 422
    ``batch_mismatch``. A batch that would take the answer's content over what its closing
    message can hold (the entry limit less 16 KiB, `projection.chunks.answer_budget`) is 413
    ``answer_too_large`` with ``size``, ``limit`` and ``next_index``: nothing of it is written,
    and the answer can still end with the deltas it has. 201 ``{n, next_index, entries: []}``.
    An empty batch (``deltas: []``) is the writer's heartbeat: nothing is written, the answer's
    lease is refreshed (`repair` leaves an answer alone while its writer wrote or beat within
    ``stale_after``, 30 s); 200.
``POST /sessions/{id}/answers/{answer}/end`` ``{reason, deltas?, content?, usage?, meta?, cause?}``
    closes it: ``committed`` appends the ``assistant/message`` (content assembled by index from
    the answer's chunk rows, unless given), ``interrupted`` the ``assistant/interrupted`` mark;
    `deltas` is how many the writer sent (default: as many as the log holds): 409 ``incomplete``
    with the ``missing`` range while the log lacks any. ``If-Match`` (or ``expected_n``) as on
    ``/entries`` (412, nothing written). A retried end answers the entry the first one wrote.
    An interrupted mark always fits the entry limit (its content left out, ``truncated``, when
    it would not: the rows hold every delta); a committed message over it (a given `content`,
    `usage` or `meta` too big) is 413 ``entry_too_large`` and the answer stays open.

Every op after the begin is checked against the life the answer began in, with or without the
``X-Session-Incarnation`` header: an answer of a deleted session never writes into the one that
took its id (409 ``session_replaced``). Unknown answer: 404 ``answer_not_found``; an answer that
has ended: 409 ``answer_ended``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from ..errors import (
    AnswerBatchMismatchError,
    AnswerClosedError,
    AnswerError,
    AnswerIncompleteError,
    AnswerNotFoundError,
    AnswerOrderError,
    AnswerTooLargeError,
    InvalidEntryError,
    SessionNotFoundError,
    SessionReplacedError,
)
from ..model import NewEntry, legacy_incarnation
from ..projection.chunks import TOOL_CALL, Delta, assemble, new_answer_id, replay
from ..streaming import DEFAULT_GRACE, DEFAULT_LIVE_TTL, answer_message, interrupted_mark
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
from .common import _JSON, _BadRequest, _session_path, route_key
from .context import Gateway
from .sse import is_stream_id
from .writes import _tags

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
    deltas: NonNeg | None = None
    begun_at: NonNeg | None = None  # accepted from older clients; the answer's state knows it
    begin_id: str | None = None  # likewise
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


def _refused(e: AnswerError) -> Response:
    body: dict[str, Any] = {"error": "answer", "message": str(e), "answer": e.answer}
    if isinstance(e, AnswerOrderError):
        body.update(error="out_of_order", expected_index=e.expected, first_index=e.got)
        return _JSON(body, status_code=409)
    if isinstance(e, AnswerIncompleteError):
        body.update(error="incomplete", logged=e.logged, deltas=e.deltas, missing=list(e.missing))
        return _JSON(body, status_code=409)
    if isinstance(e, AnswerClosedError):
        body.update(error="answer_ended", n=e.n)
        return _JSON(body, status_code=409)
    if isinstance(e, AnswerNotFoundError):
        body["error"] = "answer_not_found"
        return _JSON(body, status_code=404)
    if isinstance(e, AnswerTooLargeError):
        body.update(error="answer_too_large", size=e.size, limit=e.limit, next_index=e.logged)
        return _JSON(body, status_code=413)
    if isinstance(e, AnswerBatchMismatchError):
        body.update(error="batch_mismatch", first_index=e.first)
        return _JSON(body, status_code=422)
    return _JSON(body, status_code=409)


# --------------------------------------------------------------------------- begin


async def begin(gw: Gateway, request: Request, sid: str) -> Response:
    cond = preconditions(request)
    req = convert(decode_json(await read_body(request, gw.max_body)), BeginIn)
    answer = new_answer_id()
    incarnation = cond.incarnation
    if cond.idempotency_key is not None:
        # the id is derived from the key and the life: the same key in a later life of the id (a
        # key made of turn and step) begins another answer, so a writer of the old life never
        # reaches the new one; the begin is pinned to that life (a replace in between: 409)
        if incarnation is None:
            head = await gw.store.head(sid)
            if head is None:
                raise SessionNotFoundError(sid)
            incarnation = head.header.incarnation or legacy_incarnation(head.header.created_at)
        key = f"{sid}\0{incarnation}\0{cond.idempotency_key}"
        answer = hashlib.sha256(key.encode()).hexdigest()[:10]
    try:
        begun = await gw.store.answer_begin(
            sid, answer, turn=req.turn, step=req.step, incarnation=incarnation, ttl_ms=LIVE_TTL_MS
        )
    except AnswerError as e:
        return _refused(e)
    body = {"answer": answer, "n": begun.n, "incarnation": begun.incarnation, "begin_id": begun.begin_id}
    return _JSON(body, status_code=201, headers=_tags(begun.n, begun.incarnation))


# --------------------------------------------------------------------------- deltas


def _delta(answer: str, index: int, d: DeltaIn, path: str) -> Delta:
    if d.kind == TOOL_CALL:
        if not d.call_id:
            raise Unprocessable("a tool-call delta names its call (a non-empty callId)", path + ".callId")
    elif d.call_id is not None or d.name is not None:
        field = "callId" if d.call_id is not None else "name"
        raise Unprocessable(f"only a tool-call delta has a {field}", f"{path}.{field}")
    return Delta(answer=answer, index=index, kind=d.kind, text=d.text, call_id=d.call_id, name=d.name)


async def deltas(gw: Gateway, request: Request, sid: str) -> Response:
    answer = _answer_of(request)
    cond = preconditions(request)
    req = convert(decode_json(await read_body(request, gw.max_body)), DeltasIn)
    if not req.deltas:
        return await _beat(gw, sid, answer, cond.incarnation)
    if len(req.deltas) > MAX_DELTAS:
        raise TooLarge(f"a batch holds at most {MAX_DELTAS} deltas; this one has {len(req.deltas)}", "batch_too_large")
    batch = [_delta(answer, req.first_index + i, d, f"$.deltas[{i}]") for i, d in enumerate(req.deltas)]
    try:
        ack = await gw.store.answer_deltas(
            sid, answer, req.first_index, batch, turn=req.turn, step=req.step,
            incarnation=cond.incarnation, ttl_ms=LIVE_TTL_MS,
        )  # fmt: skip
    except AnswerTooLargeError as e:
        return _refused(e)
    except InvalidEntryError as e:
        raise entry_error(e, "") from None
    except AnswerError as e:
        return _refused(e)
    head = await gw.store.head(sid)
    n = head.n if head is not None else (ack.row_n or 0) + 1
    inc = head.header.incarnation if head is not None else None
    body = {"n": n, "next_index": ack.logged, "entries": []}
    return _JSON(body, status_code=201, headers=_tags(n, inc))


async def _beat(gw: Gateway, sid: str, answer: str, incarnation: str | None) -> Response:
    """An empty batch: the writer is alive but has nothing to send (a model thinking, a long tool
    call). The protocol's beat (``lua/answer.lua``, as `Session.stream`'s heartbeat): the answer's
    last-write time and its expiries are refreshed, so `repair` does not take it for dead; refused
    like a batch for an answer that ended (409 ``answer_ended``), another life's (409
    ``session_replaced``) or an unknown one (404). Nothing is written; 200 ``{n, next_index}``."""
    try:
        await gw.store.answer_beat(sid, answer, incarnation=incarnation, ttl_ms=LIVE_TTL_MS)
    except AnswerError as e:
        return _refused(e)
    st = (await gw.store.answer_states(sid, [answer])).get(answer)
    head = await gw.store.head(sid)
    if head is None:
        raise SessionNotFoundError(sid)
    body: dict[str, Any] = {"n": head.n, "next_index": st.logged if st is not None else None, "entries": []}
    return _JSON(body, status_code=200, headers=_tags(head.n, head.header.incarnation))


# --------------------------------------------------------------------------- end


def _expected(cond: Preconditions, req: EndIn) -> int | None:
    if cond.expected is not None and req.expected_n is not None and cond.expected != req.expected_n:
        raise _BadRequest("If-Match and expected_n disagree")
    return cond.expected if cond.expected is not None else req.expected_n


async def _logged_chunks(
    gw: Gateway, sid: str, answer: str, pinned: str | None
) -> tuple[list[Any], int, str | None, bool]:
    """The answer's deltas in the log, assembled by index (its rows' ``seq``), the count of the
    contiguous run from 0, its life, and whether it has ended (a retried end: the script answers
    the entry the first one wrote).

    The refusals come in the script's order (``lua/answer.lua``): no session, another life than
    the one pinned, no such answer, an answer of another life (its state outlives a delete of the
    id), and only then what the log lacks: an answer begun in an earlier life of the id is
    `SessionReplacedError`, never `incomplete` because the new life's log does not hold its rows."""
    head = await gw.store.head(sid)
    if head is None:
        raise SessionNotFoundError(sid)
    cur = head.header.incarnation or legacy_incarnation(head.header.created_at)
    if pinned and pinned != cur:
        raise SessionReplacedError(sid, f"answer {answer!r} belongs to another life of the id")
    st = (await gw.store.answer_states(sid, [answer])).get(answer)
    if st is None:
        raise AnswerNotFoundError(sid, answer)
    if st.incarnation != cur:
        raise SessionReplacedError(sid, f"answer {answer!r} belongs to another life of the id")
    if st.ended is not None:
        return [], st.logged, st.incarnation, True
    rows = await gw.store.read(sid, st.n, head.n, incarnation=st.incarnation) if st.n < head.n else []
    by_seq: dict[int, list[Any]] = {}
    for e in rows:
        if e.type == "assistant/chunk" and isinstance(e.data, dict) and e.data.get("answer") == answer:
            by_seq[int(e.data.get("seq", 0))] = replay([e]).get(answer, [])
    chunks: list[Any] = []
    while len(chunks) in by_seq:
        chunks.extend(by_seq[len(chunks)])
    return chunks, st.logged, st.incarnation, False


async def end(gw: Gateway, request: Request, sid: str) -> Response:
    answer = _answer_of(request)
    cond = preconditions(request)
    req = convert(decode_json(await read_body(request, gw.max_body)), EndIn)
    if req.begin_id is not None and not (_LIVE_ID.fullmatch(req.begin_id) and is_stream_id(req.begin_id)):
        raise Unprocessable("begin_id is a live stream id (<ms>-<seq>), as the begin answered", "$.begin_id")
    expected = _expected(cond, req)
    try:
        chunks, logged, inc, over = await _logged_chunks(gw, sid, answer, cond.incarnation)
        count = logged if req.deltas is None else req.deltas
        if not over and (len(chunks) != logged or count != logged):
            raise AnswerIncompleteError(sid, answer, min(len(chunks), logged), count)
        content = req.content if req.content is not None else assemble(chunks)
        closing: NewEntry
        if req.reason == "committed":
            closing = answer_message(answer, req.turn, req.step, content, req.usage, req.meta)
        else:
            closing = interrupted_mark(
                answer, req.turn, req.step, req.cause, count, content, req.meta, max_bytes=gw.store.max_entry_bytes
            )
        ended = await gw.store.answer_end(
            sid, answer, deltas=count, reason=req.reason, closing=closing, expected=expected,
            turn=req.turn, step=req.step, incarnation=cond.incarnation or inc, grace_ms=GRACE_MS,
        )  # fmt: skip
    except AnswerTooLargeError as e:
        return _refused(e)
    except InvalidEntryError as e:
        raise entry_error(e, "") from None
    except AnswerError as e:
        return _refused(e)
    entries = await gw.store.read(sid, ended.n, ended.n + 1) if ended.n is not None else []
    head = await gw.store.head(sid)
    n = head.n if head is not None else (ended.n or 0) + 1
    headers = _tags(n, head.header.incarnation if head is not None else inc)
    return _JSON({"n": n, "entries": entries}, status_code=201, headers=headers)
