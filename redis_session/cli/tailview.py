"""`run_tail`, the terminal view behind ``redis-session tail`` (on `redis_session.live.follow`).

>>> await run_tail(store, "chat-1", start=0)            # prints entries as they land; Ctrl-C stops
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import SessionNotFoundError, SessionReplacedError
from ..live import follow, follow_deltas
from ..model import Entry
from ..projection.chunks import Delta, DeltaGap, unpack_row
from ..store.memory import SessionStore

# --------------------------------------------------------------------------- rendering


def chunk_text(data: dict[str, Any]) -> tuple[str, bool] | None:
    """The text an ``assistant/chunk`` adds, and whether it is reasoning; None for a chunk without
    text (a tool-call delta, a finish marker).

    Runtimes write chunks in several shapes; all of these are understood: ``{"chunk": "text"}``,
    ``{"chunk": {"type": "text-delta", "text"|"delta"|"textDelta": …}}`` (dsh / AI SDK),
    ``{"delta": {"content": …}}`` (OpenAI-style), ``{"chunk": {"choices": [{"delta": …}]}}``,
    ``{"text": …}`` and ``{"content": …}``.
    """
    c: Any = data.get("chunk", data)
    if isinstance(c, str):
        return c, False
    if not isinstance(c, dict):
        return None
    reasoning = "reasoning" in str(c.get("type", ""))
    choices = c.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        c = choices[0]
    for key in ("text", "textDelta", "delta", "content"):
        v = c.get(key)
        if isinstance(v, str):
            return v, reasoning
        if isinstance(v, dict):
            for sub, is_reasoning in (("content", False), ("text", False), ("reasoning_content", True)):
                s = v.get(sub)
                if isinstance(s, str) and s:
                    return s, reasoning or is_reasoning
    return None


def content_text(content: Any) -> str:
    """A one-glance rendering of message content (a string or dsh/OpenAI blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        return _compact(content)
    parts: list[str] = []
    for b in content:
        if not isinstance(b, dict):
            parts.append(_compact(b))
            continue
        t = b.get("type")
        if t == "text":
            parts.append(str(b.get("text", "")))
        elif t == "reasoning":
            parts.append(f"[reasoning: {b.get('text', '')}]")
        elif t == "tool-call":
            parts.append(f"→ {b.get('name')}({b.get('arguments', '')})")
        elif t == "tool-result":
            parts.append(f"← {content_text(b.get('content'))}")
        elif t in ("image", "image_url"):
            parts.append("[image]")
        elif isinstance(b.get("text"), str):
            parts.append(b["text"])
        else:
            parts.append(_compact(b))
    return " ".join(p for p in parts if p)


def _compact(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        return repr(value)


def entry_summary(e: Entry) -> str:
    """The body of an entry's line: the message text for messages, compact JSON for the rest."""
    d = e.data
    if e.type == "message":
        text = content_text(d.get("content"))
        calls = d.get("tool_calls") or []
        for c in calls if isinstance(calls, list) else []:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            text += f" → {fn.get('name')}({fn.get('arguments', '')})"
        role = d.get("role", "?")
        return f"{role}: {text}".rstrip()
    if e.type == "assistant/message" and d.get("tool_calls"):
        from ..projection.messages import assistant_blocks

        return content_text(list(assistant_blocks(d)))
    if e.type in ("user/message", "assistant/message", "context/message", "steering/message"):
        return content_text(d.get("content"))
    if e.type == "tool/result":
        err = " (error)" if d.get("isError") else ""
        return f"{d.get('callId')}{err}: {content_text(d.get('content'))}"
    if e.type == "tool/call":
        return f"{d.get('name')}({d.get('arguments', '')})  [{d.get('callId')}]"
    if e.type == "cut":
        summary = d.get("summary") or []
        return f"before={d.get('before')} reason={d.get('reason')} summary={len(summary)} message(s)"
    return _compact(d)


_TYPE_STYLE = {
    "user/message": "bold green",
    "context/message": "green",
    "steering/message": "green",
    "assistant/message": "bold cyan",
    "assistant/chunk": "cyan",
    "tool/call": "yellow",
    "tool/result": "yellow",
    "cut": "bold magenta",
    "turn/start": "blue",
    "turn/end": "blue",
    "step/start": "dim blue",
    "step/end": "dim blue",
    "prompt/blocked": "red",
}
_ROLE_STYLE = {"user": "bold green", "assistant": "bold cyan", "tool": "yellow", "system": "magenta"}


def type_style(e: Entry) -> str:
    if e.type == "message":
        return _ROLE_STYLE.get(str(e.data.get("role")), "white")
    if e.type == "tool/result" and e.data.get("isError"):
        return "bold red"
    if e.type == "turn/end" and e.data.get("reason") not in (None, "completed"):
        return "bold red"
    return _TYPE_STYLE.get(e.type, "dim")


def _clock(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%H:%M:%S.%f")[:-3]


class TailRenderer:
    """Turns entries into console lines; chunks of one step stream inline on one growing line.

    `messages=True` shows the conversation instead of the raw log: message entries as the
    messages they derive (role and text), cuts as a rule, chunks still streaming inline, other
    marks hidden.
    """

    MAX_BODY = 4000  # characters of a message's body; the rest is elided
    MAX_MARK_BODY = 400  # of any other entry's
    TYPE_WIDTH = 18

    def __init__(self, console: Console, *, messages: bool = False) -> None:
        self.console = console
        self.messages = messages
        # Not a terminal (a pipe, a file): one line per entry, never wrapped at the console's
        # default 80 columns nor padded to it; a terminal gets aligned columns.
        self.plain = not console.is_terminal
        self._stream_key: tuple[Any, Any] | None = None  # (turn, step) or ("answer", id) of the open line
        self._streamed: list[str] = []
        self._live_answers: set[str] = set()  # answers shown from their live deltas

    # -- chunk line
    def _open_stream(self, e: Entry) -> None:
        key = (e.data.get("turn"), e.data.get("step"))
        if self._stream_key == key:
            return
        self.close_stream()
        self._stream_key = key
        self._streamed = []
        label = Text()
        if not self.messages:
            label.append(f"{e.n:>6} ", style="dim")
            label.append(_clock(e.time) + " ", style="dim")
        label.append("assistant ▸ ", style="bold cyan")
        self.console.print(label, end="", soft_wrap=True)

    def close_stream(self) -> None:
        """End the open chunk line, if any (before any other output)."""
        if self._stream_key is not None:
            self.console.print(soft_wrap=True)
            self._stream_key = None

    # -- live deltas
    def render_delta(self, d: Delta) -> None:
        """A delta of a streamed answer, inline on the answer's line (its chunk rows, landing in
        the log meanwhile, are then not printed again)."""
        self._live_answers.add(d.answer)
        key = ("answer", d.answer)
        if self._stream_key != key:
            self.close_stream()
            self._stream_key = key
            self._streamed = []
            label = Text()
            if not self.messages:
                label.append(f"{'':>6} ", style="dim")
                label.append(_clock(int(time.time() * 1000)) + " ", style="dim")
            label.append("assistant ▸ ", style="bold cyan")
            self.console.print(label, end="", soft_wrap=True)
        if d.kind == "tool-call":
            text, style = (f"[{d.name}] " if d.name else "") + d.text, "dim cyan"
        else:
            text, style = d.text, "dim italic" if d.kind == "reasoning" else ""
        if text:
            self.console.print(Text(text, style=style), end="", soft_wrap=True)
        if d.kind == "text":
            self._streamed.append(d.text)

    # -- entries
    def render(self, e: Entry) -> None:
        if e.type == "assistant/chunk":
            if e.data.get("answer") in self._live_answers:
                return  # shown live, delta by delta
            for c in unpack_row(e.data):
                piece = chunk_text({"chunk": c})
                if piece is None or not piece[0]:
                    continue
                self._open_stream(e)
                self.console.print(Text(piece[0], style="dim italic" if piece[1] else ""), end="", soft_wrap=True)
                self._streamed.append(piece[0])
            return
        streamed = "".join(self._streamed) if self._stream_key is not None else None
        self.close_stream()
        self._streamed = []
        if self.messages:
            self._render_message(e, streamed)
        else:
            self._render_entry(e, streamed)

    def _render_entry(self, e: Entry, streamed: str | None) -> None:
        body = entry_summary(e)
        if e.type == "assistant/message" and streamed is not None and body.startswith(streamed.strip()):
            rest = body[len(streamed.strip()) :].strip()
            body = f"✓ {len(streamed)} chars streamed" + (f" {rest}" if rest else "")
        limit = self.MAX_BODY if e.kind == "message" else self.MAX_MARK_BODY
        if len(body) > limit:
            body = body[:limit] + f"… (+{len(body) - limit} chars)"
        style = type_style(e)
        if self.plain:
            line = Text.assemble(
                (f"{e.n:>6} ", "dim"), (_clock(e.time) + " ", "dim"), (f"{e.type:<{self.TYPE_WIDTH}}", style), " "
            )
            line.append(" ".join(body.splitlines()), style=_body_style(e))
            self.console.print(line, soft_wrap=True)
            return
        # fixed column widths, so that the lines of successive entries align
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right", style="dim", width=6, no_wrap=True)
        grid.add_column(style="dim", width=12, no_wrap=True)
        grid.add_column(width=self.TYPE_WIDTH, no_wrap=True, overflow="ellipsis")
        grid.add_column(overflow="fold")
        grid.add_row(str(e.n), _clock(e.time), Text(e.type, style=style), Text(body, style=_body_style(e)))
        self.console.print(grid)

    def _render_message(self, e: Entry, streamed: str | None) -> None:
        from ..projection.messages import cut_messages, derive_message

        if e.type == "cut":
            before = e.data.get("before")
            note = Text(f"compacted at n={e.n}: the model now sees the summary and n ≥ {before}", style="magenta")
            if self.plain:
                self.console.print(Text("── ") + note + Text(" ──"), soft_wrap=True)
            else:
                self.console.rule(note)
            found = cut_messages(e)
        elif e.kind == "message":
            m = derive_message(e)
            found = () if m is None else (m,)
        else:
            return
        for m in found:
            text = content_text(list(m.content))
            if m.role == "assistant" and streamed is not None and text.startswith(streamed.strip()):
                text = text[len(streamed.strip()) :].strip()
                if not text:
                    continue  # its text just streamed in full
            if len(text) > self.MAX_BODY:
                text = text[: self.MAX_BODY] + f"… (+{len(text) - self.MAX_BODY} chars)"
            line = Text()
            line.append(f"{m.role:>9} ", style=_ROLE_STYLE.get(m.role, "white"))
            line.append(" ".join(text.splitlines()) if self.plain else text)
            self.console.print(line, soft_wrap=self.plain)

    def note(self, message: str, style: str = "dim") -> None:
        self.close_stream()
        self.console.print(Text(message, style=style), soft_wrap=self.plain)


class JsonTail:
    """``tail --json``: one JSON document per line on stdout — each entry as `show --json` prints
    it, each delta of a streamed answer as ``{"delta": {answer, index, kind, text, …}}`` — and the
    notes (following, reconnecting, deleted) on stderr, so stdout stays machine-readable."""

    def __init__(self, out: Any, notes: Console) -> None:
        self.out = out
        self.notes = notes

    def _line(self, value: Any) -> None:
        import msgspec

        self.out.write(msgspec.json.encode(value).decode() + "\n")
        self.out.flush()

    def render(self, e: Entry) -> None:
        self._line(e)

    def render_delta(self, d: Delta) -> None:
        self._line({"delta": d})

    def note(self, message: str, style: str = "dim") -> None:
        self.notes.print(Text(message, style=style), soft_wrap=True)

    def close_stream(self) -> None:
        pass


def _body_style(e: Entry) -> str:
    if e.kind == "message":
        return ""
    if e.type == "cut":
        return "magenta"
    return "dim"


@dataclasses.dataclass
class TailPosition:
    """Where a tail is: the next n to show and the incarnation it began on. `run_tail` keeps it up
    to date, so a tail restarted on another store (the embedded server moved to another port)
    resumes at the last shown n + 1 of the same life instead of at its start argument."""

    next: int | None = None
    incarnation: str | None = None


async def run_tail(
    store: SessionStore,
    session_id: str,
    start: int | None = None,
    messages: bool = False,
    console: Console | None = None,
    stop_after: int | None = None,
    *,
    max_backoff: float = 5.0,
    deltas: bool = True,
    as_json: bool = False,
    position: TailPosition | None = None,
) -> int:
    """Print a session live until it is deleted (or `stop_after` entries were shown).

    `start` is the first n to show (default: the end, so only new entries). A streamed answer
    shows delta by delta as it is streamed (`deltas`; an answer already under way shows from its
    start); chunk rows of the log form the assistant's text inline otherwise. A dropped
    connection is reported and retried with backoff,
    resuming at the last shown n + 1: nothing is lost or shown twice. Returns the n to resume at.
    Raises `SessionNotFoundError` when the session does not exist. Pass the same `position` to a
    call that resumes an earlier one (on a re-resolved store): it continues at the position's next
    n, on its incarnation — `SessionReplacedError` when the id names another life by then.
    """
    console = console if console is not None else Console()
    view: TailRenderer | JsonTail
    if as_json:
        view = JsonTail(console.file, Console(stderr=True))
    else:
        view = TailRenderer(console, messages=messages)
    pos = position if position is not None else TailPosition()
    resuming = pos.next is not None
    head = await store.head(session_id)
    if head is None:
        if resuming:  # deleted while the tail was away: the end a live tail sees too
            view.note(f"session {session_id} was deleted", "bold red")
            return pos.next or 0
        raise SessionNotFoundError(session_id)
    if pos.incarnation is None:
        pos.incarnation = head.header.incarnation
    elif head.header.incarnation != pos.incarnation:
        raise SessionReplacedError(session_id)
    if pos.next is not None:
        nxt = pos.next
        view.note(f"resuming {session_id} at n={nxt}", style="bold")
    else:
        nxt = head.n if start is None else start
        pos.next = nxt
    title = f" — {head.header.title}" if head.header.title else ""
    branch = f" (branch of {head.header.parent} at {head.header.at})" if head.header.parent else ""
    if not resuming:
        view.note(f"following {session_id}{title}{branch}: n={head.n}, from {nxt}", style="bold")
    if nxt > head.n and not resuming:
        view.note(
            f"{session_id} has {head.n} entries (0..{head.n - 1}): nothing to show until entry {nxt} is written"
            if head.n
            else f"{session_id} has no entries yet: nothing to show until entry {nxt} is written",
            "yellow",
        )

    def on_retry(exc: BaseException, wait: float, at: int) -> None:
        view.note(f"connection lost ({exc}); reconnecting in {wait:.1f}s, resuming at n={at}", "yellow")

    shown = 0
    try:
        async with contextlib.aclosing(
            follow_deltas(
                store, session_id, nxt, on_retry=on_retry, max_backoff=max_backoff, incarnation=pos.incarnation
            )
            if deltas
            else follow(store, session_id, nxt, on_retry=on_retry, max_backoff=max_backoff, incarnation=pos.incarnation)
        ) as entries:
            async for e in entries:
                if isinstance(e, Delta):
                    view.render_delta(e)
                    continue
                if isinstance(e, DeltaGap):  # the rest of that answer is in its entries
                    view.note(f"deltas {e.start}.. of answer {e.answer} are gone from the live stream", "yellow")
                    continue
                view.render(e)
                nxt = pos.next = e.n + 1
                shown += 1
                if stop_after is not None and shown >= stop_after:
                    return nxt
        view.note(f"session {session_id} was deleted", "bold red")
        return nxt
    finally:
        view.close_stream()
