"""Reading a session's projection: the projector's snapshot plus the entries after it.

One reader for every caller (the `Session` handle, `Sessions.messages`, the gateway, the CLI and
the projector itself), so they cannot disagree. Whatever the cache holds, the answer equals
``project(await store.read(session_id, 0, n))``: a lagging, dead or wrong projector costs speed,
never correctness.

Public to the layers above (the projector and the service), documented where defined:

- `load_messages`, `load_state`, `SnapshotCache`: what readers call; `load_projection` (the
  service's `load_state`: a log that does not fold is a `SessionError`) and `fold_into` (a loaded
  state caught up with [state.n, stop), a short read a `SessionError`), what `Session` calls;
- `read_entries` (one `store.read`, of an incarnation when named), `fold_range` (fold a log range
  onto a state, page by page), `fold_from_cut` (rebuild from a cut: reads ``[before, target)``
  only), `rebuild` (a state without a snapshot of its own: last cut, parent snapshot, else from
  0), `plausible` (cheap checks that a decoded snapshot belongs to a head's log): the building
  blocks the projector's writer shares with the readers, so they fold the same way.
"""

from __future__ import annotations

import builtins
from collections import OrderedDict
from collections.abc import AsyncIterator

import msgspec

from .errors import SessionError, SessionNotFoundError
from .keys import validate_session_id
from .model import CUT, Entry, SessionHead
from .projection.fold import ProjectionState
from .store.protocol import MAX_READ_RANGE, SessionStore

# entries per store read when a whole range is wanted (one read is capped at MAX_READ_RANGE)
READ_PAGE = 50_000

_size_enc = msgspec.json.Encoder()


async def read_entries(
    store: SessionStore, session_id: str, lo: int, hi: int, incarnation: str | None
) -> builtins.list[Entry]:
    """`store.read`, of `incarnation` when one is named (`SessionReplacedError` otherwise)."""
    if incarnation is None:
        return await store.read(session_id, lo, hi)
    return await store.read(session_id, lo, hi, incarnation=incarnation)


async def read_range(
    store: SessionStore, session_id: str, start: int, stop: int, incarnation: str | None = None
) -> builtins.list[Entry]:
    """Entries [start, stop), in pages (one store read is capped); of `incarnation` if given."""
    out: builtins.list[Entry] = []
    lo = start
    while lo < stop:
        hi = min(stop, lo + READ_PAGE)
        batch = await read_entries(store, session_id, lo, hi, incarnation)
        out.extend(batch)
        if len(batch) != hi - lo:
            break  # the session is shorter than asked: the caller sees what there is
        lo = hi
    return out


async def fold_into(
    store: SessionStore, session_id: str, state: ProjectionState, stop: int, incarnation: str | None = None
) -> None:
    """Fold entries [state.n, stop) into `state`, page by page (never holding the whole log)."""
    while state.n < stop:
        lo = state.n
        hi = min(stop, lo + READ_PAGE)
        batch = await read_entries(store, session_id, lo, hi, incarnation)
        if len(batch) != hi - lo:
            raise SessionError(
                f"session {session_id!r}: the log holds {len(batch)} entries in [{lo}, {hi}), "
                f"expected {hi - lo}; run `redis-session doctor {session_id}`"
            )
        state.extend(batch)


async def load_projection(
    store: SessionStore, head: SessionHead, cache: SnapshotCache | None = None
) -> ProjectionState:
    """The projection state of `head`'s session at ``head.n``, reading as little as it can: the
    projector's snapshot plus the entries after it, else a rebuild from the last cut or a branch's
    parent snapshot, else a full fold (`load_state`, its ValueError as a `SessionError` naming the
    doctor). Never anything but what a fold from scratch gives."""
    try:
        return await load_state(store, head, cache=cache, chunk=READ_PAGE)
    except ValueError as e:
        sid = head.header.id
        raise SessionError(f"session {sid!r} cannot be folded: {e}; run `redis-session doctor {sid}`") from e


async def _read_chunks(
    store: SessionStore, session_id: str, lo: int, hi: int, chunk: int, incarnation: str | None = None
) -> AsyncIterator[builtins.list[Entry]]:
    chunk = max(1, min(chunk, MAX_READ_RANGE))
    while lo < hi:
        part = await read_entries(store, session_id, lo, min(hi, lo + chunk), incarnation)
        if not part:
            raise SessionError(f"session {session_id!r}: entries [{lo}, {hi}) are missing from the log")
        yield part
        lo = part[-1].n + 1


async def fold_range(
    store: SessionStore,
    session_id: str,
    state: ProjectionState,
    hi: int,
    chunk: int,
    incarnation: str | None = None,
    *,
    measure: bool = False,
) -> int:
    """Fold entries [state.n, hi) into `state` (ValueError from the fold propagates). With
    `measure`, returns about how many bytes of entries were folded (what a cached state grows
    by, at most); else 0."""
    size = 0
    async for part in _read_chunks(store, session_id, state.n, hi, chunk, incarnation):
        state.extend(part)
        if measure:
            size += sum(len(_size_enc.encode(e.data)) + 48 for e in part)
    return size


async def fold_from_cut(
    store: SessionStore,
    session_id: str,
    cut: int | Entry,
    target: int,
    chunk: int,
    incarnation: str | None = None,
) -> ProjectionState:
    """The state at `target` rebuilt from `cut` (an entry, or its n): reads [before, target) only.

    ValueError when the entry is not a cut or `from_cut` cannot decide (fold from 0 then)."""
    if isinstance(cut, int):
        got = await read_entries(store, session_id, cut, cut + 1, incarnation)
        if len(got) != 1:
            raise ValueError(f"entry {cut} is missing")
        cut = got[0]
    before = cut.data.get("before")
    if cut.type != CUT or not isinstance(before, int) or isinstance(before, bool) or not 0 <= before <= cut.n:
        raise ValueError(f"entry {cut.n} is not a cut with a valid before")
    window: builtins.list[Entry] = []
    async for part in _read_chunks(store, session_id, before, cut.n, chunk, incarnation):
        window.extend(part)
    state = ProjectionState.from_cut(cut, window)
    await fold_range(store, session_id, state, target, chunk, incarnation)
    return state


async def rebuild(
    store: SessionStore, session_id: str, head: SessionHead, target: int, chunk: int
) -> tuple[ProjectionState, str]:
    """The state at `target` without a snapshot of its own, and where it came from: the
    session's last cut (``"cut"``), the parent's snapshot for a branch (``"parent"``: the branch's
    first `at` entries are the parent's), else a fold from 0 (``"full"``). Every read is of
    `head`'s incarnation (`SessionReplacedError` otherwise)."""
    inc = head.header.incarnation or None
    if head.last_cut is not None and head.last_cut < target:
        try:
            return await fold_from_cut(store, session_id, head.last_cut, target, chunk, inc), "cut"
        except ValueError:
            pass
    parent, at = head.header.parent, head.header.at
    if parent is not None and at:
        state = await _parent_state(store, parent, at, head.header.created_at)
        if state is not None:
            try:
                await fold_range(store, session_id, state, target, chunk, inc)  # stitched reads
                return state, "parent"
            except ValueError:
                pass
    state = ProjectionState()
    await fold_range(store, session_id, state, target, chunk, inc)
    return state, "full"


async def _parent_state(store: SessionStore, parent: str, at: int, born: int) -> ProjectionState | None:
    """The parent's snapshot when it covers no more than the branch point (else None)."""
    parent_head = await store.head(parent)
    if parent_head is None or parent_head.header.created_at > born:
        # A hidden parent keeps its log for its branches, not its snapshot; a parent id younger
        # than the branch is another session that took the id: its log is not the prefix.
        return None
    snap = await _get_projection(store, parent, parent_head.header.incarnation)
    if snap is None or snap[0] > at:
        return None
    try:
        state = ProjectionState.from_bytes(snap[1])
    except ValueError:
        return None
    return state if plausible(state, snap[0], parent_head) else None


async def _get_projection(store: SessionStore, session_id: str, incarnation: str) -> tuple[int, bytes] | None:
    """The snapshot of exactly that incarnation of the session, or None."""
    if not incarnation:
        return None
    return await store.get_projection(session_id, incarnation=incarnation)


def plausible(state: ProjectionState, n_s: int, head: SessionHead) -> bool:
    """Cheap checks that a decoded snapshot belongs to this session's log.

    proj.lua never writes past the header's n nor for another incarnation, and a re-created
    session starts without a snapshot (and snapshots are read by incarnation), so these fail only
    for a snapshot written around the API: then the reader folds the log rather than trust it."""
    if state.n != n_s or n_s > head.n:
        return False
    own_cut = head.last_cut  # the n of the session's own last cut (a branch's prefix not included)
    if own_cut is not None and own_cut < n_s:
        return state.last_cut == own_cut
    if own_cut is None:
        return state.last_cut is None or state.last_cut < (head.header.at or 0)
    return True


class SnapshotCache:
    """Decoded snapshots kept in-process, so a reader that loads the same sessions again decodes
    nothing.

    Decoding is most of a snapshot load (a 5 000-message snapshot is ~2 MB of JSON). The cache
    keeps, per session, the last state it produced and the snapshot bytes it came from:

    - the *same bytes* again (the projector has not rewritten the snapshot): a copy of the state;
    - other bytes (the projector moved on), and the cached state is at most `max_tail` entries
      behind the head of the *same* session (same `incarnation`): a copy of the state extended
      with the log's entries after it — no decode. The fold is deterministic and the log below a
      session's n never changes, so this answers exactly what a decode plus the tail would.

    Every entry is of one incarnation: a state is never served for a session that took its id.
    `max_bytes` bounds what the entries hold: a state's size is its snapshot's bytes, plus what
    the entries folded onto it since added (an upper bound).

    >>> cache = SnapshotCache(max_bytes=64 << 20)
    >>> state, n = await load_messages(store, "chat-1", cache=cache)
    """

    def __init__(self, max_bytes: int = 64 << 20, *, max_tail: int = 2_000) -> None:
        self.max_bytes = max_bytes
        self.max_tail = max_tail
        # session -> (bytes it was decoded from or None, state, the session's incarnation, size)
        self._items: OrderedDict[str, tuple[bytes | None, ProjectionState, str, int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.extended = 0

    def get(self, session_id: str, blob: bytes, incarnation: str | None = None) -> ProjectionState | None:
        """A private copy of the state decoded from exactly `blob` (of `incarnation`, if given), or None."""
        got = self._items.get(session_id)
        if got is None or got[0] != blob or (incarnation is not None and got[2] != incarnation):
            self.misses += 1
            return None
        self._items.move_to_end(session_id)
        self.hits += 1
        return got[1].copy()

    def base(self, head: SessionHead) -> ProjectionState | None:
        """A private copy of the cached state of `head`'s session when it can be extended to
        ``head.n`` by folding at most `max_tail` entries (same session incarnation), else None."""
        got = self._items.get(head.header.id)
        if got is None or got[2] != head.header.incarnation:
            return None
        state = got[1]
        if not state.n <= head.n <= state.n + self.max_tail:
            return None
        return state.copy()

    def put(
        self, session_id: str, blob: bytes | None, state: ProjectionState, incarnation: str = "", *, grown: int = 0
    ) -> None:
        """Keep a copy of `state` (decoded from `blob`, or extended from the log when `blob` is
        None: then `grown` is about how many bytes of entries were folded onto the cached state);
        the least recently used go first."""
        old = self._items.pop(session_id, None)
        if old is not None:
            self._bytes -= old[3]
        if blob is None and (old is None or old[2] != incarnation):
            return
        if blob is not None:
            size = len(blob)
        else:
            assert old is not None
            size = old[3] + max(0, grown)  # what the entries folded onto it added
        if size > self.max_bytes:
            return
        self._items[session_id] = (blob, state.copy(), incarnation, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, _, _, sz) = self._items.popitem(last=False)
            self._bytes -= sz

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._items


async def _from_cache(
    store: SessionStore, head: SessionHead, cache: SnapshotCache | None, chunk: int
) -> ProjectionState | None:
    """The cached state of the session extended with the log's tail to ``head.n``, or None."""
    if cache is None:
        return None
    state = cache.base(head)
    if state is None:
        return None
    try:
        grown = await fold_range(
            store, head.header.id, state, head.n, chunk, head.header.incarnation or None, measure=True
        )
    except ValueError:
        return None
    cache.extended += 1
    cache.put(head.header.id, None, state, head.header.incarnation, grown=grown)
    return state


async def load_messages(
    store: SessionStore, session_id: str, *, cache: SnapshotCache | None = None, chunk: int = 20_000
) -> tuple[ProjectionState, int]:
    """The projection of `session_id` at its head: ``(state, n)`` with ``state.n == n``.

    Reads the projector's snapshot (n_s), then the head (n), and folds entries [n_s, n) onto it.
    Without a usable snapshot — absent, undecodable, inconsistent with the header, or ahead of the
    head — it rebuilds from the header's last cut, else folds the whole log. Whatever the cache
    holds, ``state.messages()`` equals ``project(await store.read(session_id, 0, n))``. The state
    is the caller's own (extend it with later entries). With a `SnapshotCache`, a snapshot met
    again is not decoded again.

    Works on any `SessionStore` (the memory store has the same snapshot slot). Raises
    `SessionNotFoundError` when the session does not exist.

    >>> state, n = await load_messages(store, "chat-1")
    >>> state.messages()[-1].text
    """
    validate_session_id(session_id)
    if cache is not None and session_id in cache:
        # A state we hold, a few entries behind: the head and the tail, no snapshot bytes at all.
        head = await store.head(session_id)
        if head is None:
            raise SessionNotFoundError(session_id)
        extended = await _from_cache(store, head, cache, chunk)
        if extended is not None:
            return extended, head.n
    # The head first (its incarnation picks the snapshot), the snapshot second; a snapshot the
    # projector wrote in between is ahead of that head: read the head again then.
    head = await store.head(session_id)
    if head is None:
        raise SessionNotFoundError(session_id)
    snap = await _get_projection(store, session_id, head.header.incarnation)
    if snap is not None and snap[0] > head.n:
        newer = await store.head(session_id)
        if newer is None:
            raise SessionNotFoundError(session_id)
        if newer.header.incarnation == head.header.incarnation:
            head = newer
    state = await _extend_snapshot(store, head, snap, cache, chunk)
    if state is None:
        state, _ = await rebuild(store, session_id, head, head.n, chunk)
    return state, head.n


async def _extend_snapshot(
    store: SessionStore,
    head: SessionHead,
    snap: tuple[int, bytes] | None,
    cache: SnapshotCache | None,
    chunk: int,
) -> ProjectionState | None:
    """`snap` (a snapshot of `head`'s incarnation) decoded and extended to ``head.n``; None when
    unusable: absent, undecodable, not plausibly this log's, newer than the head, or needing
    history it dropped."""
    if snap is None or snap[0] > head.n:
        return await _from_cache(store, head, cache, chunk)
    sid = head.header.id
    inc = head.header.incarnation
    n_s, blob = snap
    state = None if cache is None else cache.get(sid, blob, inc)
    if state is None:
        extended = await _from_cache(store, head, cache, chunk)
        if extended is not None:
            return extended  # the projector moved on: extend what we hold rather than decode
        try:
            state = ProjectionState.from_bytes(blob)
        except ValueError:
            return None
        if cache is not None and plausible(state, n_s, head):
            cache.put(sid, blob, state, inc)
    if not plausible(state, n_s, head):
        return None
    try:
        await fold_range(store, sid, state, head.n, chunk, inc or None)
    except ValueError:
        return None  # the tail needs history the snapshot dropped (a cut reaching back): rebuild
    return state


async def load_state(
    store: SessionStore, head: SessionHead, *, cache: SnapshotCache | None = None, chunk: int = 20_000
) -> ProjectionState:
    """The projection state of `head`'s session at exactly ``head.n`` (a handle's own view).

    Same sources as `load_messages`; a snapshot newer than ``head.n`` is not used, nor one of
    another incarnation; reads of another incarnation raise `SessionReplacedError`."""
    snap = await _get_projection(store, head.header.id, head.header.incarnation)
    state = await _extend_snapshot(store, head, snap, cache, chunk)
    if state is None:
        state, _ = await rebuild(store, head.header.id, head, head.n, chunk)
    return state


__all__ = [
    "SnapshotCache",
    "fold_from_cut",
    "fold_range",
    "load_messages",
    "load_state",
    "plausible",
    "read_entries",
    "rebuild",
]
