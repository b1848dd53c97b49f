"""What every part of the gateway shares: JSON answers, query and path parsing, the session route."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote_to_bytes

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Scope

from ..keys import validate_session_id
from ..model import SessionHead, SessionHeader
from ..projection.messages import Message

log = logging.getLogger("redis_session.gateway")

MessagesFn = Callable[[str], Awaitable[Sequence[Message]]]
"""Where `/messages` gets a session's projection: ``async (session_id) -> [Message]``."""

FORMATS = ("openai", "anthropic", "neutral")
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
"""Liveness and readiness: answered without a token and whatever the Host (an orchestrator's probe
names the pod's IP); they carry no session data."""
DEFAULT_ENTRY_LIMIT = 1000
MAX_ENTRY_LIMIT = 10_000
_INT = re.compile(r"[0-9]{1,15}")
_json = msgspec.json.Encoder()


# --------------------------------------------------------------------------- JSON helpers


def _header_dict(h: SessionHeader) -> dict[str, Any]:
    # every field, defaults included: API clients should not need to know the defaults
    return msgspec.structs.asdict(h)


def _head_dict(h: SessionHead) -> dict[str, Any]:
    return {
        "id": h.header.id,
        "header": _header_dict(h.header),
        "n": h.n,
        "updated_at": h.updated_at,
        "last_cut": h.last_cut,
    }


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


def _error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return _JSON({"error": code, "message": message}, status_code=status, headers=headers)


class _BadRequest(Exception):
    pass


def query_arg(request: Request, name: str) -> str | None:
    """The value of query parameter `name` (None: not sent). One rule for every query string
    holds before any route runs (`routes._query_problem`, in the gateway's guard): a parameter
    sent twice or empty is already a 400, so a route reads the one value there is. Without a query
    string (every append) no query is parsed."""
    if not request.scope.get("query_string"):
        return None
    return request.query_params.get(name)


_BOOLS = {"1": True, "true": True, "0": False, "false": False}


def _bool_arg(request: Request, name: str) -> bool:
    """A flag: ``1`` or ``true`` on, ``0`` or ``false`` (or absent) off; anything else a 400 (a
    ``?deltas=yes`` silently read as off would be a stream without what the client asked for)."""
    raw = query_arg(request, name)
    if raw is None:
        return False
    if raw not in _BOOLS:
        raise _BadRequest(f"{name} is 1, true, 0 or false, got {raw[:40]!r}")
    return _BOOLS[raw]


def _int_arg(request: Request, name: str, default: int | None, lo: int = 0, hi: int | None = None) -> int | None:
    raw = query_arg(request, name)
    if raw is None:
        return default
    if not _INT.fullmatch(raw):
        raise _BadRequest(f"{name} must be a non-negative integer, got {raw[:40]!r}")
    v = int(raw)
    if v < lo or (hi is not None and v > hi):
        raise _BadRequest(f"{name} must be in [{lo}, {hi if hi is not None else '∞'}], got {v}")
    return v


def _session_path(scope: Scope) -> tuple[str, str | None]:
    """(session id, sub-resource) of ``/sessions/{id}[/{sub}]``, decoded from the raw path (a
    streamed answer's sub-resource is ``answers/{answer}/{action}``, `route_key` names its route).

    The decoded ``path`` cannot tell ``a%2Fb`` (one id) from ``a/b``; the raw path can."""
    raw: bytes | None = scope.get("raw_path")
    root = scope.get("root_path", "").encode()
    rel: bytes | None = None
    if raw is not None:
        for base in (root + b"/sessions/", b"/sessions/"):
            if raw.startswith(base):
                rel = raw[len(base) :]
                break
    if rel is None:  # a server without raw_path: the decoded path is the best there is
        path: str = scope["path"]
        rel = path[path.index("/sessions/") + len("/sessions/") :].encode()
        parts = rel.split(b"/", 1)
    else:
        parts = rel.split(b"/")
        if len(parts) == 4 and parts[1] == b"answers":  # /answers/{answer}/{deltas,end}
            parts = [parts[0], b"/".join(parts[1:])]
        elif len(parts) > 2:
            raise HTTPException(404, "no such route")
    try:
        sid = unquote_to_bytes(parts[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise _BadRequest("the session id is not valid UTF-8 once percent-decoded") from None
    sub = parts[1].decode("latin-1") if len(parts) > 1 else None
    validate_session_id(sid)
    return sid, sub


class _SessionRoute(Route):
    """``/sessions/...`` whatever follows: Starlette's path pattern stops at a decoded newline, but
    an id with one must still reach the handler, to be refused with a 400 (not a 404)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http":
            path: str = scope["path"]
            root: str = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            if path.startswith("/sessions/"):  # what the pattern gives for "/sessions/-", without a regex
                child = {"endpoint": self.endpoint, "path_params": {**scope.get("path_params", {}), "rest": "-"}}
                return (Match.FULL if not self.methods or scope["method"] in self.methods else Match.PARTIAL), child
        return Match.NONE, {}


def route_key(sub: str | None) -> tuple[str | None, str | None]:
    """(route, answer id) of a sub-resource: ``answers/a1b2/deltas`` is route
    ``answers/{answer}/deltas`` of answer ``a1b2``; any other is its own route, without answer."""
    if sub is not None and sub.startswith("answers/"):
        parts = sub.split("/")
        if len(parts) == 3:
            return f"answers/{{answer}}/{parts[2]}", parts[1]
    return sub, None
