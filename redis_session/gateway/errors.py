"""Expected failures as JSON answers: which exception becomes which status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidSessionIdError, SessionError, SessionNotFoundError, StoreUnavailableError
from .common import _BadRequest, _error, log

Endpoint = Callable[[Request], Awaitable[Response]]


def guarded(fn: Endpoint) -> Endpoint:
    """Map every expected failure to a JSON answer: bad input never becomes a 500."""

    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except (_BadRequest, InvalidSessionIdError) as e:
            return _error(400, "bad_request", str(e))
        except SessionNotFoundError as e:
            return _error(404, "not_found", str(e))
        except StoreUnavailableError as e:
            log.warning("store unavailable: %s", e)
            return _error(503, "unavailable", "the store is unreachable", {"Retry-After": "2"})
        except ValueError as e:  # the store's own argument checks (limit, cursor, range)
            return _error(400, "bad_request", str(e))
        except SessionError as e:
            log.exception("gateway request failed")
            return _error(500, "internal", type(e).__name__)

    return endpoint


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return _error(exc.status_code, codes.get(exc.status_code, "error"), str(exc.detail), exc.headers)


async def server_error(request: Request, exc: Exception) -> Response:
    return _error(500, "internal", "internal error")
