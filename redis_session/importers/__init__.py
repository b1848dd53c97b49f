"""Import and export of whole sessions: our JSONL, and the files of the systems the store
replaces — nanobot, dsh and the tutorial harness — each read the way that system reads it and
written back the way it writes it.

One module per format, each decoding its lines into msgspec Structs (a bad line is reported with
its file, line number and field path): `native` (ours: `export_session` writes it, `import_path`
reads it back exactly), `nanobot`, `dsh`, `tutorial`; `common` holds what they share. The format
of a file is detected from its first line. Files may be zstd-compressed (dsh's ``*.jsonl.zstd``);
a UTF-8 byte-order mark is skipped; a UTF-16/UTF-32 file is refused with a message that says so.
Timestamps without a zone are UTC.

**All or nothing per session.** Each file is read and validated completely (JSON, envelope, field
types, the store's schemas and entry size limit, surface metadata, the session id) before anything
is written; a problem raises `ImportFormatError` with the file and line number and nothing of that
session is written. Sessions longer than one store batch are written as ``create`` plus expected-n
``put`` batches; if a write fails part-way (server gone, cancellation, a concurrent writer), the
partial session is deleted before the error propagates. A replacing import builds the new session
under a staging id and swaps it in atomically, so a failure leaves the old session as it was.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import IO, Any, Literal, TextIO

import anyio
import anyio.to_thread
import msgspec

from ..errors import (
    ImportFormatError,
    InvalidEntryError,
    InvalidSessionIdError,
    SessionAlreadyExistsError,
    SessionError,
    SessionNotFoundError,
    StoreUnavailableError,
)
from ..keys import STAGING_TTL_MS
from ..model import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_ENTRY_BYTES,
    EncodedEntry,
    Entry,
    SessionHead,
    check_against_n,
    encode_entry,
)
from ..projection.fold import ProjectionState, check_surface
from ..store import SessionStore, check_header
from . import dsh, nanobot, native, tutorial
from .common import (
    SUFFIXES,
    Bad,
    Format,
    ImportResult,
    OnExists,
    ParsedSession,
    Progress,
    Source,
    checked_id,
    json_object,
    key_to_session_id,
    read_source,
    session_id_to_key,
    staging_id,
)
from .dsh import dsh_messages
from .native import EXPORT_TYPE, EXPORT_VERSION

ExportFormat = Literal["redis-session", "nanobot", "dsh", "tutorial"]
Errors = Literal["raise", "collect", "stop"]

#: A write batch holds at most this many bytes (and at most the store's `max_batch` entries).
BATCH_BYTES = 8 << 20
_READ_PAGE = 10_000
FORMATS = ("redis-session", "nanobot", "dsh", "tutorial")

__all__ = [
    "EXPORT_TYPE",
    "EXPORT_VERSION",
    "FORMATS",
    "ImportFormatError",
    "ImportResult",
    "ParsedSession",
    "detect_format",
    "dsh_messages",
    "export_session",
    "import_path",
    "key_to_session_id",
    "parse_file",
    "session_id_to_key",
    "validate",
    "write_session",
]


def detect_format(first: dict[str, Any]) -> str | None:
    """The format a file's first line announces, or None."""
    for name, module in (("redis-session", native), ("nanobot", nanobot), ("dsh", dsh), ("tutorial", tutorial)):
        if module.detect(first):
            return name
    return None


# --------------------------------------------------------------------------- parse + validate


def parse_file(
    path: str | os.PathLike[str],
    *,
    format: Format | str = "auto",
    session_id: str | None = None,
    store: SessionStore | None = None,
) -> ParsedSession:
    """Read one file into a `ParsedSession`, validating everything a write would check.

    With `store`, entries are checked against its vocabulary and entry size limit (else the
    defaults). Raises `ImportFormatError` (file, line, message) on the first problem.
    """
    p = Path(path)
    try:
        return _parse(p, format, session_id, store)
    except OSError as e:
        raise ImportFormatError(p, None, f"cannot read the file: {e.strerror or e}") from None


_UNRECOGNISED = (
    "unrecognised header line: expected a redis-session export header "
    '({"_type":"redis-session",…}), a nanobot metadata line ({"_type":"metadata",…}), a dsh '
    'session header ({"type":"session","version":0,…}) or a tutorial meta line '
    '({"type":"session/meta",…})'
)


def _parse(p: Path, format: str, session_id: str | None, store: SessionStore | None) -> ParsedSession:
    max_bytes = int(getattr(store, "max_entry_bytes", DEFAULT_MAX_ENTRY_BYTES))
    with read_source(p, max_entry_bytes=max_bytes) as source:
        parsed, first_line, id_line = _parse_source(source, p, format)
    sid = checked_id(
        p, id_line if session_id is None else None, parsed.session_id if session_id is None else session_id
    )
    parsed.header = msgspec.structs.replace(parsed.header, id=sid)
    try:
        check_header(parsed.header)
    except (InvalidEntryError, InvalidSessionIdError) as e:
        raise ImportFormatError(p, first_line, f"bad header: {e}", session_id=sid) from None
    validate(parsed, store)
    return parsed


def _parse_source(source: Source, p: Path, format: str) -> tuple[ParsedSession, int, int | None]:
    """The file's session, its header line and the line naming its id (None: the file's name)."""
    first = next(source.nonblank(), None)
    if first is None:
        raise ImportFormatError(p, None, "the file is empty: no header line")
    try:
        obj = json_object(first)
    except Bad as e:
        raise ImportFormatError(p, first.no, str(e)) from None
    detected = detect_format(obj)
    fmt = detected if format == "auto" else format
    if fmt is None:
        raise ImportFormatError(p, first.no, _UNRECOGNISED)
    if fmt not in FORMATS:
        raise ValueError(f"unknown import format {fmt!r}; expected one of {sorted(FORMATS)} or 'auto'")
    if detected != fmt:
        raise ImportFormatError(p, first.no, f"the header line is not a {fmt} header")
    id_line: int | None = first.no
    if fmt == "redis-session":
        header, entries, lines = native.parse(source)
        parsed = ParsedSession(str(p), fmt, header, entries, lines)
    elif fmt == "nanobot":
        parsed = nanobot.parse(source, None)
    elif fmt == "dsh":
        parsed = dsh.parse(source, None)
    else:
        parsed, from_line = tutorial.parse(source, None)
        id_line = first.no if from_line else None
    parsed.repaired[:0] = source.notes
    return parsed, first.no, id_line


def validate(parsed: ParsedSession, store: SessionStore | None = None) -> list[EncodedEntry]:
    """Check every entry as the store will (schemas, lossless JSON, size, cut range, surface);
    raise `ImportFormatError` naming the line of the first bad one."""
    vocabulary = store.vocabulary if store is not None else None
    if vocabulary is None:
        from ..model import Vocabulary

        vocabulary = Vocabulary()
    max_bytes = int(getattr(store, "max_entry_bytes", DEFAULT_MAX_ENTRY_BYTES))
    encoded: list[EncodedEntry] = []
    for i, e in enumerate(parsed.entries):
        try:
            enc = encode_entry(e, vocabulary, index=i, max_entry_bytes=max_bytes)
            check_against_n(enc, i, i)
        except InvalidEntryError as err:
            raise _entry_error(parsed, i, err) from None
        encoded.append(enc)
    try:
        check_surface(ProjectionState(), encoded, 0)
    except InvalidEntryError as err:
        raise _entry_error(parsed, err.index or 0, err) from None
    return encoded


def _entry_error(parsed: ParsedSession, index: int, err: InvalidEntryError) -> ImportFormatError:
    msg = str(err)
    prefix = f"entry {index}: "
    if msg.startswith(prefix):
        msg = msg[len(prefix) :]
    line = parsed.lines[index] if index < len(parsed.lines) else 0
    return ImportFormatError(
        parsed.path,
        line or None,
        f"entry n={index} ({parsed.entries[index].type}): {msg}",
        session_id=parsed.session_id,
    )


# --------------------------------------------------------------------------- writing


def _batches(parsed: ParsedSession, max_batch: int, max_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of entries, each within the store's batch limits."""
    out: list[tuple[int, int]] = []
    lo = size = 0
    for i, e in enumerate(parsed.entries):
        # A cheap upper bound of the encoded size; exact sizes were checked in `validate`.
        est = len(msgspec.json.encode(e.data)) + (len(msgspec.json.encode(e.meta)) if e.meta else 0) + 64
        if i > lo and (i - lo >= max_batch or size + est > max_bytes):
            out.append((lo, i))
            lo, size = i, 0
        size += est
    out.append((lo, len(parsed.entries)))
    return out


EXISTS_HINT = "import with --on-exists skip or --on-exists replace"


async def write_session(
    store: SessionStore,
    parsed: ParsedSession,
    *,
    on_exists: OnExists | str = "error",
    progress: Callable[[int], object] | None = None,
) -> ImportResult:
    """Write a validated `ParsedSession`: all of it, or (after a failure part-way) none of it.

    With ``on_exists="replace"`` the new session is built completely under a staging id (in the
    same cluster slot) while the old one stays as it is, readable and writable; then the store
    swaps the two in one atomic step (`swap_session`). A failure before the swap deletes the
    staged copy and leaves the old session exactly as it was (a note on the error says so); a
    writer that changed the old session meanwhile keeps its write (the swap is refused with
    `SessionReplacedError` only when the id was replaced by another life).

    `progress(k)` is called after each batch with the number of entries written so far.
    """
    sid = parsed.session_id
    if on_exists not in ("error", "skip", "replace"):
        raise ValueError("on_exists must be 'error', 'skip' or 'replace'")
    old = await store.head(sid)
    token = uuid.uuid4().hex
    if old is None:
        await _write_all(store, parsed, sid, token, progress)
        return _result(parsed, "imported")
    if on_exists == "skip":
        return ImportResult(parsed.path, sid, parsed.format, "skipped", original_id=parsed.original_id)
    if on_exists == "error":
        raise SessionAlreadyExistsError(sid, EXISTS_HINT)
    # Decided before anything is written: a branch that reads its entries, listed or deleted but
    # kept for its own branches, would keep the id taken by the deleted session.
    live, _stale = await store.links(sid)
    if live:
        raise SessionAlreadyExistsError(sid, "it has live branches, so it cannot be replaced")
    swap = getattr(store, "swap_session", None)
    if swap is None:
        raise SessionError(f"this store ({type(store).__name__}) cannot replace a session atomically (no swap_session)")
    staged = staging_id(sid, token)
    kept = f"the session {sid!r} was left as it was (this import never wrote to it); nothing of the import remains"
    try:
        staged_incarnation = await _write_all(store, parsed, staged, token, progress, staged=True)
    except BaseException as e:
        e.add_note(kept)
        if await _head_or_none(store, staged) is not None:
            _leftover(e, staged)
        raise
    for attempt in range(_SWAP_TRIES):
        try:
            # a retry after a lost reply finds the swap landed (the staged incarnation) and finishes it
            await swap(
                sid,
                staged,
                incarnation=old.header.incarnation,
                staged_incarnation=staged_incarnation,
                replaced_created_at=old.header.created_at,
                replaced_parent=old.header.parent,
            )
            drop = getattr(store, "drop_life_segments", None)
            if drop is not None:  # the replaced life's archived segments: named by no header now
                with contextlib.suppress(Exception):  # what fails is left to `Archiver.sweep`
                    await drop(sid, old.header.incarnation)
            return _result(parsed, "replaced")
        except StoreUnavailableError as e:
            if attempt + 1 < _SWAP_TRIES:
                await anyio.sleep(0.05 * 2**attempt)
                continue
            await _failed_swap(store, e, staged, kept)
            raise
        except BaseException as e:
            await _failed_swap(store, e, staged, kept)
            raise
    raise AssertionError("unreachable")  # pragma: no cover


_SWAP_TRIES = 4


async def _failed_swap(store: SessionStore, e: BaseException, staged: str, kept: str) -> None:
    e.add_note(kept)
    if not await _drop(store, staged):
        _leftover(e, staged)


def _result(parsed: ParsedSession, status: Literal["imported", "replaced"]) -> ImportResult:
    return ImportResult(
        parsed.path,
        parsed.session_id,
        parsed.format,
        status,
        len(parsed.entries),
        repaired=tuple(parsed.repaired),
        original_id=parsed.original_id,
    )


async def _head_or_none(store: SessionStore, session_id: str) -> SessionHead | None:
    try:
        return await store.head(session_id)
    except Exception:
        return None


async def _drop(store: SessionStore, session_id: str) -> bool:
    """Delete a partial session (shielded); whether that worked (the original error matters more
    than this one's)."""
    with anyio.CancelScope(shield=True):
        try:
            await store.delete(session_id)
        except Exception:
            return False
    return True


def _leftover(e: BaseException, staged: str) -> None:
    e.add_note(
        f"the staging copy {staged!r} could not be deleted (the store failed too): "
        f"delete it with `redis-session delete {staged}`"
    )


async def _write_all(
    store: SessionStore,
    parsed: ParsedSession,
    sid: str,
    token: str,
    progress: Callable[[int], object] | None,
    *,
    staged: bool = False,
) -> str:
    """Create `sid` with the parsed header and entries, in batches (a failure part-way deletes
    it); its incarnation."""
    max_batch = int(getattr(store, "max_batch", DEFAULT_MAX_BATCH))
    ranges = _batches(parsed, max_batch, BATCH_BYTES)
    entries = parsed.entries
    lo, hi = ranges[0]
    header = msgspec.structs.replace(parsed.header, id=sid)
    # create gives the new log a new incarnation (a replaced session never keeps the old
    # identity); the later batches go to exactly that one
    # a staging copy expires by itself (every batch restarts its clock) until the swap makes it
    # lasting: an import killed part-way leaks nothing
    ttl = STAGING_TTL_MS if staged else None
    try:
        incarnation = (await store.create(header, entries[lo:hi], ttl_ms=ttl)).header.incarnation
    except BaseException:
        if staged:  # a staging id is this import's alone: a create whose reply was lost is ours
            await _drop(store, sid)
        raise
    done = False
    try:
        if progress is not None:
            progress(hi)
        for lo, hi in ranges[1:]:
            await store.put(
                sid, lo, entries[lo:hi], idempotency_key=f"import:{token}:{lo}", incarnation=incarnation or None
            )
            if progress is not None:
                progress(hi)
        done = True
    finally:
        if not done:
            await _drop(store, sid)
    return incarnation


def _files(root: Path) -> list[Path]:
    if root.is_dir():
        found = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
        if not found:
            raise ImportFormatError(
                root, None, "no .jsonl or .jsonl.zstd files in this folder (or below it); nothing imported"
            )
        return found
    if not root.exists():
        raise FileNotFoundError(root)
    return [root]


def _check_args(format: str, on_exists: str, errors: str) -> None:
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"unknown import format {format!r}; expected 'auto' or one of {sorted(FORMATS)}")
    if on_exists not in ("error", "skip", "replace"):
        raise ValueError("on_exists must be 'error', 'skip' or 'replace'")
    if errors not in ("raise", "collect", "stop"):
        raise ValueError("errors must be 'raise', 'collect' or 'stop'")


async def import_path(
    store: SessionStore,
    path: str | os.PathLike[str],
    *,
    format: Format | str = "auto",
    session_id: str | None = None,
    progress: Progress | None = None,
    on_exists: OnExists | str = "error",
    errors: Errors = "raise",
) -> list[ImportResult]:
    """Import a file, or every ``*.jsonl`` / ``*.jsonl.zstd`` file under a folder (recursively, in
        name order), one session per file. A folder without any raises `ImportFormatError`.

        `format` is ``"auto"`` (from each file's first line) or one of ``"redis-session"``,
        ``"nanobot"``, ``"dsh"``, ``"tutorial"``. `session_id` overrides the id of a single file's
        session. An id that exists already raises `SessionAlreadyExistsError` unless `on_exists` is
        ``"skip"`` or ``"replace"`` (the new session is built beside the old one and swapped in when
    complete; a failure leaves the old one exactly as it was).

        Each session is written completely or not at all. With ``errors="raise"`` the first failing
        file raises (`ImportFormatError` with file and line for a bad file; a note on the exception
        lists the files imported before it, which stay imported). With ``errors="stop"`` the first
        failure ends the import too, but comes back as the last result (``status="failed"``). With
        ``errors="collect"`` every file is tried and failures come back as failed results.

        `progress(done, total)` counts input bytes: `total` is the size of all files, `done` moves as
        each file's entries are written (the CLI draws the bar).
    """
    _check_args(format, on_exists, errors)
    files = _files(Path(path))
    if session_id is not None and len(files) != 1:
        raise ValueError("session_id can only be given when importing a single file")
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    done = 0
    results: list[ImportResult] = []
    if progress is not None:
        progress(0, total)
    for f, size in zip(files, sizes, strict=True):
        base = done
        try:
            result = await _import_one(store, f, base, size, total, format, session_id, progress, on_exists)
        except SessionError as e:
            if errors == "raise":
                _note_done(e, results, len(files))
                raise
            known = getattr(e, "session_id", None)
            result = ImportResult(str(f), known if isinstance(known, str) else None, format, "failed", 0, e)
            if errors == "stop":
                results.append(result)
                return results
        results.append(result)
        done = base + size
        if progress is not None:
            progress(done, total)
    return results


async def _import_one(
    store: SessionStore,
    f: Path,
    base: int,
    size: int,
    total: int,
    format: str,
    session_id: str | None,
    progress: Progress | None,
    on_exists: str,
) -> ImportResult:
    parsed = await anyio.to_thread.run_sync(partial(parse_file, f, format=format, session_id=session_id, store=store))
    count = max(len(parsed.entries), 1)

    def step(k: int) -> None:
        if progress is not None:
            progress(base + size * k // count, total)

    return await write_session(store, parsed, on_exists=on_exists, progress=step)


def _note_done(e: BaseException, results: Sequence[ImportResult], files: int) -> None:
    if files <= 1:
        return
    done = [r for r in results if r.status in ("imported", "replaced")]
    if done:
        names = ", ".join(f"{r.path} ({r.session_id})" for r in done)
        e.add_note(f"imported before this file: {names}")
    else:
        e.add_note("no file was imported before this one")


# --------------------------------------------------------------------------- export


async def _read_all(store: SessionStore, session_id: str, n: int, progress: Progress | None) -> list[Entry]:
    out: list[Entry] = []
    while len(out) < n:
        stop = min(len(out) + _READ_PAGE, n)
        page: Sequence[Entry] = await store.read(session_id, len(out), stop)
        if len(page) != stop - len(out):
            raise SessionError(f"session {session_id!r}: read [{len(out)}, {stop}) returned {len(page)} entries")
        out.extend(page)
        if progress is not None:
            progress(len(out), n)
    return out


_FOREIGN: dict[str, Callable[[SessionHead, Sequence[Entry]], Iterator[str]]] = {
    "nanobot": nanobot.export_lines,
    "dsh": dsh.export_lines,
    "tutorial": tutorial.export_lines,
}


async def export_session(
    store: SessionStore,
    session_id: str,
    out: TextIO | str | os.PathLike[str],
    *,
    format: ExportFormat | str = "redis-session",
    progress: Progress | None = None,
) -> int:
    """Write a session as JSONL; returns the number of entries exported.

    `format` ``"redis-session"`` (ours: every entry, read back exactly by `import_path`), or the
    file of the system the session came from, as that system writes it: ``"nanobot"`` (a
    ``sessions/*.jsonl`` file: the messages nanobot's ``SessionManager`` loads, its metadata and
    ``last_consolidated``), ``"dsh"`` (a dsh log: header line, one event per entry, a packed
    chunk row as its one-chunk events, seqs as dsh numbered them) or ``"tutorial"`` (the
    harness's log). Importing the export gives the same session back.

    `out` is a text stream, or a path (written to a temporary file, then renamed into place).
    The export is a consistent snapshot at the session's n when it starts, even while others
    append. `progress(done, total)` counts entries. Raises `SessionNotFoundError`.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; expected one of {sorted(FORMATS)}")
    head = await store.head(session_id)
    if head is None:
        raise SessionNotFoundError(session_id)
    n = head.n

    async def write(f: IO[str]) -> None:
        if progress is not None:
            progress(0, n)
        if format != "redis-session":
            entries = await _read_all(store, session_id, n, progress)
            f.write("".join(_FOREIGN[format](head, entries)))
            return
        f.write(native.first_line(head))
        start = 0
        while start < n:
            stop = min(start + _READ_PAGE, n)
            page: Sequence[Entry] = await store.read(session_id, start, stop)
            if len(page) != stop - start:
                raise SessionError(f"session {session_id!r}: read [{start}, {stop}) returned {len(page)} entries")
            f.write("".join(native.entry_lines(page)))
            start = stop
            if progress is not None:
                progress(start, n)

    if isinstance(out, (str, os.PathLike)):
        target = Path(out)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                await write(f)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    else:
        await write(out)
    return n
