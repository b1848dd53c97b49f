"""The legacy drop-in: nanobot's ``SessionManager`` and ``Session`` for nanobot up to 8656549
(2026-06-27), before nanobot had a persistence seam of its own.

**For nanobot 0.3.x (``pip install nanobot-ai``) use
`redis_session.adapters.nanobot_store.RedisNanobotStore`** instead: nanobot's own
``SessionManager(workspace, store=RedisNanobotStore())`` then runs unchanged on the log. This
module is a port of that older nanobot's manager, kept for deployments still on it; both read and
write the same log layout (`redis_session.projection.nanobot`), so a session moves from one to
the other as it is.

>>> from redis_session.adapters.nanobot import LegacySessionManager as SessionManager
>>> sessions = SessionManager()      # $REDIS_URL, else the embedded server; or a URL, store, `Sessions`
>>> s = sessions.get_or_create("telegram:12345")
>>> s.add_message("user", "hello")
>>> sessions.save(s)
>>> s.get_history(max_messages=120)
[{'role': 'user', 'content': 'hello'}]

The API is nanobot's (HKUDS/nanobot ``nanobot/session/manager.py`` at 8656549129e7), synchronous
as nanobot's is: `Session` is the same dataclass (``key, messages, created_at, updated_at,
metadata, last_consolidated``) with the same ``add_message``, ``get_history``, ``clear``,
``retain_recent_legal_suffix`` and ``enforce_file_cap``, ported rule for rule; `SessionManager`
has ``get_or_create``, ``save``, ``flush_all``, ``invalidate``, ``delete_session`` (and
``delete``), ``read_session_file``, ``list_sessions`` and ``fork_session_before_user_index``.
The manager runs the store on a private event-loop thread, so it can be called from plain code
and from inside nanobot's coroutines alike (as nanobot calls its file-backed manager).

**What is stored.** nanobot rewrites a whole JSONL file per save; here a save appends only what
changed since this session was loaded or last saved, in one ``put`` with the expected n:

- each new message → a ``message`` entry whose data is the nanobot message itself (``timestamp``,
  ``tool_calls``, ``name``, ``reasoning_content``, ``thinking_blocks``, ``media``, ``cli_apps``,
  ``_channel_delivery`` … all kept); a ``_command`` message → a ``nanobot/command`` mark (nanobot
  never sends those to the model, so the generic projection must not either);
- changed ``metadata`` → a ``nanobot/metadata`` mark holding the whole new metadata;
- a moved ``last_consolidated``, messages dropped from the front (``clear``,
  ``retain_recent_legal_suffix``, ``enforce_file_cap``, an ``AutoCompact`` idle compaction) or a
  new ``metadata["_last_summary"]`` → a ``cut``: ``before`` is the entry of the first message past
  ``last_consolidated`` (what the model still sees), ``summary`` is the consolidation summary as
  one user message (``[Archived Context Summary]`` …, the text nanobot puts in its prompt), and
  ``meta.nanobot.floor`` is the entry of ``messages[0]`` (what the session still keeps). Nothing is
  ever deleted: the log keeps every message; ``Session.messages()`` of the generic API shows the
  summary and the unconsolidated messages, as nanobot's prompt does.
- a cut written by another tool (a compactor, ``Session.compact``) moves ``last_consolidated``
  to the messages below its ``before`` and drops none; its summary is carried into the adapter's
  later cuts until a ``clear`` or a nanobot ``_last_summary`` replaces it;
- a change that is no drop-from-the-front plus appends (a message edited in place, the
  non-contiguous window ``retain_recent_legal_suffix`` keeps when the tail has no user message)
  re-appends the messages the session now holds, followed by a cut whose floor is the first of
  them.

**Concurrency.** Two managers (two pods) saving one session never interleave: the second ``save``
raises `SessionConflictError`; call ``invalidate(key)``, ``get_or_create(key)`` again (it reads
the winner's messages), reapply the change and save.

**Another life.** A session read from (or created as) one life of the id never writes into
another: after the id was deleted and created again, ``save`` raises `SessionReplacedError`.

**Differences from nanobot's files**, by design: any key works (`redis_session.projection.nanobot.key_to_id`
maps it to a session id reversibly: ``discord:guild 42`` → ``discord:guild%2042``; pass
``key_to_id`` for another mapping); ``save(fsync=True)`` is
accepted and means nothing more (a write is durable as the server's persistence is);
``get_history`` counts tokens with nanobot's fallback estimator (characters / 4), not tiktoken.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ..errors import InvalidEntryError, SessionAlreadyExistsError, SessionConflictError, SessionNotFoundError
from ..keys import Keys, validate_session_id
from ..model import CUT, Entry, NewEntry, SessionHead, SessionHeader
from ..projection import nanobot as nanobot_log
from ..store import SessionStore
from ._log import resolve_store

T = TypeVar("T")
_logger = logging.getLogger(__name__)

FILE_MAX_MESSAGES = 2000
MESSAGE = "message"
COMMAND = "nanobot/command"
METADATA = "nanobot/metadata"
#: The cut reasons this adapter writes (``nanobot:<why>``).
REASON_PREFIX = "nanobot:"

_MESSAGE_TIME_PREFIX_RE = re.compile(r"^\[Message Time: [^\]]+\]\n?")
_LOCAL_IMAGE_BREADCRUMB_RE = re.compile(r"^\[image: (?:/|~)[^\]]+\]\s*$")
_TOOL_CALL_ECHO_RE = re.compile(r"^\s*(?:generate_image|message)\([^)]*\)\s*$")
_UNSAFE_CHARS = re.compile(r'[<>:"/\\|?*]')
_THINK_RE = re.compile(r"<(think|thinking|thought)>[\s\S]*?(?:</\1>|$)", re.IGNORECASE)
_SESSION_PREVIEW_MAX_CHARS = 120
_SESSION_LIST_PREVIEW_MAX_RECORDS = 200
_SESSION_LIST_PREVIEW_MAX_CHARS = 1_000_000
_FORK_VOLATILE_METADATA_KEYS = {
    "goal_state",
    "pending_user_turn",
    "runtime_checkpoint",
    "thread_goal",
    "title",
    "title_user_edited",
}


# --------------------------------------------------------------------------- nanobot's helpers


def recent_message_start_index(
    messages: Sequence[dict[str, Any]], max_messages: int, *, extend_to_user: bool = False
) -> int:
    """Where a replay window of `max_messages` starts (nanobot's helper of the same name)."""
    if max_messages <= 0:
        return len(messages)
    start_idx = max(0, len(messages) - max_messages)
    if not extend_to_user or len(messages) <= max_messages:
        return start_idx
    if any(messages[i].get("role") == "user" for i in range(start_idx, len(messages))):
        return start_idx
    recovered = next((i for i in range(start_idx - 1, -1, -1) if messages[i].get("role") == "user"), None)
    if recovered is None:
        return start_idx
    if recovered > 0 and messages[recovered - 1].get("_channel_delivery"):
        return recovered - 1
    return recovered


def find_legal_message_start(messages: Sequence[dict[str, Any]]) -> int:
    """The first index after which every tool result's call is declared (nanobot's helper)."""
    declared: set[str] = set()
    start = 0
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "assistant":
            for tc in msg.get("tool_calls") or []:
                if isinstance(tc, dict) and tc.get("id"):
                    declared.add(str(tc["id"]))
        elif role == "tool":
            tid = msg.get("tool_call_id")
            if tid and str(tid) not in declared:
                start = i + 1
                declared.clear()
    return start


def estimate_message_tokens(message: dict[str, Any]) -> int:
    """nanobot's ``estimate_message_tokens`` without tiktoken: a quarter of the characters + 4."""
    content = message.get("content")
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text", "")
                if text:
                    parts.append(text)
            else:
                parts.append(json.dumps(part, ensure_ascii=False))
    elif content is not None:
        parts.append(json.dumps(content, ensure_ascii=False))
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if isinstance(value, str) and value:
            parts.append(value)
    if message.get("tool_calls"):
        parts.append(json.dumps(message["tool_calls"], ensure_ascii=False))
    rc = message.get("reasoning_content")
    if isinstance(rc, str) and rc:
        parts.append(rc)
    payload = "\n".join(parts)
    if not payload:
        return 4
    return max(4, len(payload) // 4 + 4)


def _sanitize_assistant_replay_text(content: str) -> str:
    """Drop replay artifacts a model may copy: a leading time stamp, local image breadcrumbs,
    tool-call echo lines."""
    content = _MESSAGE_TIME_PREFIX_RE.sub("", content, count=1)
    lines = [
        line
        for line in content.splitlines()
        if not _LOCAL_IMAGE_BREADCRUMB_RE.match(line) and not _TOOL_CALL_ECHO_RE.match(line)
    ]
    return "\n".join(lines).strip()


def _image_placeholder_text(path: str | None, *, empty: str = "[image]") -> str:
    return f"[image: {path}]" if path else empty


def _with_breadcrumbs(content: str, lines: list[str]) -> str:
    if not lines:
        return content
    crumbs = "\n".join(lines)
    return f"{content}\n{crumbs}" if content else crumbs


def _attachment_lines(items: list[Any], render: Callable[[str, dict[str, Any]], str]) -> list[str]:
    out: list[str] = []
    for item in items[:8]:
        if not isinstance(item, dict):
            continue
        name = str(item.get("name") or "").strip().lower()
        if name:
            out.append(render(name, item))
    return out


def _cli_app_line(name: str, item: dict[str, Any]) -> str:
    entry = str(item.get("entry_point") or "unknown").strip() or "unknown"
    return f"[CLI App Attachment: @{name}; tool=run_cli_app; entry_point={entry}; skill=skills/cli-app-{name}/SKILL.md]"


def _mcp_preset_line(name: str, item: dict[str, Any]) -> str:
    transport = str(item.get("transport") or "mcp").strip() or "mcp"
    return f"[MCP Preset Attachment: @{name}; tool_prefix=mcp_{name}_; transport={transport}]"


def _strip_think(text: str) -> str:
    return _THINK_RE.sub("", text).strip()


def _text_preview(content: Any) -> str:
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = " ".join(
            b["text"]
            for b in content
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    else:
        return ""
    text = re.sub(r"\s+", " ", _sanitize_assistant_replay_text(text)).strip()
    if len(text) > _SESSION_PREVIEW_MAX_CHARS:
        text = text[: _SESSION_PREVIEW_MAX_CHARS - 1].rstrip() + "…"
    return text


def _metadata_title(metadata: Any) -> str:
    if not isinstance(metadata, dict):
        return ""
    title = metadata.get("title")
    if not isinstance(title, str):
        return ""
    return title if metadata.get("title_user_edited") is True else _strip_think(title)


def summary_text(metadata: dict[str, Any]) -> str | None:
    """The consolidation summary nanobot would put in the prompt for this metadata, or None.

    nanobot's context builder adds ``[Archived Context Summary]\\n\\n`` + AutoCompact's
    ``Previous conversation summary (last active …):\\n<text>`` to the system prompt."""
    meta = metadata.get("_last_summary")
    if isinstance(meta, dict) and isinstance(meta.get("text"), str) and meta["text"]:
        text = meta["text"]
        last_active = meta.get("last_active")
        if isinstance(last_active, str) and last_active:
            text = f"Previous conversation summary (last active {last_active}):\n{text}"
        return f"[Archived Context Summary]\n\n{text}"
    if isinstance(meta, str) and meta:
        return f"[Archived Context Summary]\n\n{meta}"
    return None


def _now() -> datetime:
    return datetime.now()


def _encode(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError, RecursionError) as e:  # nested too deep, mixed key types
        raise InvalidEntryError(f"a nanobot message or metadata value is not JSON-serializable: {e}") from None


# --------------------------------------------------------------------------- Session


@dataclass
class _Saved:
    """What the log holds for a session, as this process last read or wrote it."""

    n: int = 0  # the log's n
    exists: bool = False
    incarnation: str | None = None  # the life of the id this session was read from / created as
    messages: list[dict[str, Any]] = field(default_factory=list)  # the dicts handed out, by identity
    ns: list[int] = field(default_factory=list)  # their entry n
    encoded: list[str] = field(default_factory=list)  # their content then (edits in place show)
    metadata: str = _encode({})
    floor: int = 0  # entry n of messages[0] (where the kept messages start)
    before: int = 0  # the last cut's `before` (0: no cut)
    summary: list[dict[str, Any]] = field(default_factory=list)
    foreign: bool = False  # the summary came from a cut another tool wrote (kept until a clear)


@dataclass
class Session:
    """A conversation session, nanobot's dataclass: `messages` is the list nanobot keeps,
    ``messages[last_consolidated:]`` what the model still sees."""

    key: str  # channel:chat_id
    messages: list[dict[str, Any]] = field(default_factory=list)
    created_at: datetime = field(default_factory=_now)
    updated_at: datetime = field(default_factory=_now)
    metadata: dict[str, Any] = field(default_factory=dict)
    last_consolidated: int = 0  # Number of messages already consolidated to files
    _saved: _Saved = field(default_factory=_Saved, repr=False, compare=False)
    _reason: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # An out-of-range offset (corrupt metadata) would hide all history; reset it.
        lc: Any = self.last_consolidated
        if isinstance(lc, bool) or not isinstance(lc, int) or not 0 <= lc <= len(self.messages):
            self.last_consolidated = 0

    @staticmethod
    def _annotate_message_time(message: dict[str, Any], content: Any) -> Any:
        # Only user turns: stamping assistant turns teaches the model to stamp its replies.
        timestamp = message.get("timestamp")
        if not timestamp or not isinstance(content, str) or message.get("role") != "user":
            return content
        return f"[Message Time: {timestamp}]\n{content}"

    def add_message(self, role: str, content: Any, **kwargs: Any) -> None:
        """Add a message to the session (saved by `SessionManager.save`)."""
        self.messages.append({"role": role, "content": content, "timestamp": datetime.now().isoformat(), **kwargs})
        self.updated_at = datetime.now()

    def get_history(  # noqa: C901 - nanobot's own rule, kept in one piece to compare
        self,
        max_messages: int = 120,
        *,
        max_tokens: int = 0,
        include_timestamps: bool = False,
        extend_to_user: bool = False,
    ) -> list[dict[str, Any]]:
        """Unconsolidated messages for LLM input, nanobot's rules: at most `max_messages` (≤ 0
        means 120), then at most `max_tokens` from the tail; starting at a user message (or a
        channel delivery just before it) with no orphan tool results; ``_command`` messages
        counted but not returned; media, CLI-app and MCP-preset breadcrumbs added to user text;
        assistant replay text cleaned; `include_timestamps` stamps user messages."""
        unconsolidated = self.messages[self.last_consolidated :]
        max_messages = max_messages if max_messages > 0 else 120
        sliced = unconsolidated[
            recent_message_start_index(unconsolidated, max_messages, extend_to_user=extend_to_user) :
        ]

        # Avoid starting mid-turn, except for a proactive delivery the user may be replying to.
        for i, message in enumerate(sliced):
            if message.get("role") == "user":
                start = i - 1 if i > 0 and sliced[i - 1].get("_channel_delivery") else i
                sliced = sliced[start:]
                break
        start = find_legal_message_start(sliced)
        if start:
            sliced = sliced[start:]

        out: list[dict[str, Any]] = []
        for message in sliced:
            if message.get("_command"):
                continue
            content = message.get("content", "")
            role = message.get("role")
            if role == "assistant" and isinstance(content, str):
                content = _sanitize_assistant_replay_text(content)
            if role == "user" and isinstance(content, str):
                # An image-only turn would otherwise replay as an empty user message.
                media = message.get("media")
                if isinstance(media, list) and media:
                    content = _with_breadcrumbs(
                        content, [_image_placeholder_text(p) for p in media if isinstance(p, str) and p]
                    )
                cli_apps = message.get("cli_apps")
                if isinstance(cli_apps, list) and cli_apps:
                    content = _with_breadcrumbs(content, _attachment_lines(cli_apps, _cli_app_line))
                presets = message.get("mcp_presets")
                if isinstance(presets, list) and presets:
                    content = _with_breadcrumbs(content, _attachment_lines(presets, _mcp_preset_line))
            if include_timestamps:
                content = self._annotate_message_time(message, content)
            if (
                role == "assistant"
                and isinstance(content, str)
                and not content.strip()
                and not any(k in message for k in ("tool_calls", "reasoning_content", "thinking_blocks"))
            ):
                continue
            entry: dict[str, Any] = {"role": message["role"], "content": content}
            for key in ("tool_calls", "tool_call_id", "name", "reasoning_content", "thinking_blocks"):
                if key in message:
                    entry[key] = message[key]
            out.append(entry)

        if max_tokens > 0 and out:
            kept: list[dict[str, Any]] = []
            used = 0
            for message in reversed(out):
                tokens = estimate_message_tokens(message)
                if kept and used + tokens > max_tokens:
                    break
                kept.append(message)
                used += tokens
            kept.reverse()
            first_user = next((i for i, m in enumerate(kept) if m.get("role") == "user"), None)
            if first_user is not None:
                kept = kept[first_user:]
            else:
                # A tight budget can leave an assistant-only tail: go back to the nearest user
                # message even past the budget.
                recovered = next((i for i in range(len(out) - 1, -1, -1) if out[i].get("role") == "user"), None)
                if recovered is not None:
                    kept = out[recovered:]
            start = find_legal_message_start(kept)
            if start:
                kept = kept[start:]
            out = kept
        return out

    def clear(self) -> None:
        """Forget every message (``/new``); saved as a cut that hides them, never a deletion."""
        self.messages = []
        self.last_consolidated = 0
        self.updated_at = datetime.now()
        self.metadata.pop("_last_summary", None)
        self._reason = REASON_PREFIX + "clear"

    def retain_recent_legal_suffix(
        self, max_messages: int, *, extend_to_user: bool = False
    ) -> tuple[list[dict[str, Any]], int]:
        """Keep a legal recent suffix; return ``(dropped, already_consolidated_count)`` (nanobot's
        rules, quirks included: a tail without a user message keeps the window forward from the
        latest user message)."""
        if max_messages <= 0:
            dropped = list(self.messages)
            lc = self.last_consolidated
            self.clear()
            self._reason = REASON_PREFIX + "retain_recent_legal_suffix"
            return dropped, min(lc, len(dropped))
        if len(self.messages) <= max_messages:
            return [], 0

        original = list(self.messages)
        before_lc = self.last_consolidated
        start_idx = max(0, len(self.messages) - max_messages)
        if extend_to_user:
            start_idx = next(
                (i for i in range(start_idx, -1, -1) if self.messages[i].get("role") == "user"),
                start_idx,
            )
        retained = self.messages[start_idx:]
        first_user = next((i for i, m in enumerate(retained) if m.get("role") == "user"), None)
        if first_user is not None:
            retained = retained[first_user:]
        elif not extend_to_user:
            latest_user = next(
                (i for i in range(len(self.messages) - 1, -1, -1) if self.messages[i].get("role") == "user"),
                None,
            )
            if latest_user is not None:
                retained = self.messages[latest_user : latest_user + max_messages]
        start = find_legal_message_start(retained)
        if start:
            retained = retained[start:]
        if not extend_to_user and len(retained) > max_messages:
            retained = retained[-max_messages:]
            start = find_legal_message_start(retained)
            if start:
                retained = retained[start:]

        retained_ids = {id(m) for m in retained}
        dropped = [m for m in original if id(m) not in retained_ids]
        already = sum(1 for i, m in enumerate(original) if i < before_lc and id(m) not in retained_ids)
        new_lc = sum(1 for i, m in enumerate(original) if i < before_lc and id(m) in retained_ids)
        self.messages = retained
        self.last_consolidated = new_lc
        self.updated_at = datetime.now()
        self._reason = REASON_PREFIX + "retain_recent_legal_suffix"
        return dropped, already

    def enforce_file_cap(
        self, on_archive: Callable[[list[dict[str, Any]]], Any] | None = None, limit: int = FILE_MAX_MESSAGES
    ) -> None:
        """Bound the session's messages by archiving (`on_archive`) and dropping old ones."""
        if limit <= 0 or len(self.messages) <= limit:
            return
        dropped, already = self.retain_recent_legal_suffix(limit)
        if not dropped:
            return
        self._reason = REASON_PREFIX + "enforce_file_cap"
        chunk = dropped[already:]
        if chunk and on_archive:
            on_archive(chunk)


# --------------------------------------------------------------------------- log ↔ session


def _cut_floor(data: dict[str, Any]) -> int | None:
    meta = data.get("meta")
    nb = meta.get("nanobot") if isinstance(meta, dict) else None
    floor = nb.get("floor") if isinstance(nb, dict) else None
    return floor if isinstance(floor, int) and not isinstance(floor, bool) else None


def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(value)
    return None


def _from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000)


def fold(key: str, head: SessionHead, entries: Sequence[Entry]) -> Session:
    """The nanobot `Session` a log holds (pure: the same log gives the same session).

    The messages, metadata and ``last_consolidated`` are what `redis_session.projection.nanobot.fold`
    (the one rule for nanobot logs, shared with the 0.3 store and the exporter) reads; the last
    cut's floor, ``before`` and summary are kept for this manager's next save."""
    origin = head.header.origin if isinstance(head.header.origin, dict) else {}
    state = nanobot_log.fold(head, entries)
    saved = _Saved(n=head.n, exists=True, incarnation=head.header.incarnation)
    for e in entries:
        if e.type == CUT:
            floor = _cut_floor(e.data)
            if floor is not None:
                saved.floor = floor
            saved.before = int(e.data.get("before", 0))
            saved.summary = list(e.data.get("summary") or [])
            saved.foreign = floor is None and bool(saved.summary)
    messages = state.messages
    metadata = state.metadata
    lc = state.archived
    saved.messages = list(messages)
    saved.ns = list(state.ns)
    saved.encoded = [_encode(m) for m in messages]
    saved.metadata = _encode(metadata)
    created = _parse_time(origin.get("created_at")) or _from_ms(head.header.created_at)
    session = Session(
        key=key,
        messages=messages,
        created_at=created,
        updated_at=_from_ms(head.updated_at),
        metadata=metadata,
        last_consolidated=lc,
    )
    session._saved = saved
    return session


def _summary_messages(metadata: dict[str, Any]) -> list[dict[str, Any]]:
    text = summary_text(metadata)
    return [{"role": "user", "content": text}] if text is not None else []


def plan_save(session: Session) -> tuple[list[NewEntry], _Saved]:
    """The entries that bring the log from what `session._saved` says it holds to `session`, and
    what it holds after them (pure)."""
    old = session._saved
    current = list(session.messages)
    n = old.n
    # The session still holds a tail of the saved messages, unchanged, then new ones (j: how many
    # saved ones it dropped from the front). A first message that was never saved means every
    # saved one was dropped. Anything else (an edit in place, a gap) re-appends all it holds.
    at = {id(m): i for i, m in enumerate(old.messages)}
    j = at.get(id(current[0]), len(old.messages)) if current else len(old.messages)
    kept = len(old.messages) - j
    contiguous = kept <= len(current) and all(
        current[i] is old.messages[j + i] and _encode(current[i]) == old.encoded[j + i] for i in range(kept)
    )
    if contiguous:
        ns, new = old.ns[j:], current[kept:]
    else:
        ns, new = [], current
    entries: list[NewEntry] = []
    for m in new:
        ns.append(n + len(entries))
        entries.append(NewEntry(COMMAND if m.get("_command") else MESSAGE, m))
    meta = _encode(session.metadata)
    if meta != old.metadata:
        entries.append(NewEntry(METADATA, {"metadata": session.metadata}))
    cut_n = n + len(entries)
    lc = session.last_consolidated if 0 <= session.last_consolidated <= len(ns) else 0
    summary = _summary_messages(session.metadata)
    # A compactor other than nanobot's summarised into a cut: its summary stays until a clear.
    foreign = not summary and old.foreign and session._reason != REASON_PREFIX + "clear"
    if foreign:
        summary = old.summary
    # Without a cut the log would hold every saved message plus the new ones, with as many
    # consolidated as lie below the last cut's `before`.
    needs_cut = not contiguous or j > 0 or sum(1 for x in ns if x < old.before) != lc or summary != old.summary
    floor, before = old.floor, old.before
    if needs_cut:
        floor = ns[0] if ns else cut_n
        before = ns[lc] if lc < len(ns) else cut_n
        if session._reason is not None:
            reason = session._reason
        elif not contiguous:
            reason = REASON_PREFIX + "rewrite"
        elif j > 0:
            reason = REASON_PREFIX + "retain"
        else:
            reason = REASON_PREFIX + "consolidate"
        entries.append(
            NewEntry(
                CUT,
                {
                    "before": before,
                    "summary": summary,
                    "reason": reason,
                    "meta": {"nanobot": {"floor": floor, "last_consolidated": lc}},
                },
            )
        )
    after = _Saved(
        n=n + len(entries),
        exists=True,
        incarnation=old.incarnation,
        messages=current,
        ns=ns,
        encoded=[_encode(m) for m in current],
        metadata=meta,
        floor=floor,
        before=before,
        summary=summary if needs_cut else old.summary,
        foreign=foreign,
    )
    return entries, after


# --------------------------------------------------------------------------- SessionManager


def _start_portal() -> tuple[BlockingPortal, threading.Thread]:
    """An event loop on a daemon thread (nanobot never closes its manager: exit must not wait)."""
    ready = threading.Event()
    box: list[BlockingPortal] = []

    async def serve() -> None:
        async with BlockingPortal() as portal:
            box.append(portal)
            ready.set()
            await portal.sleep_until_stopped()

    thread = threading.Thread(target=anyio.run, args=(serve,), name="redis-session-nanobot", daemon=True)
    thread.start()
    ready.wait()
    return box[0], thread


class SessionManager:
    """nanobot's ``SessionManager`` on a redis-session store.

    `store` is None (``$REDIS_URL``, else the embedded server) or a URL (the manager owns a
    `RedisSessionStore` on it, `prefix` its key prefix), a `SessionStore` or a `Sessions`
    service. A store handed in is used from the manager's private event-loop thread: a
    `RedisSessionStore` must not also be used from another loop.
    `key_to_id` maps a nanobot key to a session id (default:
    `redis_session.projection.nanobot.key_to_id`, reversible, any key).
    """

    def __init__(
        self,
        store: str | SessionStore | Any = None,
        *,
        prefix: str = "rs",
        key_to_id: Callable[[str], str] | None = None,
    ) -> None:
        self._portal, self._thread = _start_portal()
        self._owned = store is None or isinstance(store, str)
        if store is None or isinstance(store, str):
            from ..redis.connect import open_store

            url = store

            async def make() -> SessionStore:
                return open_store(url, prefix=prefix)

            self.store: SessionStore = self._portal.call(make)
        else:
            self.store = resolve_store(store)
        self.prefix = prefix
        self._key_to_id = key_to_id or nanobot_log.key_to_id
        self._cache: dict[str, Session] = {}
        vocabulary = self.store.vocabulary
        for t in (COMMAND, METADATA):
            if t not in vocabulary:
                vocabulary.define(t, None)

    # -- plumbing

    def _run(self, fn: Callable[[], Awaitable[T]]) -> T:
        async def call() -> T:
            return await fn()

        return self._portal.call(call)

    def close(self) -> None:
        """Close the store the manager opened (not one handed in) and stop its loop thread."""
        if not self._thread.is_alive():
            return
        try:
            if self._owned:
                closer = getattr(self.store, "aclose", None)
                if closer is not None:
                    self._run(closer)
        finally:
            self._portal.call(self._portal.stop)
            self._thread.join(5)

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def session_id(self, key: str) -> str:
        """The session id a key is stored under."""
        return validate_session_id(self._key_to_id(key))

    @staticmethod
    def safe_key(key: str) -> str:
        """nanobot's file-name stem for a key (kept for callers that show it)."""
        return _UNSAFE_CHARS.sub("_", key.replace(":", "_")).strip()

    # -- nanobot's API

    def get_or_create(self, key: str) -> Session:
        """The cached session, else the stored one, else a new empty one (cached either way)."""
        if key in self._cache:
            return self._cache[key]
        session = self._load(key) or Session(key=key)
        self._cache[key] = session
        return session

    def _load(self, key: str) -> Session | None:
        sid = self.session_id(key)

        async def load() -> tuple[SessionHead, list[Entry]] | None:
            head = await self.store.head(sid)
            if head is None:
                return None
            try:
                entries = await self.store.read(sid, 0, head.n, incarnation=head.header.incarnation)
            except SessionNotFoundError:
                return None
            return head, entries

        found = self._run(load)
        return fold(key, *found) if found is not None else None

    def save(self, session: Session, *, fsync: bool = False) -> None:
        """Append what changed since the session was loaded or last saved, with the expected n.

        Raises `SessionConflictError` when another writer saved this session in between (nothing
        of this save is written): invalidate, reload, reapply, save again."""
        del fsync  # durability is the server's (AOF/replicas), not a per-call fsync
        sid = self.session_id(session.key)
        entries, after = plan_save(session)
        old = session._saved
        origin = {
            "format": "nanobot",
            "key": session.key,
            "created_at": session.created_at.isoformat(),
        }

        async def write() -> str | None:
            key = uuid.uuid4().hex
            incarnation = old.incarnation
            if not old.exists and old.n == 0:
                header = SessionHeader(id=sid, created_at=int(session.created_at.timestamp() * 1000), origin=origin)
                try:
                    if len(entries) <= self._max_batch:
                        return (await self.store.create(header, entries)).header.incarnation
                    incarnation = (await self.store.create(header)).header.incarnation
                except SessionAlreadyExistsError:
                    head = await self.store.head(sid)
                    raise SessionConflictError(sid, 0, head.n if head is not None else 0) from None
            step = self._max_batch
            for i in range(0, len(entries), step):
                # a session read from (or created as) one life of the id never writes another
                await self.store.put(
                    sid, old.n + i, entries[i : i + step], idempotency_key=f"{key}:{i}", incarnation=incarnation
                )
            return incarnation

        if entries or not old.exists:
            after.incarnation = self._run(write)
        session._saved = after
        session._reason = None
        self._cache[session.key] = session

    @property
    def _max_batch(self) -> int:
        return self.store.max_batch

    def flush_all(self) -> int:
        """Save every cached session; the number saved (a failing one does not stop the rest)."""
        flushed = 0
        for _key, session in list(self._cache.items()):
            try:
                self.save(session, fsync=True)
                flushed += 1
            except Exception:
                continue
        return flushed

    def invalidate(self, key: str) -> None:
        """Forget the cached session: the next `get_or_create` reads the store."""
        self._cache.pop(key, None)

    def delete_session(self, key: str) -> bool:
        """Delete the session (its log goes) and forget it; whether there was one."""
        self.invalidate(key)
        sid = self.session_id(key)
        return self._run(lambda: self.store.delete(sid))

    delete = delete_session

    def read_session_file(self, key: str) -> dict[str, Any] | None:
        """``{key, created_at, updated_at, metadata, messages}`` of the stored session, uncached."""
        session = self._load(key)
        if session is None:
            return None
        return {
            "key": session.key,
            "created_at": session.created_at.isoformat(),
            "updated_at": session.updated_at.isoformat(),
            "metadata": session.metadata,
            "messages": session.messages,
        }

    def fork_session_before_user_index(
        self, source_key: str, target_key: str, before_user_index: int
    ) -> Session | None:
        """Create `target_key` from the messages of `source_key` before its user message number
        `before_user_index` (0-based over user messages; equal to their count copies all).
        None (and nothing written) for a negative index, a missing source or an index past the
        user messages. Volatile metadata (goal state, title …) is not copied."""
        if before_user_index < 0:
            return None
        source = self._cache.get(source_key) or self._load(source_key)
        if source is None:
            return None
        copied: list[dict[str, Any]] = []
        user_index = 0
        found = False
        for message in source.messages:
            if message.get("role") == "user":
                if user_index == before_user_index:
                    found = True
                    break
                user_index += 1
            copied.append(deepcopy(message))
        if user_index == before_user_index:
            found = True
        if not found:
            return None
        metadata = deepcopy(source.metadata)
        for k in _FORK_VOLATILE_METADATA_KEYS:
            metadata.pop(k, None)
        last_consolidated = min(source.last_consolidated, len(copied))
        if source.last_consolidated > len(copied):
            metadata.pop("_last_summary", None)
            last_consolidated = 0
        now = datetime.now()
        target = Session(
            key=target_key,
            messages=copied,
            created_at=now,
            updated_at=now,
            metadata=metadata,
            last_consolidated=last_consolidated,
        )
        existing = self._load(target_key)  # nanobot overwrites: here, a cut over the old log
        if existing is not None:
            target._saved = existing._saved
            target._reason = REASON_PREFIX + "fork"
        self.save(target, fsync=True)
        return target

    def list_sessions(self) -> list[dict[str, Any]]:
        """``{key, created_at, updated_at, title, preview, path}`` of every stored session, newest
        update first (`path` names the session's log key). Reads each session's log."""
        sids: list[str] = []

        async def ids() -> None:
            cursor: str | None = None
            while True:
                page = await self.store.list(limit=1000, cursor=cursor)
                sids.extend(h.id for h in page.items)
                cursor = page.cursor
                if cursor is None:
                    return

        self._run(ids)
        out: list[dict[str, Any]] = []
        for sid in sids:
            found = self._run_load_id(sid)
            if found is None:
                continue
            head, entries = found
            origin = head.header.origin if isinstance(head.header.origin, dict) else {}
            stored_key = origin.get("key")
            key = nanobot_log.listed_key(sid, stored_key if isinstance(stored_key, str) else sid, self.session_id)
            if key is None:
                continue  # no key reaches it (see `listed_key`)
            try:
                s = fold(key, head, entries)
            except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as e:
                # one session that cannot be read never hides the others: listed from its header
                _logger.warning("nanobot session %r cannot be folded for the listing: %r", sid, e)
                s = Session(key=key, created_at=_from_ms(head.header.created_at), updated_at=_from_ms(head.updated_at))
            out.append(
                {
                    "key": key,
                    "created_at": s.created_at.isoformat(),
                    "updated_at": s.updated_at.isoformat(),
                    "title": _metadata_title(s.metadata),
                    "preview": _preview(s.messages),
                    "path": Keys(self.prefix).log(sid),
                }
            )
        return sorted(out, key=lambda x: x.get("updated_at", ""), reverse=True)

    def _run_load_id(self, sid: str) -> tuple[SessionHead, list[Entry]] | None:
        async def load() -> tuple[SessionHead, list[Entry]] | None:
            head = await self.store.head(sid)
            if head is None:
                return None
            try:
                return head, await self.store.read(sid, 0, head.n, incarnation=head.header.incarnation)
            except SessionNotFoundError:
                return None

        return self._run(load)


def _preview(messages: Sequence[dict[str, Any]]) -> str:
    """The first user text within nanobot's scan limits, else the first assistant text."""
    fallback = ""
    chars = 0
    for i, item in enumerate(messages):
        chars += len(_encode(item))
        if i >= _SESSION_LIST_PREVIEW_MAX_RECORDS or chars > _SESSION_LIST_PREVIEW_MAX_CHARS:
            break
        text = _text_preview(item.get("content"))
        if not text:
            continue
        if item.get("role") == "user":
            return text
        if not fallback and item.get("role") == "assistant":
            fallback = text
    return fallback


#: the name that says what it is: nanobot's manager as it was at 8656549 (see the module docstring)
LegacySessionManager = SessionManager

__all__ = [
    "FILE_MAX_MESSAGES",
    "LegacySessionManager",
    "Session",
    "SessionManager",
    "estimate_message_tokens",
    "find_legal_message_start",
    "fold",
    "plan_save",
    "recent_message_start_index",
    "summary_text",
]
