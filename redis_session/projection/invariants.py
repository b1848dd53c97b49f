"""Log invariants (ChatLuna ``checkInvariants``, dsh turn enclosure) and dsh crash repair.

`check_invariants` reports, never repairs and never raises. `interrupted_turn_closers` computes the
entries that close a turn a crash left open; appending them is the caller's decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from msgspec import Struct

from ..errors import InvalidEntryError
from ..model import CUT, MESSAGE_TYPES, Entry, NewEntry, Surface, lossless_json
from .fold import ProjectionState
from .messages import assistant_blocks
from .request import HEADER, HEADER_DELTA, apply_header_delta, canonical_header


class Problem(Struct, frozen=True):
    """One broken invariant: the entry's `n` (None for the log as a whole), a stable `code`, and
    a message for people.

    Codes: ``n-gap``, ``data-json``, ``meta-json``, ``cut-before``, ``surface``, ``header-delta``,
    ``turn-number``, ``turn-nested``, ``turn-unmatched``, ``step-open``, ``step-number``,
    ``step-nested``, ``step-unmatched``, ``outside-turn``, ``turn-mismatch``, ``step-mismatch``,
    ``tool-unpaired``, ``check-failed``.
    """

    n: int | None
    code: str
    message: str


BOUNDARY_TYPES = frozenset({"turn/start", "turn/end", "step/start", "step/end"})
#: Types that only make sense inside a turn. Other types (user input, ChatLuna marks, plugin
#: marks) may be appended between turns: a queued user message or a preset switch is legal there.
TURN_SCOPED_TYPES = frozenset(
    {"assistant/chunk", "assistant/message", "tool/call", "tool/result", "step/start", "step/end"}
)

INTERRUPTED_TEXT = "Tool call interrupted by a crash; no result was recorded."

_Report = Callable[[int | None, str, str], None]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_interrupted_result(data: dict[str, Any]) -> bool:
    error = data.get("error")
    return bool(data.get("isError")) and isinstance(error, dict) and error.get("code") == "interrupted"


class _Turns:
    """The dsh turn/step enclosure state machine."""

    def __init__(self, add: _Report, problems: list[Problem] | None = None) -> None:
        self.add = add
        self.problems = problems
        # A streamed answer in a turn without its step/start names the step on every chunk row:
        # one problem for the run (first n, last n, step, types), not one per row.
        self._orphans: tuple[int, int, int, dict[str, int]] | None = None
        self.last_turn = 0
        self.turn: int | None = None
        self.last_step = 0
        self.step: int | None = None

    def see(self, e: Entry) -> None:
        t = e.type
        if t == "turn/start":
            self._turn_start(e)
        elif t == "turn/end":
            self._turn_end(e)
        elif t in TURN_SCOPED_TYPES or (t == "steering/message" and self.turn is not None):
            self._in_turn(e)

    def _turn_start(self, e: Entry) -> None:
        turn = _int(e.data.get("turn"))
        if self.turn is not None:
            self.add(e.n, "turn-nested", f"turn/start {turn} while turn {self.turn} is open")
        if turn is not None and turn != self.last_turn + 1:
            self.add(e.n, "turn-number", f"expected turn {self.last_turn + 1}, got {turn}")
        self.turn = turn if turn is not None else self.last_turn + 1
        self.last_turn = self.turn
        self.step, self.last_step = None, 0
        self._orphans = None

    def _turn_end(self, e: Entry) -> None:
        turn = _int(e.data.get("turn"))
        if self.turn is None:
            self.add(e.n, "turn-unmatched", "turn/end outside any open turn")
        else:
            if turn != self.turn:
                self.add(e.n, "turn-unmatched", f"turn/end {turn} does not match the open turn {self.turn}")
            if self.step is not None:
                self.add(e.n, "step-open", f"turn/end while step {self.step} is open")
        self.turn = self.step = None
        self._orphans = None

    def _in_turn(self, e: Entry) -> None:
        """An entry that must sit inside an open turn (and, for step-scoped ones, its step)."""
        t, d, n = e.type, e.data, e.n
        turn = _int(d.get("turn"))
        if self.turn is None:
            self.add(n, "outside-turn", f"{t} appended outside any open turn")
            return
        if turn is not None and turn != self.turn:
            self.add(n, "turn-mismatch", f"{t} names turn {turn}, but turn {self.turn} is open")
        if t == "step/start":
            self._orphans = None
            self._step_start(e)
        elif t == "step/end":
            self._orphans = None
            self._step_end(e)
        else:
            self._in_step(e)

    def _step_start(self, e: Entry) -> None:
        step = _int(e.data.get("step"))
        if self.step is not None:
            self.add(e.n, "step-nested", f"step/start {step} while step {self.step} is open")
        if step is not None and step != self.last_step + 1:
            self.add(e.n, "step-number", f"expected step {self.last_step + 1}, got {step}")
        self.step = step if step is not None else self.last_step + 1
        self.last_step = self.step

    def _orphan(self, n: int, t: str, step: int) -> bool:
        """Fold an entry naming `step` while no step is open into the run it continues (the
        problem already reported is rewritten to cover it); False: it starts a run, report it."""
        run, problems = self._orphans, self.problems
        if run is None or run[2] != step or problems is None or not problems or problems[-1].n != run[0]:
            self._orphans = (n, n, step, {t: 1})
            return False
        first, _, _, types = run
        types[t] = types.get(t, 0) + 1
        self._orphans = (first, n, step, types)
        kinds = ", ".join(f"{k} ×{c}" if c > 1 else k for k, c in types.items())
        problems[-1] = Problem(
            first,
            "step-mismatch",
            f"entries {first}..{n} ({kinds}) name step {step}, but no step is open: "
            f"a step/start {{turn, step: {step}}} belongs before them",
        )
        return True

    def _step_end(self, e: Entry) -> None:
        step = _int(e.data.get("step"))
        if self.step is None:
            self.add(e.n, "step-unmatched", "step/end with no open step")
        elif step != self.step:
            self.add(e.n, "step-mismatch", f"step/end {step} does not match the open step {self.step}")
        self.step = None

    def _in_step(self, e: Entry) -> None:
        t, d, n = e.type, e.data, e.n
        step = _int(d.get("step"))
        if step is not None and step != self.step:
            if self.step is None and self._orphan(n, t, step):
                pass
            else:
                where = "no step is open" if self.step is None else f"step {self.step} is open"
                self.add(n, "step-mismatch", f"{t} names step {step}, but {where}")


class _ToolPairing:
    """Every tool result answers a call made before it — in its own step, in a log that uses
    turn/step events (dsh), else anywhere earlier in the log.

    A call is a dsh ``tool/call`` mark, or a tool-call of an assistant message: the
    ``assistant/message`` or ``message`` (role assistant) content blocks and OpenAI `tool_calls`,
    read by `assistant_blocks` (the projection's one rule). A result is a ``tool/result`` (its
    ``callId``) or a ``message`` with role tool (its ``tool_call_id``); dsh's synthetic
    ``interrupted`` results are exempt."""

    SCOPES = BOUNDARY_TYPES

    def __init__(self, add: _Report, scoped: bool) -> None:
        self.add = add
        self.scoped = scoped
        self.calls: set[Any] = set()

    def see(self, e: Entry) -> None:
        t, d = e.type, e.data
        if t in self.SCOPES:
            if self.scoped:
                self.calls.clear()
        elif t == "tool/call":
            self.calls.add(_key(d.get("callId")))
        elif t == "assistant/message" or (t == "message" and d.get("role") == "assistant"):
            for block in assistant_blocks(d):
                if isinstance(block, dict) and block.get("type") == "tool-call":
                    self.calls.add(_key(block.get("id")))
        elif t == "tool/result":
            if _key(d.get("callId")) not in self.calls and not _is_interrupted_result(d):
                self._unpaired(e.n, f"tool/result for call {d.get('callId')!r}")
        elif t == "message" and d.get("role") == "tool" and _key(d.get("tool_call_id")) not in self.calls:
            self._unpaired(e.n, f"tool message for call {d.get('tool_call_id')!r}")

    def _unpaired(self, n: int, what: str) -> None:
        where = "in its step" if self.scoped else "before it"
        self.add(n, "tool-unpaired", f"{what} answers no tool call {where} (a tool/call or an assistant tool call)")


def _key(value: Any) -> Any:
    """A call id as a set member (an odd, unhashable id is compared by its JSON)."""
    try:
        hash(value)
    except TypeError:
        return _json_key(value)
    return value


def _json_key(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True, default=str)


def check_invariants(entries: Sequence[Entry]) -> list[Problem]:
    """Every broken invariant of a log, in log order. Never raises, never repairs.

    - n runs 0, 1, 2 … without gaps; data (and meta) are lossless JSON objects;
    - a cut's ``before`` lies in [0, the cut's n];
    - surface metadata is what `check_surface` would have let in (message types only; replaces
      name visible nodes in order, with complete sourceEventSeqs);
    - no ``request/header-delta`` before a snapshot, and each delta applies;
    - in logs that use turn/step events (dsh): turns numbered from 1 without gaps and never
      nested; turn/end matches the open turn with no step open; steps numbered from 1 in each turn,
      never nested; assistant/tool/step events inside an open turn, naming the open turn and step
      when they carry numbers. A log without turn/step events (ChatLuna, nanobot) has no turn
      problems. A turn still open at the end is not a problem: the session may be mid-turn;
    - tool pairing (`_ToolPairing`): every tool result answers a call made before it — a
      ``tool/call`` mark or an assistant message's tool call (blocks or OpenAI `tool_calls`) — in
      its own step in a log with turns, anywhere earlier otherwise (synthetic ``interrupted``
      results excepted).
    """
    problems: list[Problem] = []

    def add(n: int | None, code: str, message: str) -> None:
        problems.append(Problem(n, code, message))

    uses_turns = any(e.type in BOUNDARY_TYPES for e in entries)
    turns = _Turns(add, problems) if uses_turns else None
    pairing = _ToolPairing(add, scoped=uses_turns)
    state: ProjectionState | None = ProjectionState()
    header: dict[str, Any] | None = None
    expected = 0
    for e in entries:
        n = e.n
        if n != expected:
            add(n, "n-gap", f"expected n={expected}, got n={n}")
            state = None  # the surface cannot be followed across a gap
        expected = n + 1
        if not isinstance(e.data, dict):
            add(n, "data-json", f"data must be a JSON object, got {type(e.data).__name__}")
            state = None
            continue
        # Each check runs on its own, so one odd payload cannot hide the others' findings.
        try:
            _check_entry(e, add)
        except Exception as err:
            add(n, "check-failed", f"{type(err).__name__}: {err}")
        if state is not None:
            try:
                why = state.surface_error(e)
                if why is not None:
                    add(n, "surface", why)
                state.apply(e)
            except Exception as err:
                add(n, "check-failed", f"surface: {type(err).__name__}: {err}")
                state = None
        if e.type == HEADER or e.type == HEADER_DELTA:
            header = _fold_header(header, e, add)
        if turns is not None:
            try:
                turns.see(e)
            except Exception as err:
                add(n, "check-failed", f"turns: {type(err).__name__}: {err}")
        try:
            pairing.see(e)
        except Exception as err:
            add(n, "check-failed", f"tool pairing: {type(err).__name__}: {err}")
    return problems


def _check_entry(e: Entry, add: _Report) -> None:
    n = e.n
    try:
        lossless_json(e.data, "data")
    except InvalidEntryError as err:
        add(n, "data-json", str(err))
    if e.meta is not None:
        try:
            lossless_json(e.meta, "meta")
        except InvalidEntryError as err:
            add(n, "meta-json", str(err))
    if e.type == CUT:
        before = _int(e.data.get("before"))
        if before is None or not 0 <= before <= n:
            add(n, "cut-before", f"cut.before={e.data.get('before')!r} is outside [0, {n}]")
    if e.surface is not None and e.type not in MESSAGE_TYPES:
        add(n, "surface", f"{e.type!r} is not surface-eligible and cannot carry surface metadata")


def _fold_header(header: dict[str, Any] | None, e: Entry, add: _Report) -> dict[str, Any] | None:
    if e.type == HEADER:
        h = e.data.get("header")
        if isinstance(h, dict):
            return canonical_header(h)
        add(e.n, "header-delta", "request/header holds no header object")
        return None
    if header is None:
        add(e.n, "header-delta", "request/header-delta before any request/header snapshot")
        return None
    try:
        return apply_header_delta(header, e.data)
    except Exception as err:
        add(e.n, "header-delta", f"request/header-delta does not apply: {err}")
        return None


class _OpenTurn:
    """What a crash left open, scanned in log order: the turn, its step, and unanswered calls."""

    def __init__(self) -> None:
        self.open = False
        self.turn: int | None = None
        self.step: int | None = None
        self.pending: dict[Any, tuple[int | None, int | None]] = {}  # call id → (step, tool/call n)
        self.logged: dict[Any, int] = {}  # tool/call ids of the current step → n

    def _forget_calls(self) -> None:
        self.pending.clear()
        self.logged.clear()

    def see(self, e: Entry) -> None:
        t, d = e.type, e.data
        if t in ("turn/start", "turn/end"):
            self.open = t == "turn/start"
            self.turn = _int(d.get("turn")) if self.open else None
            self.step = None
            self._forget_calls()
        elif t == "step/start":
            self.step = _int(d.get("step"))
        elif t == "step/end":
            self.step = None
            self._forget_calls()
        elif t == "assistant/message":
            for block in assistant_blocks(d):
                if isinstance(block, dict) and block.get("type") == "tool-call":
                    call_id = block.get("id")
                    self.pending.setdefault(call_id, (_int(d.get("step")) or self.step, self.logged.get(call_id)))
        elif t == "tool/call":
            call_id = d.get("callId")
            self.logged[call_id] = e.n
            if call_id in self.pending:
                self.pending[call_id] = (self.pending[call_id][0], e.n)
        elif t == "tool/result":
            self.pending.pop(d.get("callId"), None)


def interrupted_turn_closers(entries: Sequence[Entry]) -> list[NewEntry]:
    """The entries that close a turn a crash left open (dsh ``interruptedTurnClosers``), to append
    after `entries`; [] when no turn is open.

    In order: a synthetic error ``tool/result`` for each tool-call block of the open step's
    assistant messages that has no result yet (log order; ``sourceEventSeqs`` = the n of its
    ``tool/call`` when one was logged — calls without an assistant block get nothing), then
    ``step/end`` if a step is open, then ``turn/end {reason: {kind: "interrupted"}}``. Every closer
    takes the last entry's time, so the repair is deterministic.
    """
    scan = _OpenTurn()
    for e in entries:
        scan.see(e)
    if not scan.open:
        return []
    turn, time = scan.turn, entries[-1].time
    closers: list[NewEntry] = []
    for call_id, (call_step, call_n) in scan.pending.items():
        data: dict[str, Any] = {"turn": turn}
        if call_step is not None:
            data["step"] = call_step
        data["callId"] = call_id
        data["content"] = [{"type": "text", "text": INTERRUPTED_TEXT}]
        data["isError"] = True
        data["error"] = {"name": "InterruptedError", "code": "interrupted"}
        seqs = None if call_n is None else [call_n]
        closers.append(NewEntry("tool/result", data, surface=Surface("append", seqs), time=time))
    if scan.step is not None:
        closers.append(NewEntry("step/end", {"turn": turn, "step": scan.step}, time=time))
    closers.append(NewEntry("turn/end", {"turn": turn, "reason": {"kind": "interrupted"}}, time=time))
    return closers


__all__ = [
    "BOUNDARY_TYPES",
    "INTERRUPTED_TEXT",
    "TURN_SCOPED_TYPES",
    "Problem",
    "check_invariants",
    "interrupted_turn_closers",
]
