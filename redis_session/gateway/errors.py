"""Expected failures as JSON answers: which exception becomes which status.

400 bad_request            malformed id, parameter, header or JSON
401 unauthorized           no (known) token                          (auth middleware)
403 forbidden              the token lacks the scope, or names an id outside its tenant
404 not_found              unknown session (or one outside the token's tenant)
409 already_exists         create/branch/fork of a taken id (a fork's also carries the dsh
                           `code` SESSION_ALREADY_EXISTS; its 404, SESSION_NOT_FOUND, is not_found)
409 session_replaced       the id was deleted and created again under a pinned incarnation
409 lease_held             repair while a live writer holds the lease
412 conflict               stale If-Match: body {expected_n, actual_n}, ETag "<actual n>"
413 *_too_large            body, entry or batch over its limit
422 invalid_entry …        a body that parses but is not valid (`path` names the field)
422 idempotency_key_reused the key already landed a different batch (as the IETF
                           Idempotency-Key draft answers a reused key with another payload)
500 corrupt                the session's stored keys were edited outside redis-session
                           (`SessionCorruptError`: `redis-session doctor` names what is wrong)
503 unavailable            the store is unreachable (Retry-After)
503 store_forbidden        the gateway's own Redis user may not do this (an ACL refusal: a
                           deployment error, docs/security.md — not the caller's scope)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..errors import (
    AccessDeniedError,
    DurabilityError,
    IdempotencyKeyReusedError,
    InvalidEntryError,
    InvalidSessionIdError,
    LeaseHeldError,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionCorruptError,
    SessionError,
    SessionForkError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from .auth import Forbidden
from .body import TooLarge, Unprocessable, entry_error
from .common import _JSON, _BadRequest, _error, log

Endpoint = Callable[[Request], Awaitable[Response]]

_FORK_STATUS = {"SESSION_NOT_FOUND": 404, "SESSION_ALREADY_EXISTS": 409, "INVALID_BOUNDARY": 422, "OPEN_TURN": 422}


def _conflict(e: Exception) -> Response:
    assert isinstance(e, SessionConflictError)
    body = {"error": "conflict", "message": str(e), "expected_n": e.expected_n, "actual_n": e.actual_n}
    return _JSON(body, status_code=412, headers={"ETag": f'"{e.actual_n}"'})


def _unprocessable(e: Exception) -> Response:
    if isinstance(e, InvalidEntryError):  # not raised around an entry body (see writes): no path
        mapped = entry_error(e, "$")
        if isinstance(mapped, TooLarge):
            return _error(413, mapped.code, str(mapped))
        e = Unprocessable(str(e), None, e.index)
    assert isinstance(e, Unprocessable)
    body: dict[str, Any] = {"error": "invalid", "message": str(e)}
    if e.path is not None:
        body["path"] = e.path
    if e.index is not None:
        body["index"] = e.index
    return _JSON(body, status_code=422)


_FORK_ERROR = {"SESSION_NOT_FOUND": "not_found", "SESSION_ALREADY_EXISTS": "already_exists"}
"""A fork's 404 and 409 are every route's (`not_found`, `already_exists`): a client switching on
`error` reads a fork's as a branch's; `code` keeps the dsh code (the TypeScript client's
`SessionForkError.forkCode`)."""


def _fork(e: Exception) -> Response:
    assert isinstance(e, SessionForkError)
    error = _FORK_ERROR.get(e.code, e.code.lower())
    body: dict[str, Any] = {"error": error, "message": str(e), "code": e.code}
    if e.code == "INVALID_BOUNDARY":  # only the fork route raises it: the body's boundary
        body["path"] = "$.boundary"
    return _JSON(body, status_code=_FORK_STATUS[e.code])


def _unavailable(e: Exception) -> Response:
    log.warning("store unavailable: %s", e)
    return _error(503, "unavailable", "the store is unreachable", {"Retry-After": "2"})


def _store_forbidden(e: Exception) -> Response:
    log.error("the gateway's Redis user was refused (see docs/security.md): %s", e)
    return _error(503, "store_forbidden", "the gateway's Redis user may not do this; nothing was written")


def _corrupt(e: Exception) -> Response:
    log.error("a session's stored keys are corrupt (run redis-session doctor): %s", e)
    return _error(500, "corrupt", str(e))


def _internal(e: Exception) -> Response:
    log.exception("gateway request failed")
    return _error(500, "internal", type(e).__name__)


def _simple(status: int, code: str) -> Callable[[Exception], Response]:
    return lambda e: _error(status, code, str(e))


# most specific first: SessionReplacedError is a SessionNotFoundError, InvalidEntryError a ValueError …
_HANDLERS: list[tuple[type[Exception] | tuple[type[Exception], ...], Callable[[Exception], Response]]] = [
    (SessionConflictError, _conflict),
    (SessionReplacedError, _simple(409, "session_replaced")),
    (SessionNotFoundError, _simple(404, "not_found")),
    (SessionAlreadyExistsError, _simple(409, "already_exists")),
    (IdempotencyKeyReusedError, _simple(422, "idempotency_key_reused")),
    (SessionForkError, _fork),
    (LeaseHeldError, _simple(409, "lease_held")),
    (Forbidden, _simple(403, "forbidden")),
    # the client hung up before its body was read: nothing was written and no one reads the answer
    (ClientDisconnect, _simple(400, "client_disconnected")),
    (TooLarge, lambda e: _error(413, getattr(e, "code", "too_large"), str(e))),
    ((_BadRequest, InvalidSessionIdError), _simple(400, "bad_request")),
    ((Unprocessable, InvalidEntryError), _unprocessable),
    (DurabilityError, _simple(503, "not_durable")),
    (AccessDeniedError, _store_forbidden),
    (StoreUnavailableError, _unavailable),
    (SessionCorruptError, _corrupt),
    (ValueError, _simple(400, "bad_request")),  # the store's own argument checks (limit, cursor, range)
    (SessionError, _internal),
]


def error_response(e: Exception) -> Response | None:
    """The JSON answer to an expected failure, None for an unexpected one (a 500)."""
    for cls, answer in _HANDLERS:
        if isinstance(e, cls):
            return answer(e)
    return None


def guarded(fn: Endpoint) -> Endpoint:
    """Map every expected failure to a JSON answer: bad input never becomes a 500."""

    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as e:
            response = error_response(e)
            if response is None:
                raise
            return response

    return endpoint


class GuardedApp:
    """`guarded` as a bare ASGI app, for a `Route` to call directly: one `Request`, the handler,
    its answer, without Starlette's per-route wrapper around a function endpoint (a second
    exception-handling layer and send wrapper per request); an `HTTPException` still reaches the
    app's handler (`http_error`), one layer out."""

    __slots__ = ("fn",)

    def __init__(self, fn: Endpoint) -> None:
        self.fn = fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        response: Response | None
        try:
            response = await self.fn(request)
        except Exception as e:
            response = error_response(e)
            if response is None:
                raise
        await response(scope, receive, send)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return _error(exc.status_code, codes.get(exc.status_code, "error"), str(exc.detail), exc.headers)


async def server_error(request: Request, exc: Exception) -> Response:
    return _error(500, "internal", "internal error")
