"""Our own JSONL: what `export_session` writes and `import_path` reads back exactly.

::

    {"_type":"redis-session","version":1,"header":{"id":…,"format_version":1,"created_at":…,…},"n":3}
    {"n":0,"time":1718000000000,"type":"user/message","data":{"content":"hi"}}
    {"n":1,"time":…,"type":"assistant/message","data":{…},"meta":{…}}
    {"n":2,"time":…,"type":"tool/result","data":{…},"surface":{"surfaceOp":"append"}}

Line 1 holds the header and the number of entries (a truncated file is caught); each further line
is one stored entry (``n, time, type, data, meta?, surface?``). A branch exports its *stitched*
log (entries from 0) and its header without ``parent``/``at``: the file stands alone and imports
as a root session; line 1 records where it was branched from (``"branched_from": {"parent",
"at"}``), for information only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct, field

from ..errors import ImportFormatError
from ..model import FORMAT_VERSION, Entry, NewEntry, SessionHead, SessionHeader
from .common import Bad, Source, convert, ijson_object

FORMAT = "redis-session"
EXPORT_TYPE = "redis-session"
EXPORT_VERSION = 1

NonNeg = Annotated[int, Meta(ge=0)]


class HeaderLine(Struct, forbid_unknown_fields=True):
    """Line 1 of an export."""

    type_: str = field(name="_type")
    version: int
    header: dict[str, Any]
    n: NonNeg
    exported_at: Any = None
    branched_from: Any = None


class EntryLine(Struct, forbid_unknown_fields=True):
    """Every further line: one stored entry."""

    n: NonNeg
    time: NonNeg
    type: str
    data: dict[str, Any]
    meta: dict[str, Any] | None = None
    surface: dict[str, Any] | None = None


def detect(first: dict[str, Any]) -> bool:
    return first.get("_type") == EXPORT_TYPE


def _header(obj: dict[str, Any]) -> tuple[SessionHeader, Any, int]:
    line = convert(obj, HeaderLine)
    if line.version != EXPORT_VERSION:
        raise Bad(f"export version {line.version!r} is not supported (expected {EXPORT_VERSION})")
    unknown = set(line.header) - set(SessionHeader.__struct_fields__)
    if unknown:
        raise Bad(f"unknown header fields: {sorted(unknown)}")
    sid = line.header.get("id")
    if not isinstance(sid, str):
        raise Bad("header.id must be a string")
    fields = {k: v for k, v in line.header.items() if k not in ("parent", "at")}  # imports as a root
    fields["id"] = "x"  # validated separately, with its own message
    hdr = convert(fields, SessionHeader, "header.")
    if hdr.format_version != FORMAT_VERSION:
        raise Bad(f"header.format_version {hdr.format_version} is not supported")
    for name in ("created_at", "delegation_depth"):
        value = getattr(hdr, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise Bad(f"header.{name} must be an integer >= 0")
    return msgspec.structs.replace(hdr, id=sid), sid, line.n


def parse(source: Source) -> tuple[SessionHeader, list[NewEntry], list[int]]:
    lines = source.nonblank()
    first = next(lines)
    try:
        header, _sid, expected = _header(ijson_object(first))
    except Bad as e:
        raise ImportFormatError(source.path, first.no, f"bad header line: {e}") from None
    entries: list[NewEntry] = []
    numbers: list[int] = []
    for line in lines:
        try:
            row = convert(ijson_object(line), EntryLine)
            if row.n != len(entries):
                raise Bad(f"entry n={row.n} out of sequence: expected n={len(entries)}")
        except Bad as err:
            raise ImportFormatError(source.path, line.no, str(err), session_id=header.id) from None
        entries.append(NewEntry(row.type, row.data, row.meta, row.surface, row.time))
        numbers.append(line.no)
    if len(entries) != expected:
        raise ImportFormatError(
            source.path,
            None,
            f"the header announces n={expected} entries but the file holds {len(entries)} (truncated or edited)",
            session_id=header.id,
        )
    return header, entries, numbers


# --------------------------------------------------------------------------- export

_encoder = msgspec.json.Encoder()


def _header_dict(header: SessionHeader) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": header.id,
        "format_version": header.format_version,
        "created_at": header.created_at,
        "delegation_depth": header.delegation_depth,
    }
    if header.title is not None:
        out["title"] = header.title
    if header.origin is not None:
        out["origin"] = header.origin
    return out


def first_line(head: SessionHead) -> str:
    first: dict[str, Any] = {
        "_type": EXPORT_TYPE,
        "version": EXPORT_VERSION,
        "header": _header_dict(head.header),
        "n": head.n,
    }
    if head.header.parent is not None:
        first["branched_from"] = {"parent": head.header.parent, "at": head.header.at}
    return _encoder.encode(first).decode() + "\n"


def entry_lines(page: Iterable[Entry]) -> Iterator[str]:
    return (_encoder.encode(e).decode() + "\n" for e in page)
