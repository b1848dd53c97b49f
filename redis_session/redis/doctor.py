"""Doctor's storage checks on Redis: a session's own stream, walked raw.

`RedisSessionStore.storage_problems` runs this for `redis_session.doctor`: the stream
IDs (each ``<n>-1``), their contiguity against the header's n and the branch point, and the
decoding of every entry, page by page, below `read` (which would stop at the first bad row);
and the archived segments the header's ``cold`` field names (`segment_problems`): each object is
fetched and checked (checksum, identity, every n), and together they must cover [at, hot start).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from ..cold.objects import ObjectMissing
from ..cold.segments import ColdTier, decode_cold, decode_segment
from ..errors import SegmentCorruptError, SessionError
from ..model import Entry
from ..projection.invariants import Problem
from ..store.protocol import StorageCheck
from ..store.rules import sequence_problems
from .rows import rows_to_entries

PAGE = 10_000


async def stream_problems(
    raw: Callable[..., Awaitable[Any]],
    key: str,
    n: int,
    at: int,
    cold: ColdCheck | None = None,
    header_n: Callable[[], Awaitable[int | None]] | None = None,
) -> StorageCheck:
    """Walk the session's own stream (`key`, read with the store's `raw` command call): IDs,
    contiguity against the header, decoding; and, with `cold`, the archived segments before it.

    `n` is the header's as read before the walk. Entries appended while the doctor walks are no
    ``stream-ahead``: with `header_n` (the header's n now), a log ahead of `n` is asked again
    after the walk, and entries past `n` the header has since counted are left out."""
    problems: list[Problem] = []
    ids: list[int] = []
    own: list[Entry] = []
    hot = at
    if cold is not None:
        hot, cold_entries = await segment_problems(cold, at, problems)
        own.extend(cold_entries)
    lo = b"-"
    while True:
        rows = await raw("XRANGE", key, lo, "+", "COUNT", PAGE)
        good = []
        for row in rows:
            rid = row[0] if isinstance(row[0], bytes) else str(row[0]).encode()
            k, sep, seq = rid.partition(b"-")
            if not (k.isdigit() and sep and seq == b"1"):
                problems.append(
                    Problem(None, "stream-id", f"stream ID {rid.decode(errors='replace')!r} is not of the form <n>-1")
                )
                continue
            ids.append(int(k))
            good.append(row)
        own.extend(_decode(good, problems))
        if len(rows) < PAGE:
            break
        lo = b"(" + rows[-1][0]
    if ids and ids[0] < hot:
        where = f"the branch point at={at}" if hot == at else f"the archived range's end {hot}"
        problems.append(Problem(ids[0], "stream-order", f"the stream holds n={ids[0]}, below {where}"))
    found = sequence_problems([k for k in ids if k >= hot], hot, n)
    ahead = [p for p in found if p.code == "stream-ahead"]
    if ahead and header_n is not None and not [p for p in found if p.code in ("stream-gap", "stream-order")]:
        now = await header_n()
        if now is not None and now > max(ids):  # appended meanwhile: the session at n is whole
            found = [p for p in found if p.code != "stream-ahead"]
            own = [e for e in own if e.n < n]
    problems.extend(found)
    return StorageCheck(problems, own)


class ColdCheck(NamedTuple):
    """What the segment check needs of a session with archived ranges: its header's ``cold`` field
    as stored, the incarnation the segments must name, and the store's cold tier (None: none set)."""

    session_id: str
    incarnation: str
    cold_raw: bytes
    tier: ColdTier | None


async def segment_problems(cold: ColdCheck, at: int, problems: list[Problem]) -> tuple[int, list[Entry]]:
    """Check every archived segment (``segment-missing``, ``segment-corrupt``, ``segment-gap``);
    the hot stream's expected start and the archived entries that check out."""
    session_id, incarnation, tier = cold.session_id, cold.incarnation, cold.tier
    try:
        segments = decode_cold(cold.cold_raw)
    except Exception as e:
        problems.append(Problem(None, "segment-corrupt", f"the header's cold list does not parse: {e}"))
        return at, []
    out: list[Entry] = []
    expected = at
    for seg in segments:
        if seg.lo != expected:
            problems.append(Problem(expected, "segment-gap", f"archived segments skip [{expected}, {seg.lo})"))
        expected = seg.hi
        if tier is None:
            problems.append(Problem(seg.lo, "segment-missing", f"[{seg.lo}, {seg.hi}): no cold tier is configured"))
            continue
        key = tier.key(session_id, incarnation, seg)
        try:
            data = await tier.objects.get(key)
            out.extend(decode_segment(session_id, incarnation, seg, key, data))
        except ObjectMissing:
            problems.append(Problem(seg.lo, "segment-missing", f"[{seg.lo}, {seg.hi}): {key} is not in {tier.url}"))
        except SegmentCorruptError as e:
            problems.append(Problem(seg.lo, "segment-corrupt", str(e)))
    return expected, out


def _decode(rows: list[object], problems: list[Problem]) -> list[Entry]:
    """The rows that decode, as entries; a ``decode`` problem for each one that does not."""
    try:
        return rows_to_entries(rows)
    except SessionError:
        pass
    out: list[Entry] = []
    for row in rows:
        try:
            out.extend(rows_to_entries([row]))
        except SessionError as e:
            problems.append(Problem(int(row[0].partition(b"-")[0]), "decode", str(e)))  # type: ignore[index]
    return out
