"""Doctor's storage checks on Redis: a session's own stream, walked raw.

`RedisSessionStore.storage_problems` runs this for `redis_session.doctor`: the stream
IDs (each ``<n>-1``), their contiguity against the header's n and the branch point, and the
decoding of every entry, page by page, below `read` (which would stop at the first bad row).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import SessionError
from ..model import Entry
from ..projection.invariants import Problem
from ..store.protocol import StorageCheck
from ..store.rules import sequence_problems
from .rows import rows_to_entries

PAGE = 10_000


async def stream_problems(raw: Callable[..., Awaitable[Any]], key: str, n: int, at: int) -> StorageCheck:
    """Walk the session's own stream (`key`, read with the store's `raw` command call): IDs,
    contiguity against the header, decoding."""
    problems: list[Problem] = []
    ids: list[int] = []
    own: list[Entry] = []
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
    if ids and ids[0] < at:
        problems.append(Problem(ids[0], "stream-order", f"the stream holds n={ids[0]}, below the branch point at={at}"))
    problems.extend(sequence_problems([k for k in ids if k >= at], at, n))
    return StorageCheck(problems, own)


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
