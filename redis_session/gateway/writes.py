"""The write routes: create, append, branch, fork, delete, draft, repair.

Every write goes through the same store and `Sessions` calls as Python code does, so it is
validated by the same rules and lands atomically or not at all. Concurrency is HTTP's:
``If-Match: "<n>"`` is the expected n (none or ``*``: append at the end), a stale one answers 412
with the actual n (body and ``ETag``); every success answers the new n as ``ETag``. An
``X-Session-Incarnation`` (or ``If-Match: "<n>;<incarnation>"``) pins the life of the id: a
session deleted and created again since answers 409 ``session_replaced``. ``Idempotency-Key`` is
the store's idempotency key: a retried append returns the entries it wrote, never writes twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..errors import (
    InvalidEntryError,
    SessionConflictError,
    SessionNotFoundError,
    SessionReplacedError,
)
from ..keys import validate_session_id
from ..model import Entry, NewEntry, SessionHead
from ..sessions import Session, keyed_child_id, keyed_session_id
from .auth import principal
from .body import (
    BranchIn,
    CreateIn,
    ForkIn,
    Preconditions,
    TooLarge,
    Unprocessable,
    convert,
    decode_json,
    entry_error,
    header_error,
    no_fields,
    parse_entries,
    pinned_incarnation,
    preconditions,
    read_body,
)
from .common import _JSON, _head_dict
from .context import Gateway


def _tags(n: int, incarnation: str | None) -> dict[str, str]:
    headers = {"ETag": f'"{n}"'}
    if incarnation:
        headers["X-Session-Incarnation"] = incarnation
    return headers


def _created(head: SessionHead) -> Response:
    return _JSON(_head_dict(head), status_code=201, headers=_tags(head.n, head.header.incarnation))


def _written(entries: Sequence[Entry], n: int, incarnation: str | None, status: int = 201) -> Response:
    return _JSON({"n": n, "entries": entries}, status_code=status, headers=_tags(n, incarnation))


def _head_of(s: Session) -> SessionHead:
    return SessionHead(header=s.header, n=s.n, updated_at=s.header.created_at, last_cut=s.last_cut)


# --------------------------------------------------------------------------- append


async def append(gw: Gateway, request: Request, sid: str) -> Response:
    cond = preconditions(request)
    batch, base = parse_entries(await read_body(request, gw.max_body), gw.max_batch)
    try:
        stored = await _put(gw, sid, cond, batch)
    except InvalidEntryError as e:
        raise entry_error(e, base) from None
    return _written(stored, stored[-1].n + 1, cond.incarnation)


async def _put(gw: Gateway, sid: str, cond: Preconditions, batch: list[NewEntry]) -> list[Entry]:
    store, expected, key = gw.store, cond.expected, cond.idempotency_key
    if expected is not None and any(e.surface is not None for e in batch):
        # a surface op is checked against the projection it was written for, as a Session handle
        # does (check_surface at n, then the put with expected_n = n)
        head = await store.head(sid)
        if head is None:
            raise SessionNotFoundError(sid)
        if cond.incarnation is not None and head.header.incarnation != cond.incarnation:
            raise SessionReplacedError(sid)
        if head.n < expected:  # no retry of an earlier request can be behind the log
            raise SessionConflictError(sid, expected, head.n)
        if head.n == expected:
            return await Session(gw.sessions, head).append_many(batch, idempotency_key=key)
    return await store.put(sid, expected, batch, idempotency_key=key, incarnation=cond.incarnation)


# --------------------------------------------------------------------------- create, branch, fork


async def create(gw: Gateway, request: Request) -> Response:
    who = principal(request.scope)
    cond = preconditions(request)
    body = decode_json(await read_body(request, gw.max_body))
    if isinstance(body, dict) and ("parent" in body or "at" in body):
        raise Unprocessable("a branch is made with POST /sessions/{parent}/branch {at, id?}", "$.parent")
    req = convert(body, CreateIn)
    if req.id is not None:
        sid = req.id
    elif cond.idempotency_key is not None:
        # the same for every retry of the keyed request, so a retry finds the session the first
        # attempt made (`Sessions.create` replays it, or refuses another body)
        sid = keyed_session_id(cond.idempotency_key, who.prefix or "")
    else:
        sid = f"{who.prefix or ''}session-{uuid.uuid4().hex}"
    who.check_new_id(validate_session_id(sid))
    batch = [e.new() for e in req.entries]
    if len(batch) > gw.max_batch:
        raise TooLarge(f"a batch holds at most {gw.max_batch} entries", "batch_too_large")
    try:
        s = await gw.sessions.create(
            sid,
            title=req.title,
            origin=req.origin,
            delegation_depth=req.delegation_depth,
            ttl=req.ttl,
            entries=batch,
            created_at=req.created_at,
            idempotency_key=cond.idempotency_key,
        )
    except InvalidEntryError as e:
        raise header_error(e) or entry_error(e, "$.entries") from None
    return _created(_head_of(s))


async def branch(gw: Gateway, request: Request, sid: str) -> Response:
    who = principal(request.scope)
    cond = preconditions(request)
    req = convert(decode_json(await read_body(request, gw.max_body)), BranchIn)
    child = _child_id(sid, req.id, cond.idempotency_key)
    if child is not None:
        who.check_new_id(validate_session_id(child))
    try:
        s = await gw.sessions.branch(
            sid,
            req.at,
            branch_id=child,
            delegation_depth=req.delegation_depth,
            title=req.title,
            origin=req.origin,
            idempotency_key=cond.idempotency_key,
            incarnation=cond.incarnation,
        )
    except InvalidEntryError as e:  # the branch point is beyond the parent's n, or a field over its limit
        raise header_error(e) or Unprocessable(str(e), "$.at") from None
    return _created(_head_of(s))


def _child_id(parent: str, given: str | None, key: str | None) -> str | None:
    """The id a branch or fork will get, when it is known before it is made (given, or from its
    key as `Sessions` derives it): checked against the token's tenant first."""
    if given is not None or key is None:
        return given
    return keyed_child_id(parent, key)


async def fork(gw: Gateway, request: Request, sid: str) -> Response:
    who = principal(request.scope)
    cond = preconditions(request)
    req = convert(decode_json(await read_body(request, gw.max_body)), ForkIn)
    child = _child_id(sid, req.id, cond.idempotency_key)
    if child is not None:
        who.check_new_id(validate_session_id(child))
    s = await gw.sessions.fork(
        sid, req.boundary, fork_id=child, idempotency_key=cond.idempotency_key, incarnation=cond.incarnation
    )
    return _created(_head_of(s))


# --------------------------------------------------------------------------- delete, draft, repair


async def delete(gw: Gateway, request: Request, sid: str) -> Response:
    """204, or 404. With X-Session-Incarnation (or ``If-Match: "<n>;<incarnation>"``) only that
    life of the id is deleted (checked in the delete script: 409 ``session_replaced``, nothing
    deleted); an If-Match n is checked against the head first (a guard against deleting what the
    client did not see, not an atomic compare-and-delete of the n). The body is empty or ``{}``."""
    await no_fields(request, gw.max_body)
    cond = preconditions(request)
    if cond.expected is not None:
        head = await gw.store.head(sid)
        if head is None:
            raise SessionNotFoundError(sid)
        if cond.incarnation is not None and head.header.incarnation != cond.incarnation:
            raise SessionReplacedError(sid)
        if head.n != cond.expected:
            raise SessionConflictError(sid, cond.expected, head.n)
    if not await gw.sessions.delete(sid, incarnation=cond.incarnation):
        raise SessionNotFoundError(sid)
    return Response(status_code=204)


async def get_draft(gw: Gateway, request: Request, sid: str) -> Response:
    if await gw.store.head(sid) is None:
        raise SessionNotFoundError(sid)
    return _JSON({"draft": await gw.store.get_draft(sid, incarnation=pinned_incarnation(request))})


async def put_draft(gw: Gateway, request: Request, sid: str) -> Response:
    """The streaming draft other readers see (SSE ``event: draft``): a JSON object, or null to clear."""
    raw = await read_body(request, gw.max_body)
    if not raw.strip():
        raise Unprocessable("the body is the draft: a JSON object, or null to clear it", "$")
    body = decode_json(raw)
    draft = None if body is None else convert(body, dict[str, Any])
    try:  # the pinned life is checked in the draft script, with the write
        await gw.store.set_draft(sid, draft, incarnation=preconditions(request).incarnation)
    except InvalidEntryError as e:
        raise entry_error(e, "$") from None
    return Response(status_code=204)


async def repair(gw: Gateway, request: Request, sid: str) -> Response:
    """Close a turn a crashed writer left open (`Sessions.repair`); 409 while a live writer holds
    the lease. Safe to retry: a repaired session has nothing left to close. Pinned to a life
    (X-Session-Incarnation), every write of the repair is checked against it by the store. The
    body is empty or ``{}``: anything else is refused (400/422) before the repair runs."""
    await no_fields(request, gw.max_body)
    entries = await gw.sessions.repair(sid, incarnation=preconditions(request).incarnation)
    head = await gw.store.head(sid)
    n = entries[-1].n + 1 if entries else (head.n if head is not None else 0)
    return _written(entries, n, head.header.incarnation if head is not None else None, status=200)
