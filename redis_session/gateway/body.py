"""What a write request carries: its body (capped before it is parsed), its entries, and its
preconditions (``If-Match``, ``X-Session-Incarnation``, ``Idempotency-Key``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct
from starlette.requests import ClientDisconnect, Request

from ..errors import InvalidEntryError
from ..model import MAX_JSON_DEPTH, MAX_TTL, NewEntry, NotIJsonError, check_ijson
from .common import _BadRequest, query_arg

DEFAULT_MAX_BODY = 16 << 20
"""Request bodies larger than this answer 413 before any of it is parsed."""

T = TypeVar("T")
NonNeg = Annotated[int, Meta(ge=0)]


class TooLarge(Exception):
    """A 413: the body, an entry or a batch is over its limit. `code` names which."""

    def __init__(self, message: str, code: str = "too_large") -> None:
        super().__init__(message)
        self.code = code


class Unprocessable(Exception):
    """A 422: well-formed JSON that is not a valid request; `path` points at the field."""

    def __init__(self, message: str, path: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.index = index


# --------------------------------------------------------------------------- bodies


class EntryIn(Struct, forbid_unknown_fields=True):
    """One entry to append: ``{type, data, meta?, surface?, time?}`` (docs/design.md §2)."""

    type: str
    data: dict[str, Any]
    meta: dict[str, Any] | None = None
    surface: Any = None
    time: NonNeg | None = None

    def new(self) -> NewEntry:
        return NewEntry(self.type, self.data, self.meta, self.surface, self.time)


class BatchIn(Struct, forbid_unknown_fields=True):
    entries: list[EntryIn]


class CreateIn(Struct, forbid_unknown_fields=True, kw_only=True):
    id: str | None = None
    title: str | None = None
    origin: Any = None
    delegation_depth: NonNeg | None = None
    ttl: Annotated[float, Meta(gt=0, le=MAX_TTL)] | None = None
    entries: list[EntryIn] = []
    created_at: Annotated[int, Meta(ge=1, le=9_999_999_999_999)] | None = None


class BranchIn(Struct, forbid_unknown_fields=True, kw_only=True):
    at: NonNeg
    id: str | None = None
    delegation_depth: NonNeg | None = None
    title: str | None = None
    origin: Any = None


class ForkIn(Struct, forbid_unknown_fields=True, kw_only=True):
    boundary: int | None = None
    id: str | None = None


class NoFieldsIn(Struct, forbid_unknown_fields=True):
    """The body of a route that takes no fields (repair, delete): empty, or ``{}``."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, read as a stream and refused (413) as soon as it passes `limit` bytes:
    an oversized body is never buffered whole, let alone parsed."""
    for name, value in request.scope["headers"]:
        if name == b"content-length":
            declared = value.strip()
            if declared.isdigit() and int(declared) > limit:
                raise TooLarge(f"the request body is {int(declared)} bytes; the limit is {limit}", "body_too_large")
            break
    if hasattr(request, "_body"):  # read already (Starlette keeps it): what `request.stream()` gives
        return request._body
    chunks: list[bytes] = []
    size = 0
    receive = request.receive
    while True:  # what `request.stream()` does, without an async generator per request
        message = await receive()
        if message["type"] != "http.request":
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            continue
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is over the limit of {limit} bytes", "body_too_large")
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            request._stream_consumed = True
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


MAX_DEPTH = MAX_JSON_DEPTH
"""Arrays and objects nest at most this deep in a request body."""


def decode_json(raw: bytes) -> Any:
    """The body as JSON (an empty body is ``{}``; a blank one, whitespace only, a 400): I-JSON
    (RFC 7493), so every client reads it back as it was sent. 400 for what is not JSON (NaN and
    Infinity included), not UTF-8, or holds a lone surrogate; 422 naming the field for a duplicate
    member name, nesting deeper than `MAX_DEPTH`, or an integer beyond ±(2^53 - 1) (`check_ijson`,
    which the importers share). Never a RecursionError, whatever the nesting."""
    if not raw:
        return {}
    if not raw.strip():  # not empty, and no JSON: what a client meant by it is anyone's guess
        raise _BadRequest("the request body is blank: send no body at all, or JSON")
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise _BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise Unprocessable(f"the request body nests deeper than {MAX_DEPTH} levels", "$") from None
    try:
        check_ijson(value, raw)
    except NotIJsonError as e:
        raise Unprocessable(str(e), e.path) from None
    return value


async def no_fields(request: Request, limit: int) -> None:
    """Check the body of a route that takes no fields (repair, delete) with the one parser every
    write route uses: empty or ``{}``; anything else is a 400/422 before anything is written."""
    convert(decode_json(await read_body(request, limit)), NoFieldsIn)


def convert(value: Any, type: type[T], where: str = "$") -> T:
    """`value` as `type`, or a 422 naming the field (``$.entries[2].type``)."""
    try:
        return msgspec.convert(value, type)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = re.search(r" - at `\$(.*)`$", msg)
        path = where + (m.group(1) if m else "")
        unknown = re.match(r"Object (?:contains unknown|missing required) field `([^`]*)`", msg)
        if unknown:
            path += "." + unknown.group(1)
        raise Unprocessable(msg, path) from None


def parse_entries(raw: bytes, max_batch: int) -> tuple[list[NewEntry], str]:
    """The entries of an append body, and the JSON path of the entry list (for error paths).

    One entry ``{type, data, …}``, a batch ``{"entries": [...]}``, or a bare list ``[...]``."""
    body = decode_json(raw)
    if isinstance(body, list):
        items, base = body, "$"
    elif isinstance(body, dict) and "entries" in body:
        items, base = body["entries"], "$.entries"
        convert({k: v for k, v in body.items() if k != "entries"} | {"entries": []}, BatchIn)
    elif isinstance(body, dict):
        return [convert(body, EntryIn).new()], ""
    else:
        raise Unprocessable('the body is an entry, {"entries": [...]} or a list of entries', "$")
    if not isinstance(items, list):
        raise Unprocessable("entries must be a list", base)
    if not items:
        raise Unprocessable("a batch holds at least one entry", base)
    if len(items) > max_batch:
        raise TooLarge(f"a batch holds at most {max_batch} entries; this one has {len(items)}", "batch_too_large")
    return [e.new() for e in convert(items, list[EntryIn], base)], base


def entry_path(base: str, index: int | None) -> str:
    """The path of entry `index` of a body whose entry list is at `base` ("" for a single entry)."""
    if base == "":
        return "$"
    return base if index is None else f"{base}[{index}]"


def entry_error(e: InvalidEntryError, base: str) -> Exception:
    """The store's `InvalidEntryError` for this body: a 413 for a size limit, else a 422 whose
    path names the entry and the field within it (as far as the message tells)."""
    msg = str(e)
    if "; the limit is " in msg or "a batch holds at most" in msg:
        return TooLarge(msg, "entry_too_large" if "; the limit is " in msg else "batch_too_large")
    return Unprocessable(msg, entry_path(base, e.index) + _field_of(msg), e.index)


def header_error(e: InvalidEntryError) -> Unprocessable | None:
    """The store's `InvalidEntryError` about a header field a create or branch body gives
    (``title``, ``origin``: their size limits) as a 422 naming it; None for any other."""
    field = str(e).split(" ", 1)[0]
    return Unprocessable(str(e), f"$.{field}") if field in ("title", "origin") else None


_FIELD_PREFIXES = (("meta", ".meta"), ("time", ".time"), ("entry type", ".type"), ("data", ".data"))


def _field_of(msg: str) -> str:
    """The field an entry error is about, from its wording (docs: model.encode_entry)."""
    rest = re.sub(r"^entry \d+: ", "", msg)
    at = re.search(r" - at `\$(.*)`$", rest)
    sub = at.group(1) if at else ""
    if "surface" in rest:
        return ".surface" + (sub if rest.startswith("invalid surface") else "")
    for prefix, field in _FIELD_PREFIXES:
        if rest.startswith(prefix):
            return field
    if rest.startswith("cut.before"):
        return ".data.before"
    if re.match(r"[A-Za-z0-9][A-Za-z0-9_.:/|+-]*: ", rest):  # "<type>: <schema error>": the data
        return ".data" + sub
    return ""


# --------------------------------------------------------------------------- preconditions

# an entity tag as the gateway sends it in ETag: the n (no leading zeros), the life optional; a
# weak tag (W/) never matches If-Match (RFC 9110 strong comparison)
_IF_MATCH = re.compile(r'(?P<q>"?)(0|[1-9][0-9]{0,14})(?:;([0-9A-Za-z_.:-]{1,64}))?(?P=q)')
"""Quoted (``"3"``) or bare (``3``), never half-quoted (``"3``, ``3"``)."""


@dataclass(frozen=True)
class Preconditions:
    """``If-Match: "<n>"`` (or ``"<n>;<incarnation>"``) and ``X-Session-Incarnation``.

    `expected` None: append at the end (``If-Match: *`` or none). `incarnation` pins the life of
    the id the request was meant for."""

    expected: int | None = None
    incarnation: str | None = None
    idempotency_key: str | None = None


def single_value(values: list[str], name: str) -> str | None:
    """The one value of a header or query parameter that names a precondition: sent twice it is
    ambiguous (which life, which n?) and refused, whatever a proxy or a client library meant."""
    if len(values) > 1:
        raise _BadRequest(f"{name} was sent {len(values)} times: send it once")
    return values[0] if values else None


def preconditions(request: Request) -> Preconditions:
    """The request's preconditions, read once per request (the pin check and the handler ask)."""
    found: Preconditions | None = request.scope.get(_PRECONDITIONS)
    if found is None:
        found = request.scope[_PRECONDITIONS] = _read_preconditions(request)
    return found


_PRECONDITIONS = "redis_session.preconditions"


_PRECONDITION_HEADERS = (b"if-match", b"x-session-incarnation", b"idempotency-key")


def _read_preconditions(request: Request) -> Preconditions:
    expected: int | None = None
    incarnation: str | None = None
    # the three headers in one pass over the request's (lower-case, as ASGI gives them) headers
    found: dict[bytes, list[str]] = {}
    for name, value in request.scope["headers"]:
        if name in _PRECONDITION_HEADERS:
            found.setdefault(name, []).append(value.decode("latin-1"))
    raw = single_value(found.get(b"if-match", []), "If-Match")
    if raw is not None and raw.strip() != "*":
        m = _IF_MATCH.fullmatch(raw.strip())
        if m is None:
            raise _BadRequest('If-Match is "<n>", "<n>;<incarnation>" or *, got ' + repr(raw[:80]))
        expected, incarnation = int(m.group(2)), m.group(3)
    pinned = single_value(found.get(b"x-session-incarnation", []), "X-Session-Incarnation")
    if pinned is not None:
        pinned = pinned.strip()
        if not 1 <= len(pinned) <= 64 or (incarnation is not None and pinned != incarnation):
            raise _BadRequest("X-Session-Incarnation is 1-64 characters and agrees with If-Match")
        incarnation = pinned
    query = query_arg(request, "incarnation")
    if query is not None:
        if not 1 <= len(query) <= 64 or (incarnation is not None and query != incarnation):
            raise _BadRequest("?incarnation= is 1-64 characters and agrees with X-Session-Incarnation and If-Match")
        incarnation = query
    key = single_value(found.get(b"idempotency-key", []), "Idempotency-Key")
    if key is not None and not 1 <= len(key) <= 256:
        raise _BadRequest("Idempotency-Key is 1-256 characters")
    return Preconditions(expected, incarnation, key)


def pinned_incarnation(request: Request) -> str | None:
    """The life of the id a request is pinned to: ``X-Session-Incarnation``, the incarnation of
    ``If-Match: "<n>;<incarnation>"`` or ``?incarnation=`` (EventSource cannot set headers); 400
    when they disagree. None: not pinned."""
    return preconditions(request).incarnation
