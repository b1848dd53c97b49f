"""Raw stream rows of a session's log, decoded into `Entry` objects in one msgspec pass.

Below both the store's reads and the doctor's walk of a stream (`redis.doctor`), so neither has
to import the other.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

import msgspec

from ..errors import SessionCorruptError
from ..model import ENTRY_LIST_DECODER, Entry

_json = msgspec.json.Encoder()


_CHUNK = 256
"""Rows spliced and decoded per msgspec pass: a chunk's pieces are still in the CPU's
cache when they are joined, and its JSON when it is decoded (one 3 MB splice of a 10 000-entry
read missed the cache on every piece, and again on every byte of the decode)."""


def rows_to_entries(rows: Sequence[Any]) -> builtins.list[Entry]:
    """Decode raw XRANGE rows, `_CHUNK` rows per msgspec pass.

    The stream fields are already JSON (`data`, `meta`, `surface`) or plain tokens (`type` is
    validated against a safe alphabet, `time` is digits), so each row is spliced into one JSON
    object without re-encoding, and each chunk of them is decoded at C speed.
    """
    if len(rows) <= _CHUNK:
        return _decode_entries(_splice_rows(rows)) if rows else []
    out: builtins.list[Entry] = []
    for i in range(0, len(rows), _CHUNK):
        out += _decode_entries(_splice_rows(rows[i : i + _CHUNK]))
    return out


def take_entries(rows: builtins.list[Any]) -> builtins.list[Entry]:
    """`rows_to_entries` of a reply the caller hands over: decoded a chunk at a time from the end,
    each chunk's rows dropped before the next, so `rows` is empty afterwards and the collector's
    passes that the new entries trigger walk less and less of the reply."""
    if len(rows) <= _CHUNK:
        out = rows_to_entries(rows)
        rows.clear()
        return out
    decoded: builtins.list[builtins.list[Entry]] = []
    while rows:
        chunk = rows[-_CHUNK:]
        del rows[-_CHUNK:]
        decoded.append(_decode_entries(_splice_rows(chunk)))
        del chunk
    out = decoded.pop()
    while decoded:
        out += decoded.pop()
    return out


def _splice_rows(rows: Sequence[Any]) -> bytes:
    """Raw XRANGE rows as one JSON array of entries. The splice appends slices to one list and
    joins once: no per-row formatting, no intermediate bytes."""
    parts: builtins.list[bytes] = [b"["]
    extend = parts.extend
    for rid, f in rows:
        # ID "<n>-1" gives n; any other ID is left whole, "<n>-<seq>", and fails to decode: a
        # row added beside entry n (XADD <n>-2) is never read as a second entry n
        if len(f) == 6 and f[4] == b"data" and f[0] == b"type" and f[2] == b"time" and f[1]:
            extend(
                (b'{"n":', rid.removesuffix(b"-1"), b',"type":"', f[1], b'","time":', f[3], b',"data":', f[5], b"},")
            )
        else:
            extend(_odd_row(rid, f))
    parts[-1] = b"}]"  # the last row's "}," closes the array instead
    return b"".join(parts)


def _decode_entries(blob: bytes) -> builtins.list[Entry]:
    try:
        return ENTRY_LIST_DECODER.decode(blob)
    except msgspec.DecodeError as e:
        raise corrupt(str(e)) from None


def corrupt(why: str) -> SessionCorruptError:
    """The error of a session's stored keys edited outside redis-session (reads and writes raise it)."""
    return SessionCorruptError.because(why)


def _odd_row(rid: bytes, f: Any) -> tuple[bytes, ...]:
    """A row with `meta`/`surface` (or fields in another order): the same splice, by name. A row
    without its type, time or data (or with an empty type), or with a field twice, is corrupt:
    never read with a default, or with one of two values."""
    d = f if isinstance(f, dict) else dict(zip(f[::2], f[1::2], strict=False))
    if not isinstance(f, dict) and 2 * len(d) != len(f):  # a field given twice: which one is it?
        raise corrupt(f"the row {rid.decode(errors='replace')} gives a field twice")
    typ, tm, data = d.get(b"type"), d.get(b"time"), d.get(b"data")
    if not typ or tm is None or data is None:
        missing = (
            "an empty type"
            if typ == b""
            else "no " + ", ".join(name for name, v in (("type", typ), ("time", tm), ("data", data)) if v is None)
        )
        raise corrupt(f"the row {rid.decode(errors='replace')} has {missing}")
    try:
        type_json = _json.encode(typ.decode())
    except UnicodeDecodeError:
        raise corrupt(f"the row {rid.decode(errors='replace')} has a type that is not UTF-8") from None
    out: tuple[bytes, ...] = (
        b'{"n":', rid.removesuffix(b"-1"),
        b',"type":', type_json,
        b',"time":', tm,
        b',"data":', data,
    )  # fmt: skip
    if b"meta" in d:
        out += (b',"meta":', d[b"meta"])
    if b"surface" in d:
        out += (b',"surface":', d[b"surface"])
    return (*out, b"},")
