"""The fold: a session's entries folded into the projection, what the model sees. Pure, no I/O.

``project(entries)`` folds a log from scratch; `ProjectionState` is the same fold kept incrementally
(one entry at a time, serialisable for the projector's cache: the snapshot format is here too).
Both produce `Message` Structs (`projection.messages`, where one entry's message is derived);
`projection.render` renders them for a provider, and `projection.budget.history` cuts a legal
suffix out of them.

The rules (docs/design.md §6):

- message entries become messages: ``user/message`` → user; ``assistant/message`` → assistant
  (skipped when its content is empty); ``tool/result`` → a ``tool`` message with one
  ``tool-result`` block; ``context/message`` / ``steering/message`` → a user message wrapped in
  ``<context source="KIND">`` … ``</context>`` (``<steering …>`` for steering); ``message`` (an
  OpenAI-style chat message) → itself, in neutral blocks. Everything else never reaches it.
- message entries are dsh *surface nodes*: an entry without surface metadata is appended; a surface
  ``replace {start, end}`` shadows the inclusive range of nodes between start and end (by position)
  and takes its place.
- the last ``cut`` c decides the front: the projection is c's summary (or its usable ``native``)
  followed by the surface nodes with n ≥ c.before, in surface order.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn, TypeAlias

import msgspec
from msgspec import Struct

from ..errors import InvalidEntryError
from ..model import CUT, MESSAGE_TYPES, EncodedEntry, Entry, SurfaceReplace
from .messages import _ATOMS, _DERIVE, Message, Role, _freeze, _FrozenDict, cut_messages

# the entry types the fold looks at: the message types and cuts (marks only move n)
_FOLDED = frozenset(_DERIVE.keys() & MESSAGE_TYPES | {CUT})


def needs_rebuild(entry: Entry | EncodedEntry) -> bool:
    """Whether `entry` rewrites the projection instead of extending it (a `cut` or a surface
    ``replace``): after it, ``messages()`` is no longer the old list plus new messages, so a cache
    of the message list (or of a rendered request) must be rebuilt. `ProjectionState` itself folds
    these entries incrementally; its `generation` moves when one lands."""
    return entry.type == CUT or (entry.surface is not None and isinstance(entry.surface.op, SurfaceReplace))


# --------------------------------------------------------------------------- the fold


_Atom: TypeAlias = str | int | float | bool | None


class _StoredResult(Struct, forbid_unknown_fields=True, gc=False):
    """A tool-result block as `_tool_result` builds it, its content blocks all flat: every tool
    result folded from a ``tool/result`` entry or a ``tool`` chat message with plain content."""

    toolCallId: str | None
    content: tuple[dict[str, _Atom], ...]
    isError: bool


class _StoredMessage(Struct, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """A Message as a snapshot holds it (format v2), shaped so that loading it is one typed
    decode plus a `_FrozenDict` per block: the decoder itself proves which blocks need no deep
    freeze. A row holds one of:

    - `content`: blocks whose values are all JSON atoms (text, reasoning, tool-call, image: nearly
      every message);
    - `result`: one tool-result block with flat content blocks (a tool message);
    - `nested`: any other blocks, in order, deep-frozen on load (a provider part holding objects;
      even a block that is no object, which only a cut's unchecked `native` can bring).

    `source` is not stored: a surface node's message comes from that node, a summary message from
    the cut.
    """

    role: Role
    content: tuple[dict[str, _Atom], ...] = ()
    result: _StoredResult | None = None
    nested: tuple[Any, ...] = ()
    name: str | None = None


class _Snapshot(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """The snapshot layout, scalars first so redis-cli shows them on the first line. `crc` is only
    read: `to_bytes` encodes the rest and puts the CRC in front."""

    crc: str = ""
    v: int
    n: int
    floor: int
    cut: int | None
    before: int
    generation: int
    nodes: list[int]
    summary: list[_StoredMessage]
    msgs: list[_StoredMessage | None]


_RESULT_KEYS = ["type", "toolCallId", "content", "isError"]


def _stored(m: Message) -> _StoredMessage:
    """The row of `m`: `content` when every block is flat, else `result` or `nested`."""
    blocks: Any = m.content
    atoms = _ATOMS
    for b in blocks:
        if type(b) is not _FrozenDict or not atoms.issuperset(map(type, b.values())):
            break
    else:
        return _StoredMessage(m.role, blocks, None, (), m.name)
    if len(blocks) == 1 and type(b) is _FrozenDict and list(b) == _RESULT_KEYS and b["type"] == "tool-result":
        call_id, inner, is_error = b["toolCallId"], b["content"], b["isError"]
        if (
            (call_id is None or type(call_id) is str)
            and type(is_error) is bool
            and type(inner) is tuple
            and all(type(x) is _FrozenDict and atoms.issuperset(map(type, x.values())) for x in inner)
        ):
            return _StoredMessage(m.role, (), _StoredResult(call_id, inner, is_error), (), m.name)
    return _StoredMessage(m.role, (), None, blocks, m.name)


def _stored_as(m: Message, result: bool) -> _StoredMessage:
    """The row of `m`, known to be a `result` row (True) or a `nested` one (False)."""
    blocks: Any = m.content
    if not result:
        return _StoredMessage(m.role, (), None, blocks, m.name)
    b = blocks[0]
    return _StoredMessage(m.role, (), _StoredResult(b["toolCallId"], b["content"], b["isError"]), (), m.name)


def _special(r: _StoredMessage) -> tuple[_FrozenDict, ...]:
    """The blocks of a `result` or `nested` row."""
    res = r.result
    if r.content or (res is not None and r.nested):
        raise ValueError("inconsistent projection snapshot: a message row with more than one kind of blocks")
    if res is None:
        blocks: tuple[_FrozenDict, ...] = _freeze(r.nested)
        return blocks
    frozen = _FrozenDict
    inner = res.content
    content = (frozen(inner[0]),) if len(inner) == 1 else tuple(map(frozen, inner))
    return (frozen(type="tool-result", toolCallId=res.toolCallId, content=content, isError=res.isError),)


def _loaded(
    rows: Iterable[_StoredMessage | None], nodes: Iterable[int], special: dict[int, bool]
) -> list[Message | None]:
    """Messages from stored rows, each from its node (one loop, inlined: it runs per message);
    `special` maps the nodes of `result` rows to True, of `nested` rows to False."""
    frozen, message = _FrozenDict, Message
    out: list[Message | None] = []
    append = out.append
    for r, k in zip(rows, nodes, strict=True):
        if r is None:
            append(None)
            continue
        if r.result is not None or r.nested:
            blocks = _special(r)
            special[k] = r.result is not None
        elif len(c := r.content) == 1:
            blocks = (frozen(c[0]),)
        else:
            blocks = tuple(map(frozen, c))
        append(message(r.role, blocks, (k,), r.name))
    return out


class _Version(Struct):
    v: Any = None


_SNAPSHOT_VERSION = 2
_SNAPSHOT_ENCODER = msgspec.json.Encoder()
_SNAPSHOT_DECODER = msgspec.json.Decoder(_Snapshot)
_CRC_HEAD = b'{"crc":"'
_CRC_LEN = len(_CRC_HEAD) + 8 + 2  # 8 hex digits, then '",'
_BODY_AT = _CRC_LEN - 1  # the state's own JSON object, its "{" turned into the "," above
_CRC_SEED = zlib.crc32(b"{")  # the CRC covers the rest with its leading "{" restored


class ProjectionState:
    """The projection fold, kept incrementally: ``apply``/``extend`` entries in order (contiguous n
    from `n`), read ``messages()``.

    ``state.messages()`` after folding entries [0, k) equals ``project(entries[:k])``, however the
    entries were split into `extend` calls, copies or `to_bytes` round trips.

    **Surface.** Message entries are surface nodes in position order. A ``replace {start, end}``
    removes the nodes from start to end (inclusive, by position) and puts the new node where they
    were. A replace is applied only when start and end are *visible* nodes (n ≥ the last cut's
    ``before``) and start is not after end: that is what `check_surface` lets into a log. Should a
    log hold any other replace (one written around the check), the fold appends it instead — it
    never fails — and `check_invariants` reports it.

    **Cuts.** Only the last cut counts: the projection is its summary followed by the visible nodes.
    A cut does not touch the surface, so a later cut with a smaller ``before`` shows older nodes again.

    **Caches and snapshots.** ``to_bytes()`` / ``from_bytes()`` carry the whole state (JSON with a
    CRC; a damaged blob raises ValueError). A snapshot is extended by folding the entries after its
    `n`; cuts and replaces are folded too, so nothing ever forces a replay from 0. `needs_rebuild`
    only tells a cache of the *message list* that it cannot simply append.

    **Rebuilding from the last cut** (cold cache, long log): ``ProjectionState.from_cut(cut, window)``
    with ``window`` = entries [cut.before, cut.n), then ``extend(entries after the cut)``. This
    equals the fold of the whole log because nodes before ``before`` are hidden for good: every
    node appended since ``before`` sits after them, and a replace after the cut cannot name them.
    The one thing the window cannot tell is where a replace *inside the window* put its node when
    it named a node older than ``before`` (possible when the window's replaces predate the cut); the
    fold then raises ValueError rather than guess, as it does for a later cut whose ``before`` falls
    under the window's start. Fold from 0 in that case.
    """

    __slots__ = (
        "_before",
        "_classified",
        "_cut",
        "_floor",
        "_generation",
        "_msgs",
        "_n",
        "_nodes",
        "_open_floor",
        "_special",
        "_summary",
        "_view",
    )

    def __init__(self) -> None:
        self._n = 0
        self._floor = 0  # history below this n is unknown (a state built from a cut)
        self._open_floor = False  # True while from_cut folds the window before its cut
        self._nodes: list[int] = []
        self._msgs: dict[int, Message | None] = {}
        self._cut: int | None = None
        self._before = 0
        self._summary: tuple[Message, ...] = ()
        self._view: list[Message] | None = []
        self._generation = 0
        # What `to_bytes` knows of its rows (see `_stored`): a node under `_classified` holds a
        # message of flat blocks unless `_special` maps it to True (a `result` row) or False
        # (`nested`). A snapshot load fills both for free, so the projector's load, extend, store
        # only classifies the messages folded in between.
        self._classified = 0
        self._special: dict[int, bool] = {}

    # ------------------------------------------------------------------ reading

    @property
    def n(self) -> int:
        """The n of the next entry this state expects (= the number of entries folded)."""
        return self._n

    @property
    def last_cut(self) -> int | None:
        """The n of the last cut folded, or None."""
        return self._cut

    @property
    def generation(self) -> int:
        """Moves on every cut and applied replace: while it stays put, ``messages()`` only grows."""
        return self._generation

    @property
    def surface(self) -> list[int]:
        """The surface nodes (entry n) in position order, hidden ones included."""
        return list(self._nodes)

    def messages(self) -> list[Message]:
        """The projection: a new list each call, of shared immutable Messages."""
        view = self._view
        if view is None:
            msgs = self._msgs
            before = self._before
            view = list(self._summary)
            view.extend(m for n in self._nodes if n >= before and (m := msgs[n]) is not None)
            self._view = view
        return list(view)

    # ------------------------------------------------------------------ folding

    def apply(self, entry: Entry) -> None:
        """Fold one entry; its n must be `n` (ValueError otherwise, and nothing changes)."""
        if entry.n != self._n:
            raise ValueError(f"projection expects entry n={self._n}, got n={entry.n}")
        if entry.type in _FOLDED:
            self._fold(entry)
        self._n += 1

    def extend(self, entries: Iterable[Entry]) -> None:
        """Fold entries in order (contiguous n from `n`). On a gap it raises ValueError, keeping
        what was folded before it."""
        n = self._n
        folded = _FOLDED
        try:
            for e in entries:
                if e.n != n:
                    raise ValueError(f"projection expects entry n={n}, got n={e.n}")
                if e.type in folded:
                    self._fold(e)
                n += 1
        finally:
            self._n = n

    def _fold(self, e: Entry) -> None:
        if e.type == CUT:
            self._fold_cut(e)
            return
        msg = _DERIVE[e.type](e)
        n = e.n
        surface = e.surface
        if surface is not None and type(surface.op) is SurfaceReplace:
            span = self._replace_span(surface.op)
            if span is not None:
                i, j = span
                msgs = self._msgs
                for old in self._nodes[i : j + 1]:
                    del msgs[old]
                    self._special.pop(old, None)
                self._nodes[i : j + 1] = [n]
                msgs[n] = msg
                self._view = None
                self._generation += 1
                return
        self._nodes.append(n)
        self._msgs[n] = msg
        if msg is not None and self._view is not None:
            self._view.append(msg)

    def _fold_cut(self, e: Entry) -> None:
        before = e.data.get("before")
        if not isinstance(before, int) or isinstance(before, bool):
            before = e.n
        before = min(max(before, 0), e.n)
        if before < self._floor and not self._open_floor:
            raise ValueError(
                f"cut n={e.n} shows entries from n={before}, but this state was rebuilt from "
                f"n={self._floor}: fold the log from 0"
            )
        # Nodes under a cut never come back unless a later cut lowers `before`, and only the
        # visible ones can be replaced; they are kept because such a cut can show them again.
        self._cut = e.n
        self._before = before
        self._summary = cut_messages(e)
        self._view = None
        self._generation += 1

    def _locate(self, ref: int) -> int | None:
        """The position of visible node `ref`, or None when it is not one.

        Raises ValueError when the answer depends on history this state does not hold.
        """
        if ref < self._before:
            return None  # hidden by the last cut (or never a node): either way not visible
        if ref < self._floor:
            raise ValueError(
                f"a surface replace names n={ref}, older than n={self._floor} where this state was "
                "rebuilt from a cut: fold the log from 0"
            )
        if ref not in self._msgs:
            return None
        return self._nodes.index(ref)

    def _replace_span(self, op: SurfaceReplace) -> tuple[int, int] | None:
        i = self._locate(op.start)
        j = self._locate(op.end)
        if i is None or j is None or i > j:
            return None
        return i, j

    # ------------------------------------------------------------------ checks

    def surface_error(self, entry: Entry | EncodedEntry, own_n: int | None = None) -> str | None:
        """Why `entry`, appended next (at `own_n`, default `n`), has surface metadata a log must
        not hold — or None when it is fine. ValueError when this state lacks the history to tell."""
        surface = entry.surface
        if surface is None:
            return None
        n = self._n if own_n is None else own_n
        seqs = surface.source_event_seqs
        op = surface.op
        shadowed: list[int] = []
        if isinstance(op, SurfaceReplace):
            i = self._locate(op.start)
            if i is None:
                return f"surface replace: start seq {op.start} not found in surface"
            j = self._locate(op.end)
            if j is None:
                return f"surface replace: end seq {op.end} not found in surface"
            if i > j:
                return f"surface replace: start seq {op.start} (position {i}) is after end seq {op.end} (position {j})"
            if seqs is None:
                return "surface replace: sourceEventSeqs must list every replaced surface node"
            shadowed = self._nodes[i : j + 1]
        if seqs is None:
            return None
        if not seqs and isinstance(op, SurfaceReplace):
            return "sourceEventSeqs must not be empty"
        if len(set(seqs)) != len(seqs):
            return "sourceEventSeqs must not contain duplicates"
        for s in seqs:
            if s >= n:
                return f"sourceEventSeqs must reference earlier entries: {s} >= own n {n}"
            if s < 0:
                return f"sourceEventSeqs references unknown seq {s}"
        have = set(seqs)
        missing = [s for s in shadowed if s not in have]
        if missing:
            return (
                "surface replace: sourceEventSeqs must include every replaced surface node; "
                f"missing {', '.join(map(str, missing))}"
            )
        return None

    # ------------------------------------------------------------------ copies, snapshots

    def copy(self) -> ProjectionState:
        """An independent state (O(surface size); the Messages themselves are shared)."""
        new = ProjectionState.__new__(ProjectionState)
        new._n = self._n
        new._floor = self._floor
        new._open_floor = self._open_floor
        new._nodes = self._nodes.copy()
        new._msgs = self._msgs.copy()
        new._cut = self._cut
        new._before = self._before
        new._summary = self._summary
        new._view = None if self._view is None else self._view.copy()
        new._generation = self._generation
        new._classified = self._classified
        new._special = self._special.copy()
        return new

    def to_bytes(self) -> bytes:
        """The state as JSON (readable in redis-cli), headed by a CRC of the rest."""
        msgs = self._msgs
        known, special = self._classified, self._special
        rows: list[_StoredMessage | None] = []
        append = rows.append
        for k in self._nodes:
            m = msgs[k]
            if m is None:
                append(None)
            elif k >= known:
                append(row := _stored(m))
                if row.result is not None or row.nested:
                    special[k] = row.result is not None
            elif (kind := special.get(k)) is None:
                append(_StoredMessage(m.role, m.content, None, (), m.name))  # type: ignore[arg-type]
            else:
                append(_stored_as(m, kind))
        self._classified = self._n
        snap = _Snapshot(
            v=_SNAPSHOT_VERSION,
            n=self._n,
            floor=self._floor,
            cut=self._cut,
            before=self._before,
            generation=self._generation,
            nodes=self._nodes,
            summary=[_stored(m) for m in self._summary],
            msgs=rows,
        )
        # Encoded straight after a placeholder CRC member, then patched in place: no copy of the
        # (megabytes of) body but the final bytes(). The CRC covers the body as encoded, "{" first;
        # that "{" then becomes the "," after the CRC member.
        buf = bytearray(_CRC_HEAD + b"00000000" + b'"')
        _SNAPSHOT_ENCODER.encode_into(snap, buf, _BODY_AT)
        crc = zlib.crc32(memoryview(buf)[_BODY_AT:])
        buf[_BODY_AT] = ord(",")
        buf[len(_CRC_HEAD) : len(_CRC_HEAD) + 8] = b"%08x" % crc
        return bytes(buf)

    @classmethod
    def from_bytes(cls, blob: bytes) -> ProjectionState:
        """Load a `to_bytes` snapshot; anything damaged, foreign or inconsistent raises ValueError.

        Older snapshot formats are refused too (readers then fold from the log)."""
        try:
            blob = bytes(blob)
        except TypeError as e:
            raise ValueError(f"projection snapshot must be bytes: {e}") from None
        if len(blob) < _CRC_LEN or not blob.startswith(_CRC_HEAD) or blob[_CRC_LEN - 2 : _CRC_LEN] != b'",':
            raise ValueError("not a projection snapshot (no CRC header)")
        try:
            crc = int(blob[len(_CRC_HEAD) : _CRC_LEN - 2], 16)
        except ValueError:
            raise ValueError("projection snapshot: bad CRC header") from None
        if zlib.crc32(memoryview(blob)[_CRC_LEN:], _CRC_SEED) != crc:
            raise ValueError("projection snapshot is damaged (CRC mismatch)")
        # The CRC proves these are the bytes `to_bytes` wrote (or a writer as careful): the typed
        # decode and the structural checks below catch the rest. No per-block walk is needed.
        try:
            snap = _SNAPSHOT_DECODER.decode(blob)
        except msgspec.DecodeError as e:
            _check_version(blob)
            raise ValueError(f"projection snapshot does not decode: {e}") from None
        _check_snapshot(snap)
        nodes = snap.nodes
        special: dict[int, bool] = {}
        msgs = _loaded(snap.msgs, nodes, special)
        summary = snap.summary  # empty without a cut (checked)
        state = cls.__new__(cls)
        state._n = snap.n
        state._floor = snap.floor
        state._open_floor = False
        state._nodes = nodes
        state._msgs = dict(zip(nodes, msgs, strict=True))
        if len(state._msgs) != len(nodes):
            raise ValueError("inconsistent projection snapshot: a surface node listed twice")
        state._cut = snap.cut
        state._before = snap.before
        state._summary = tuple(m for m in _loaded(summary, [snap.cut or 0] * len(summary), {}) if m is not None)
        # The view now, at list speed: nearly every load reads messages() next.
        before = snap.before
        if not nodes or min(nodes) >= before:  # no hidden node (a state rebuilt from its cut)
            state._view = [*state._summary, *[m for m in msgs if m is not None]]
        else:
            state._view = [
                *state._summary,
                *[m for k, m in zip(nodes, msgs, strict=True) if k >= before and m is not None],
            ]
        state._generation = snap.generation
        state._classified = snap.n
        state._special = special
        return state

    @classmethod
    def from_cut(cls, cut: Entry, window: Iterable[Entry] = ()) -> ProjectionState:
        """The state right after `cut`, from the cut and the entries [cut.before, cut.n) alone.

        Fold the entries after the cut on top (``extend``) to reach the end of the log. Raises
        ValueError when `window` is not exactly those entries, or when the window holds a replace
        whose effect depends on older history (see the class docstring).
        """
        if cut.type != CUT:
            raise ValueError(f"from_cut needs a cut entry, got {cut.type!r}")
        before = cut.data.get("before")
        if not isinstance(before, int) or isinstance(before, bool) or not 0 <= before <= cut.n:
            raise ValueError(f"cut n={cut.n} has an invalid before={before!r}")
        state = cls()
        state._n = state._floor = before
        # Which older nodes were visible during the window is unknown: `_locate` must treat every
        # reference below the floor as unanswerable until a cut settles it.
        state._before = 0
        state._view = None
        state._open_floor = True
        try:
            state.extend(window)
        finally:
            state._open_floor = False
        if state._n != cut.n:
            raise ValueError(f"from_cut needs the entries [{before}, {cut.n}); they stop at n={state._n}")
        state.apply(cut)
        return state


def _check_version(blob: bytes) -> None:
    """A clearer error than the decoder's for a snapshot of another format version."""
    try:
        v = msgspec.json.decode(blob, type=_Version).v
    except msgspec.DecodeError:
        return
    if v != _SNAPSHOT_VERSION:
        raise ValueError(f"projection snapshot has format version {v!r}, expected {_SNAPSHOT_VERSION}")


def _check_snapshot(s: _Snapshot) -> None:
    def bad(why: str) -> NoReturn:
        raise ValueError(f"inconsistent projection snapshot: {why}")

    if s.v != _SNAPSHOT_VERSION:
        bad(f"format version {s.v}, expected {_SNAPSHOT_VERSION}")
    if not 0 <= s.floor <= s.n or s.generation < 0:
        bad("n/floor/generation out of range")
    nodes = s.nodes
    if len(nodes) != len(s.msgs):  # (`from_bytes` checks that they are distinct)
        bad("surface nodes do not match their messages")
    if nodes and (min(nodes) < s.floor or max(nodes) >= s.n):
        bad("a surface node outside [floor, n)")
    if s.cut is None:
        if s.before != 0 or s.summary or s.floor != 0:
            bad("a cut front without a cut")
    elif not s.floor <= s.before <= s.cut < s.n:
        bad("cut/before out of range")


def project(entries: Iterable[Entry]) -> list[Message]:
    """The projection of a whole log (entries with n = 0, 1, 2 …), folded from scratch."""
    state = ProjectionState()
    state.extend(entries)
    return state.messages()


def check_surface(state: ProjectionState, entries: Sequence[EncodedEntry | Entry], first_n: int) -> None:
    """Reject a batch whose surface metadata must not reach the log.

    `state` is the projection at `first_n` (not modified); the batch's entries apply one after
    another, so a replace may name a node appended earlier in the same batch. Raises
    `InvalidEntryError` (``index`` = batch position) for a replace whose start or end is not a
    visible surface node, whose start comes after its end by position, or whose sourceEventSeqs
    are missing, empty, duplicated, not earlier than the entry, unknown, or miss a replaced node;
    and for appends whose sourceEventSeqs are duplicated, unknown or not earlier.
    """
    if state.n != first_n:
        raise ValueError(f"check_surface needs the state at n={first_n}; it is at n={state.n}")
    last_replace = -1
    for i, e in enumerate(entries):
        if e.surface is not None and isinstance(e.surface.op, SurfaceReplace):
            last_replace = i
    scratch = state.copy() if last_replace >= 0 else state
    for i, e in enumerate(entries):
        own_n = first_n + i
        if isinstance(e, Entry) and e.n != own_n:
            raise InvalidEntryError(f"entry has n={e.n} at batch position of n={own_n}", index=i)
        why = scratch.surface_error(e, own_n)
        if why is not None:
            raise InvalidEntryError(why, index=i)
        if i >= last_replace:
            continue  # nothing later in the batch depends on this entry's effect
        stored = e if isinstance(e, Entry) else e.stored(own_n, e.time or 0)
        scratch.apply(stored)


__all__ = [
    "ProjectionState",
    "check_surface",
    "needs_rebuild",
    "project",
]
