"""What every format shares: reading a file into lines (zstd, byte-order marks, torn last lines),
decoding a line into a msgspec Struct with a message naming the field, timestamps, the results,
and the reversible mapping of foreign keys to session ids."""

from __future__ import annotations

import binascii
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from ..errors import ImportFormatError, InvalidSessionIdError, SessionError
from ..keys import escape_key, is_staging_id, unescape_key, validate_new_session_id, validate_session_id
from ..model import DEFAULT_MAX_ENTRY_BYTES, NewEntry, NotIJsonError, SessionHeader, check_ijson

Format = Literal["auto", "redis-session", "nanobot", "dsh", "tutorial"]
OnExists = Literal["error", "skip", "replace"]
Progress = Callable[[int, int], object]
S = TypeVar("S")

#: The suffixes a folder import picks up (dsh's default since 2026-07 is ``.jsonl.zstd``).
SUFFIXES = (".jsonl", ".jsonl.zstd")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ImportResult:
    """What happened to one file.

    `status` is ``imported``, ``replaced`` (an existing session of that id was deleted first),
    ``skipped`` (the id exists and ``on_exists="skip"``) or ``failed`` (`error` says why; only with
    ``errors="collect"`` or ``"stop"``). `entries` is the number of entries written. `repaired`
    lists what the importer fixed the way the original system does when it loads the file (a
    torn last line dropped, an open turn closed); `original_id` is the key the file named when
    the session was imported under a mapped id (see `key_to_session_id`).
    """

    path: str
    session_id: str | None
    format: str
    status: Literal["imported", "replaced", "skipped", "failed"]
    entries: int = 0
    error: SessionError | None = None
    repaired: tuple[str, ...] = ()
    original_id: str | None = None


@dataclass
class ParsedSession:
    """A file read and converted, ready to be written: the header, the entries and, for each
    entry, the line it came from (0 for entries the importer added)."""

    path: str
    format: str
    header: SessionHeader
    entries: list[NewEntry] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    original_id: str | None = None

    @property
    def session_id(self) -> str:
        return self.header.id


class Bad(Exception):
    """A problem with one line or field; the caller adds the file and line."""


# --------------------------------------------------------------------------- reading a file


@dataclass(frozen=True)
class Line:
    """One line of a file: its 1-based number, its bytes (no newline) and whether a newline ended
    it (the last line of a file cut short by a crash has none)."""

    no: int
    raw: bytes
    complete: bool


#: The bounds of one file, read as a stream (so neither a huge file nor a small compressed one that
#: decompresses to gigabytes can exhaust the importer's memory): its size once decompressed, its
#: number of lines (blank ones included) and, per line, `line_limit` of the entry limit. Over any
#: of them the file is refused naming the line where it was reached; nothing of it is written.
MAX_FILE_BYTES = 1 << 30
MAX_FILE_LINES = 10_000_000
_READ_SIZE = 1 << 20
# compressed bytes fed to the decompressor at once: zstd's densest block (RLE) stands for 128 KiB
# in 4 bytes, so one call yields at most ~16 MiB, however the file was made
_ZSTD_FEED = 512


def line_limit(max_entry_bytes: int) -> int:
    """The longest line a file may hold: an entry at the limit with every character escaped
    (``\\u0001`` is 6 bytes for one) and its envelope."""
    return 6 * max_entry_bytes + (64 << 10)


class Source:
    """A file's lines, read as a stream: decompressed, checked for its encoding and split as they
    are asked for (`nonblank`), each line and the whole within the bounds above. Blank lines are
    counted (line numbers stay the file's), never kept. Close it (or use it in a ``with``)."""

    def __init__(self, path: Path, *, max_line_bytes: int) -> None:
        self.path = path
        self.max_line_bytes = max_line_bytes
        self.compressed = False
        self.torn_frame = False  # a zstd file whose last frame was cut short (known at its end)
        self.notes: list[str] = []
        self._ended = 0  # lines read to their end so far
        self._file = path.open("rb")
        self._lines = self._split(self._checked(self._chunks()))
        self._first: Line | None = None

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def nonblank(self) -> Iterator[Line]:
        """The nonblank lines from the first one on. One pass: the first line (read ahead, to
        detect the format) is given again to every caller, the rest once."""
        if self._first is None:
            self._first = next(self._lines, None)
            if self._first is None:
                return
        yield self._first
        yield from self._lines

    def _too_big(self, line: int, what: str) -> ImportFormatError:
        return ImportFormatError(self.path, line, f"{what}; nothing of this file was imported")

    def _chunks(self) -> Iterator[bytes]:
        head = self._file.read(_READ_SIZE)
        if not head.startswith(_ZSTD_MAGIC):
            while head:
                yield head
                head = self._file.read(_READ_SIZE)
            return
        self.compressed = True
        yield from self._unzstd(head)

    def _unzstd(self, data: bytes) -> Iterator[bytes]:
        """Decompress concatenated zstd frames (dsh writes one per durable batch), a few bytes at
        a time. A last frame cut short yields what it holds so far and sets `torn_frame` (dsh
        keeps the complete lines in it); a corrupt complete frame is an error."""
        try:
            import zstandard
        except ImportError:  # pragma: no cover - a base dependency
            raise ImportFormatError(
                self.path, None, "the file is zstd-compressed: install the zstandard package"
            ) from None
        dctx = zstandard.ZstdDecompressor()
        dobj: Any = None  # the frame being decompressed
        while data:
            for i in range(0, len(data), _ZSTD_FEED):
                piece = data[i : i + _ZSTD_FEED]
                while piece:
                    if dobj is None:
                        dobj = dctx.decompressobj()
                    try:
                        out = dobj.decompress(piece)
                    except zstandard.ZstdError as e:
                        raise ImportFormatError(self.path, None, f"corrupt zstd frame: {e}") from None
                    if out:
                        yield out
                    piece = b""
                    if dobj.eof:
                        piece, dobj = dobj.unused_data, None
            data = self._file.read(_READ_SIZE)
        self.torn_frame = dobj is not None

    def _checked(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """`chunks` once the start of the data passed `_check_encoding` (a UTF-8 BOM dropped)."""
        head = b""
        for chunk in chunks:
            head += chunk
            if len(head) >= 200:
                break
        yield _check_encoding(self.path, head, self.notes)
        yield from chunks

    def _sized(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        size = 0
        for chunk in chunks:
            size += len(chunk)
            if size > MAX_FILE_BYTES:  # its lines up to the bound first: the error names the line it is in
                yield chunk[: len(chunk) - (size - MAX_FILE_BYTES)]
                raise self._too_big(self._ended + 1, f"the file is over {MAX_FILE_BYTES >> 20} MiB (decompressed)")
            yield chunk

    def _end_lines(self, count: int) -> int:
        """Count `count` more lines ended; the number of the last one."""
        self._ended += count
        if self._ended > MAX_FILE_LINES:
            raise self._too_big(MAX_FILE_LINES + 1, f"the file has more than {MAX_FILE_LINES:,} lines")
        return self._ended

    def _split(self, chunks: Iterator[bytes]) -> Iterator[Line]:
        # a line's bound is on its text: the CR of a CRLF end is held, then not counted
        limit = self.max_line_bytes + 1
        part: list[bytes] = []  # the line being read, as the pieces read so far
        part_len, part_blank = 0, True
        for chunk in self._sized(chunks):
            if part_blank and not chunk.strip():  # blank lines only: counted, never split nor kept
                if b"\n" in chunk:
                    self._end_lines(chunk.count(b"\n"))
                    part, part_len = [], 0
                    chunk = chunk[chunk.rfind(b"\n") + 1 :]
                if part_len + len(chunk) > limit:
                    raise self._too_long(self._ended + 1)
                part.append(chunk)
                part_len += len(chunk)
                continue
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                no = self._end_lines(1)
                if part_len + end - start > limit:
                    raise self._too_long(no)
                raw = b"".join([*part, chunk[start:end]]) if part else chunk[start:end]
                if len(raw) == limit and not raw.endswith(b"\r"):
                    raise self._too_long(no)
                part, part_len, part_blank = [], 0, True
                start = end + 1
                if raw.strip():
                    yield Line(no, raw.rstrip(b"\r"), True)
            rest = chunk[start:]
            if part_len + len(rest) > limit:
                raise self._too_long(self._ended + 1)
            part.append(rest)
            part_len += len(rest)
            part_blank = part_blank and not rest.strip()
        raw = b"".join(part)
        if len(raw) == limit and not raw.endswith(b"\r"):
            raise self._too_long(self._ended + 1)
        if raw.strip():
            yield Line(self._ended + 1, raw.rstrip(b"\r"), False)

    def _too_long(self, line: int) -> ImportFormatError:
        return self._too_big(
            line, f"the line is over {self.max_line_bytes:,} bytes, longer than any entry can be written"
        )


def read_source(path: Path, *, max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> Source:
    """Open `path` (plain or zstd-compressed JSONL) as a `Source`; its lines raise
    `ImportFormatError` for a file that is not UTF-8 (UTF-16/UTF-32, with or without a byte-order
    mark) or is over the bounds (`MAX_FILE_BYTES`, `MAX_FILE_LINES`, `line_limit`)."""
    return Source(path, max_line_bytes=line_limit(max_entry_bytes))


_UTF16_32 = (
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"),
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
    (b"\xff\xfe", "UTF-16 (little-endian)"),
    (b"\xfe\xff", "UTF-16 (big-endian)"),
)


def _check_encoding(path: Path, data: bytes, notes: list[str]) -> bytes:
    for bom, name in _UTF16_32:
        if data.startswith(bom):
            raise ImportFormatError(
                path,
                None,
                f"the file is {name}: it starts with that byte-order mark; save it as UTF-8 and import again",
            )
    if data.startswith(b"\xef\xbb\xbf"):
        notes.append("skipped the UTF-8 byte-order mark at the start of the file")
        return data[3:]
    head = data[:200]
    if b"\x00" in head:
        raise ImportFormatError(
            path,
            None,
            "the file is UTF-16 or UTF-32 without a byte-order mark, or no text at all (NUL bytes between "
            "the characters); save it as UTF-8 and import again",
        )
    return data


# --------------------------------------------------------------------------- decoding lines

_decode_json = msgspec.json.Decoder()


def json_object(line: Line) -> dict[str, Any]:
    """The line as a JSON object, or `Bad`."""
    try:
        obj = _decode_json.decode(line.raw)
    except (msgspec.DecodeError, RecursionError) as e:
        # msgspec refuses a lone surrogate escape: a low one as "invalid utf-16 surrogate pair", a
        # high one not followed by another \u escape as "Input data was truncated" (so the message
        # alone cannot tell it from a cut line: the escape in the raw bytes does).
        if "surrogate" not in str(e) and _SURROGATE_ESCAPE.search(line.raw) is None:
            raise Bad(f"invalid JSON: {e or 'nested too deeply'}") from None
        obj = _with_lone_surrogates(line, e)
    if not isinstance(obj, dict):
        raise Bad(f"expected a JSON object, got {tname(obj)}")
    return obj


def ijson_object(line: Line) -> dict[str, Any]:
    """`json_object`, and I-JSON as the gateway takes a body (`redis_session.model.check_ijson`):
    a duplicate member name, nesting deeper than 64 or an integer beyond ±(2^53 - 1) is `Bad`,
    naming the field (for a duplicate, the object holding it)."""
    obj = json_object(line)
    try:
        check_ijson(obj, line.raw)
    except NotIJsonError as e:
        raise Bad(f"{_path(e.path[1:])}: {e.problem}") from None
    return obj


def _with_lone_surrogates(line: Line, err: Exception) -> Any:
    """A line with a lone surrogate escape (``"\\ud800"``, which JavaScript's JSON.stringify writes
    for a string holding half a pair): decoded, each lone surrogate as U+FFFD (UTF-8, and so the
    store, cannot hold one). The tutorial importer keeps the line as written for its export."""
    try:
        obj = json.loads(line.raw, object_pairs_hook=dict)
    except (ValueError, RecursionError):
        raise Bad(f"invalid JSON: {err or 'nested too deeply'}") from None
    if isinstance(obj, dict) and _is_header(obj):
        header = obj.get("header")  # a redis-session export names its session in header.id
        named = [(f, obj.get(f)) for f in _ID_FIELDS]
        if obj.get("_type") == "redis-session" and isinstance(header, dict):
            named.append(("header.id", header.get("id")))
        for field, value in named:
            if isinstance(value, str) and _LONE.search(value):
                raise Bad(
                    f"{field}: the session id holds a lone surrogate escape (half of a UTF-16 pair); "
                    "a session id must be valid unicode"
                )
    return _replace_surrogates(obj)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# the fields a header line names its session by, in the four formats (tutorial ``id``/``sessionId``,
# nanobot ``key``, dsh ``id``, redis-session ``header.id``): a lone surrogate there is refused, not
# replaced
_ID_FIELDS = ("id", "sessionId", "key")


def _is_header(obj: dict[str, Any]) -> bool:
    return obj.get("type") in ("session/meta", "session") or obj.get("_type") in ("metadata", "redis-session")


def _replace_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return _LONE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_surrogates(v) for v in value]
    return value


_LONE = re.compile("[\ud800-\udfff]")


def convert(obj: dict[str, Any], typ: type[S], what: str = "") -> S:
    """`obj` as the Struct `typ`, or `Bad` naming the field (``data.turn must be an integer``)."""
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        msg = describe(e)
        raise Bad(f"{what}{msg}" if what else msg) from None


_EXPECTED = re.compile(
    r"^Expected `(?P<want>[^`]+)`(?P<bound>[^,`]*)(?:, got `(?P<got>[^`]+)`)?(?: - at `\$(?P<at>[^`]*)`)?$"
)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`(?: - at `\$(?P<at>[^`]*)`)?$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`(?: - at `\$(?P<at>[^`]*)`)?$")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.+?)(?: - at `\$(?P<at>[^`]*)`)?$")
_WORDS = {
    "int": "an integer",
    "str": "a string",
    "object": "an object",
    "array": "an array",
    "bool": "a boolean",
    "float": "a number",
    "null": "null",
}


def _path(at: str | None) -> str:
    return (at or "").lstrip(".") or "the line"


def _want(want: str) -> str:
    parts = [p.strip() for p in want.split("|")]
    words = [_WORDS.get(p, p) for p in parts]
    if set(parts) >= {"int", "float"}:
        words = ["a number", *[w for p, w in zip(parts, words, strict=True) if p not in ("int", "float")]]
    return " or ".join(words)


def describe(e: msgspec.ValidationError) -> str:
    """msgspec's message in our words: the field path, what it must be and what it is."""
    text = str(e)
    m = _EXPECTED.match(text)
    if m:
        bound = m["bound"].strip()
        got = f", got {_WORDS.get(m['got'], m['got'])}" if m["got"] else ""
        return f"{_path(m['at'])} must be {_want(m['want'])}{' ' + bound if bound else ''}{got}"
    m = _UNKNOWN.match(text)
    if m:
        where = _path(m["at"])
        return f"unknown key {m['name']!r}" + ("" if where == "the line" else f" in {where}")
    m = _MISSING.match(text)
    if m:
        where = _path(m["at"])
        return f"missing {m['name']!r}" + ("" if where == "the line" else f" in {where}")
    m = _ENUM.match(text)
    if m:
        return f"{_path(m['at'])} has an unknown value {m['value']}"
    return text


def tname(value: Any) -> str:
    if value is None:
        return "null"
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- times

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def iso_ms(value: Any, what: str) -> int:
    """An ISO date-time string as ms since the epoch; one without a zone is UTC."""
    if not isinstance(value, str):
        raise Bad(f"{what} must be an ISO date-time string, got {tname(value)}")
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise Bad(f"{what} {value[:60]!r} is not an ISO date-time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)  # naive is read as UTC: the import never depends on this machine's zone
    ms = (dt - _EPOCH) // _MS
    if ms < 0:
        raise Bad(f"{what} {value!r} is before 1970")
    return ms


def ms_iso(ms: int) -> str:
    """ms since the epoch as a naive UTC ISO string (as nanobot writes its times)."""
    return (_EPOCH + ms * _MS).replace(tzinfo=None).isoformat()


def number_ms(value: Any, what: str) -> int:
    """A millisecond timestamp given as a JSON number (int or float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Bad(f"{what} must be a number (ms), got {tname(value)}")
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise Bad(f"{what} must be a finite number >= 0, got {value!r}")
    return int(value)


def seconds_or_ms(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Bad(f"{what} must be a number (seconds or ms), got {tname(value)}")
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise Bad(f"{what} must be a finite number >= 0, got {value!r}")
    return int(value) if value > 1e11 else round(value * 1000)


# --------------------------------------------------------------------------- ids


def key_to_session_id(key: str) -> str:
    """The session id a foreign key (a nanobot key, a dsh or tutorial id) is imported under.

    A key that is a valid session id and holds no ``%`` or format character is its own id. Any
    other key has each character our ids forbid (braces, whitespace, control characters), each
    invisible format character (Unicode Cf) and each ``%`` replaced by its UTF-8 bytes as ``%XX``
    (`redis_session.keys.escape_key`: ``"tg:{1} a"`` → ``"tg:%7B1%7D%20a"``). The mapping is
    injective and `session_id_to_key` reverses it; the header's ``origin`` keeps the original key
    as well. Raises `InvalidSessionIdError` when even the mapped id is not valid (empty, longer
    than 256 characters, a lone surrogate).
    """
    return validate_session_id(escape_key(key))


def session_id_to_key(session_id: str) -> str:
    """The key `key_to_session_id` mapped to `session_id` (ids without ``%`` are their own key)."""
    return unescape_key(session_id)


def checked_id(path: Path, line: int | None, value: Any) -> str:
    """`value` as a session id for the file at `path` (an import creates it: a new id), or
    `ImportFormatError`."""
    try:
        return validate_new_session_id(value)
    except InvalidSessionIdError as e:
        shown = value[:80] if isinstance(value, str) else value
        raise ImportFormatError(
            path, line, f"session id {shown!r} is not allowed here ({e}); nothing of this session was imported"
        ) from None


def mapped_id(path: Path, line: int | None, key: str) -> str:
    """`key_to_session_id(key)`, or `ImportFormatError` naming the file."""
    try:
        return key_to_session_id(key)
    except (InvalidSessionIdError, UnicodeEncodeError) as e:
        raise ImportFormatError(
            path,
            line,
            f"session id {key[:80]!r} is not allowed here, even percent-encoded ({e}); nothing of this session "
            "was imported",
        ) from None


def _slot(session_id: str) -> int:
    """The Redis Cluster slot of a session's keys (their hash tag is the id: CRC16 mod 16384)."""
    return binascii.crc_hqx(session_id.encode("utf-8"), 0) % 16384


def staging_id(session_id: str, token: str) -> str:
    """An id to build a replacing import under: unique (`token`), naming its target, and in the
    same cluster slot as `session_id`, so the store can swap the two in one atomic script."""
    slot = _slot(session_id)
    base = f"{session_id[:160]}.import-{token[:16]}."
    k = 0
    while _slot(f"{base}{k:x}") != slot:
        k += 1
    staged = f"{base}{k:x}"
    assert is_staging_id(staged)  # the store keeps such an id unlisted and expiring
    return staged
