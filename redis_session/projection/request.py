"""The request envelope, folded from the log (dsh ``request/header`` events, ChatLuna ``prompt`` marks).

A header is a JSON object; dsh's shape is ``{config, system?, tools?, messagePrefix?}`` (a request is
``messagePrefix + the projection``). ``request/header`` entries carry a full snapshot
(``{header, reason}``), ``request/header-delta`` entries amend it:

- ``system``: ``{keepStart, keepEnd, insert}`` — keep that many lines at each end, put ``insert``
  between (lines split on ``\\n``; no system prompt is zero lines);
- ``tools``: ``{added, removed, changed}`` keyed by tool name (``name`` or ``function.name``):
  drop the removed, replace the changed in place, append the added;
- ``config``, ``messagePrefix``: replaced whole (an empty ``messagePrefix`` means none).

Pure functions, no I/O. Every function works on canonical headers (`canonical_header`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from msgspec import Struct

from ..errors import InvalidEntryError
from ..model import Entry, NewEntry
from .fold import project
from .messages import Message

HEADER = "request/header"
HEADER_DELTA = "request/header-delta"
PROMPT = "prompt"

_LIST_FIELDS = ("tools", "messagePrefix", "prelude")
DIGEST_FIELDS = (
    "provider",
    "model",
    "reasoningEffort",
    "temperature",
    "maxTokens",
    "stop",
    "system",
    "prelude",
    "tools",
)


def canonical_header(h: Mapping[str, Any]) -> dict[str, Any]:
    """A new header without empty fields: a None value, an empty system prompt and an empty tools /
    messagePrefix / prelude list are absent, so "none" has one spelling. The input is not changed."""
    out: dict[str, Any] = {}
    for key, value in h.items():
        if value is None:
            continue
        if key == "system" and value == "":
            continue
        if key in _LIST_FIELDS and isinstance(value, (list, tuple)) and not value:
            continue
        out[key] = value
    return out


# --------------------------------------------------------------------------- system lines


def _lines(system: Any) -> list[str]:
    return [] if system is None else str(system).split("\n")


def _diff_system(old: Any, new: Any) -> dict[str, Any]:
    a, b = _lines(old), _lines(new)
    keep_start = 0
    while keep_start < len(a) and keep_start < len(b) and a[keep_start] == b[keep_start]:
        keep_start += 1
    keep_end = 0
    while (
        keep_end < len(a) - keep_start
        and keep_end < len(b) - keep_start
        and a[len(a) - 1 - keep_end] == b[len(b) - 1 - keep_end]
    ):
        keep_end += 1
    return {"keepStart": keep_start, "keepEnd": keep_end, "insert": b[keep_start : len(b) - keep_end]}


def _apply_system(old: Any, delta: Any) -> str | None:
    a = _lines(old)
    if not isinstance(delta, Mapping):
        raise InvalidEntryError(f"system delta must be an object, got {type(delta).__name__}")
    start, end, insert = delta.get("keepStart"), delta.get("keepEnd"), delta.get("insert")
    if (
        not isinstance(start, int)
        or not isinstance(end, int)
        or start < 0
        or end < 0
        or start + end > len(a)
        or not isinstance(insert, list)
        or not all(isinstance(line, str) for line in insert)
    ):
        raise InvalidEntryError(f"system delta {dict(delta)!r} does not fit a {len(a)}-line system prompt")
    lines = a[:start] + insert + a[len(a) - end :]
    return "\n".join(lines) if lines else None


# --------------------------------------------------------------------------- tools


def tool_name(tool: Any) -> Any:
    """A tool schema's name: ``name``, or ``function.name`` for OpenAI-shaped tools."""
    if not isinstance(tool, Mapping):
        return None
    if "name" in tool:
        return tool["name"]
    fn = tool.get("function")
    return fn.get("name") if isinstance(fn, Mapping) else None


def _diff_tools(old: Sequence[Any], new: Sequence[Any]) -> dict[str, Any]:
    old_by_name = {tool_name(t): t for t in old}
    new_names = {tool_name(t) for t in new}
    return {
        "added": [t for t in new if tool_name(t) not in old_by_name],
        "removed": [tool_name(t) for t in old if tool_name(t) not in new_names],
        "changed": [t for t in new if tool_name(t) in old_by_name and old_by_name[tool_name(t)] != t],
    }


def _apply_tools(old: Sequence[Any], delta: Any) -> list[Any]:
    if not isinstance(delta, Mapping):
        raise InvalidEntryError(f"tools delta must be an object, got {type(delta).__name__}")
    removed = set(delta.get("removed") or ())
    changed = {tool_name(t): t for t in delta.get("changed") or ()}
    kept = [changed.get(tool_name(t), t) for t in old if tool_name(t) not in removed]
    return kept + list(delta.get("added") or ())


# --------------------------------------------------------------------------- diff / apply / fold


def diff_header(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``request/header-delta`` payload from `old` to `new`, or None when their canonical forms
    are equal.

    The encoding cannot express every change — a pure reordering of tools, a removed ``config``, a
    change to a field other than system/tools/config/messagePrefix — so a writer checks
    ``apply_header_delta(old, delta) == canonical_header(new)`` and logs a full snapshot when it
    fails (`header_entry` does both).
    """
    a, b = canonical_header(old), canonical_header(new)
    if a == b:
        return None
    delta: dict[str, Any] = {}
    if a.get("system") != b.get("system"):
        delta["system"] = _diff_system(a.get("system"), b.get("system"))
    old_tools, new_tools = list(a.get("tools") or ()), list(b.get("tools") or ())
    if old_tools != new_tools:
        delta["tools"] = _diff_tools(old_tools, new_tools)
    if a.get("config") != b.get("config") and "config" in b:
        delta["config"] = b["config"]
    if a.get("messagePrefix") != b.get("messagePrefix"):
        delta["messagePrefix"] = list(b.get("messagePrefix") or ())
    return delta


def apply_header_delta(h: Mapping[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical header `delta` turns `h` into. A delta that cannot apply (a system trim longer
    than the prompt, a malformed field) raises `InvalidEntryError`."""
    out = canonical_header(h)
    if delta.get("system") is not None:
        system = _apply_system(out.get("system"), delta["system"])
        out["system"] = system
    if delta.get("tools") is not None:
        out["tools"] = _apply_tools(list(out.get("tools") or ()), delta["tools"])
    if delta.get("config") is not None:
        out["config"] = delta["config"]
    if delta.get("messagePrefix") is not None:
        if not isinstance(delta["messagePrefix"], list):
            raise InvalidEntryError("messagePrefix delta must be a list of messages")
        out["messagePrefix"] = delta["messagePrefix"]
    return canonical_header(out)


def _snapshot_of(entry: Entry) -> dict[str, Any]:
    if entry.type == PROMPT:
        # A ChatLuna prompt snapshot: {header, turn, step, reason, sources}; a bare header works too.
        header = entry.data.get("header", entry.data)
    else:
        header = entry.data.get("header")
    if not isinstance(header, Mapping):
        raise InvalidEntryError(f"{entry.type} at n={entry.n} holds no header object")
    return canonical_header(header)


def _fold(entries: Iterable[Entry], *, prompts: bool) -> dict[str, Any] | None:
    state: dict[str, Any] | None = None
    for e in entries:
        t = e.type
        if t == HEADER or (prompts and t == PROMPT):
            state = _snapshot_of(e)
        elif t == HEADER_DELTA:
            if state is None:
                raise InvalidEntryError(f"{HEADER_DELTA} at n={e.n} before any {HEADER} snapshot: corrupt log")
            state = apply_header_delta(state, e.data)
    return state


def fold_request_header(entries: Iterable[Entry]) -> dict[str, Any] | None:
    """The header in force after `entries` (a log or any prefix of one): the latest
    ``request/header`` snapshot with the deltas after it applied; None when there is no header
    event. A delta before any snapshot raises `InvalidEntryError`."""
    return _fold(entries, prompts=False)


def header_entry(
    previous: Mapping[str, Any] | None, header: Mapping[str, Any], *, reason: str = "initial"
) -> NewEntry | None:
    """The entry that records `header` after `previous` (the folded header, or None): nothing when
    they are equal, a delta when one round-trips, else a snapshot (reason `reason` when there was
    no previous header, ``"fallback"`` when a delta could not express the change)."""
    new = canonical_header(header)
    if previous is None:
        return NewEntry(HEADER, {"header": new, "reason": reason})
    old = canonical_header(previous)
    delta = diff_header(old, new)
    if delta is None:
        return None
    if delta and apply_header_delta(old, delta) == new:
        return NewEntry(HEADER_DELTA, delta)
    return NewEntry(HEADER, {"header": new, "reason": "fallback"})


# --------------------------------------------------------------------------- digest, reconstruction


def _canonical_json(value: Any) -> Any:
    # 1.0 and 1 must digest alike (JSON has one number type, and JS writes 1.0 as 1).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical_json(v) for v in value]
    return value


def prompt_digest(header: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON (sorted keys, no spaces, integral floats as ints) of the
    fields that decide a prompt epoch: provider, model, reasoningEffort, temperature, maxTokens,
    stop, system, prelude, tools.

    Each is read from the header, else from its ``config`` (dsh keeps model settings there);
    ``prelude`` falls back to dsh's ``messagePrefix``. Absent, None and empty are the same. Other
    fields (a prompt's turn, reason, sources) do not change the digest.
    """
    config = header.get("config")
    config = config if isinstance(config, Mapping) else {}
    picked: dict[str, Any] = {}
    for key in DIGEST_FIELDS:
        value = header[key] if key in header else config.get(key)
        if key == "prelude" and value is None:
            value = header.get("messagePrefix")
        if value == "" or (isinstance(value, (list, tuple)) and not value):
            value = None
        picked[key] = _canonical_json(value)
    raw = json.dumps(picked, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(raw.encode()).hexdigest()


class ReconstructedRequest(Struct, frozen=True):
    """What was sent at entry `at`: the header in force (None when the log has none), the
    projection of entries [0, at), and the header's `prompt_digest` (None without a header).
    The message list a provider got is ``header["messagePrefix"]`` (if any) + `messages`."""

    header: dict[str, Any] | None
    messages: list[Message]
    digest: str | None


def reconstruct_request(entries: Sequence[Entry], at: int) -> ReconstructedRequest:
    """Rebuild the request made at entry `at` from the log: `entries` is the log from n=0 (at
    least `at` entries). The header is the latest ``prompt`` mark or ``request/header`` snapshot
    before `at` plus the ``request/header-delta`` entries after it; the messages are
    ``project(entries[:at])``."""
    if not 0 <= at <= len(entries):
        raise ValueError(f"at={at} is outside [0, {len(entries)}] (the entries given)")
    prefix = entries[:at]
    messages = project(prefix)
    header = _fold(prefix, prompts=True)
    return ReconstructedRequest(
        header=header, messages=messages, digest=None if header is None else prompt_digest(header)
    )


__all__ = [
    "DIGEST_FIELDS",
    "ReconstructedRequest",
    "apply_header_delta",
    "canonical_header",
    "diff_header",
    "fold_request_header",
    "header_entry",
    "prompt_digest",
    "reconstruct_request",
    "tool_name",
]
