"""Doctor's storage checks on Redis: a session's own stream, walked raw.

`RedisSessionStore.storage_problems` runs this for `redis_session.sessions.doctor`: the stream
IDs (each ``<n>-1``), their contiguity against the header's n and the branch point, and the
decoding of every entry, page by page, below `read` (which would stop at the first bad row);
and the archived segments the header's ``cold`` field names (`segment_problems`): each object is
fetched and checked (checksum, identity, every n), and together they must cover [at, hot start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..cold.objects import ObjectMissing
from ..cold.segments import decode_cold, decode_segment
from ..errors import SegmentCorruptError, SessionError
from ..model import Entry
from ..projection.invariants import Problem
from ..store.protocol import StorageCheck
from ..store.rules import sequence_problems
from .store import rows_to_entries

if TYPE_CHECKING:
    from .store import RedisSessionStore

PAGE = 10_000


async def stream_problems(store: RedisSessionStore, session_id: str, n: int, at: int) -> StorageCheck:
    """Walk the session's own stream: IDs, contiguity against the header, decoding; and the
    archived segments before it."""
    key = store.keys.log(session_id)
    problems: list[Problem] = []
    ids: list[int] = []
    own: list[Entry] = []
    cold_raw, inc_raw, born_raw = await store._raw(
        "HMGET", store.keys.hdr(session_id), "cold", "incarnation", "created_at"
    )
    hot = at
    if cold_raw is not None:
        inc = store._check_incarnation(session_id, None, inc_raw, born_raw)
        hot, cold_entries = await segment_problems(store, session_id, inc, cold_raw, at, problems)
        own.extend(cold_entries)
    lo = b"-"
    while True:
        rows = await store._raw("XRANGE", key, lo, "+", "COUNT", PAGE)
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
    problems.extend(sequence_problems([k for k in ids if k >= hot], hot, n))
    return StorageCheck(problems, own)


async def segment_problems(
    store: RedisSessionStore, session_id: str, incarnation: str, cold_raw: bytes, at: int, problems: list[Problem]
) -> tuple[int, list[Entry]]:
    """Check every archived segment (``segment-missing``, ``segment-corrupt``, ``segment-gap``);
    the hot stream's expected start and the archived entries that check out."""
    try:
        segments = decode_cold(cold_raw)
    except Exception as e:
        problems.append(Problem(None, "segment-corrupt", f"the header's cold list does not parse: {e}"))
        return at, []
    tier = await store.cold_tier()
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
