"""Automatic compaction: summarise what a session's model no longer needs word for word.

nanobot's AutoCompact and dsh's compact-basic keep a conversation inside its context window by
replacing its older part with a summary. Here that is a worker on the change feed, beside the
projectors (docs/design.md §6): when a session's projection — what the model sees — exceeds a
token budget, the `Compactor` asks a summarizer for a summary of the older part and appends a
``cut`` (``before`` = the first message kept, ``summary`` = the summary). The log keeps every
entry; only the projection gets shorter.

- `Compactor`, the worker; `check(id)` does one session now.
- `chat_completions(url, model, ...)`, a summarizer for any OpenAI-compatible
  ``/chat/completions`` endpoint; `load_summarizer("pkg.mod:fn")` for the CLI.
- `status`, for ``redis-session compactor --status``.

Design choices (the why):

- **Its own consumer group** (default ``compactor``) on the projector's feed shards. A new group
  starts at the feed's *end* (``$``): a compactor deployed on a store that already holds sessions
  does not summarise them all at once on its first start; it checks a session when it is next
  written. ``from_start=True`` (``--from-start``) starts a new group at id 0 instead, checking every
  session of the retained feed. Either way the start says so in the log, and an existing group
  resumes where it left off. Every cut is logged with the session, why (its tokens against the
  budget) and what was summarised.
  The feed is a hint: each session named in a batch is checked once, at its *current* head.
- **What counts** is the projection (`load_state`, the projector's snapshot plus the tail) and its
  estimate (`estimate_tokens`, or the `estimator` given). A session at or under `budget_tokens`
  is acked after that read; nothing is locked or written.
- **Where to cut.** The messages kept are `history(messages after the current summary,
  keep_recent, keep_tokens)`: the longest legal suffix within those caps — it starts at a user
  message and never separates a tool result from its call. ``before`` is the n of the first kept
  message. Everything in front of it (the previous summary included) is summarised, so summaries
  roll forward as nanobot's do. No cut is written when nothing would be summarised (a single turn
  larger than the budget), nor when surface replaces put an entry of the summarised part after
  ``before`` (the cut would show it again).
- **Summary shape.** A string from the summarizer becomes one message, ``{role: summary_role
  (user), content: "[Archived Context Summary]\\n\\n" + text}``, the text nanobot puts in front of
  its prompt; a list of chat messages is used as it is. An empty summary is a failure.
- **One cut per range.** The cut is appended with ``expected_n`` = the head the decision was
  made on, to that head's incarnation, with the idempotency key
  ``compactor:<incarnation>:<previous cut>:<before>``. A session that moved on while its summary
  was written gets a conflict; the compactor re-reads it: if the summarised part and the first
  kept message are unchanged and it is still over budget, the same summary is written at the new
  head (no second summarizer call), otherwise it decides again from the fresh projection (an
  append that another compactor's cut already brought under budget is simply acked). A lost reply
  is retried with the same key, so it returns the cut that landed instead of writing a second one;
  the key names the range, so a second compactor that summarised the same range is refused
  (`IdempotencyKeyReusedError`, handled as a conflict). A session deleted and created again in
  the meantime refuses the write (`SessionReplacedError`): the old summary never reaches the new
  session.
- **Locking.** A short per-session lock ``{prefix}:{<id>}:compact`` (``SET NX PX``, renewed while
  the summarizer runs) keeps two compactors from paying for the same summary; a session whose
  lock is taken stays pending and is retried on a later loop. Correctness does not rest on it
  (release and renewal are a GET then DEL/PEXPIRE, not atomic): ``expected_n`` and the range key
  do that.
- **Failures** (the summarizer raising, timing out or answering nothing usable; Redis down) are
  logged and the session's feed entries stay pending: another loop reclaims them with XAUTOCLAIM
  after ``claim_idle_ms`` and tries again. Nothing is ever cut on a failure.
- **Counters** in ``{prefix}:compactor:{group}:stats``, summed over workers (`status`), and
  Prometheus metrics (``metrics_port``).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import json
import logging
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import anyio.to_thread
from redis.exceptions import RedisError

from .errors import (
    IdempotencyKeyReusedError,
    InvalidSessionIdError,
    SessionConflictError,
    SessionNotFoundError,
    StoreUnavailableError,
)
from .feed import FeedRow, FeedWorker, as_map, as_str, default_consumer, feed_client_of, validate_group
from .keys import validate_session_id
from .model import CUT, NewEntry, SessionHead
from .projection.budget import estimate_tokens, history
from .projection.fold import ProjectionState
from .projection.messages import Message
from .projection.render import to_openai
from .projector import status as _feed_status
from .redis.store import RedisSessionStore
from .redis.wire import RAW
from .retry import conflict_backoff
from .snapshots import SnapshotCache, load_state

log = logging.getLogger("redis_session.compactor")

DEFAULT_GROUP = "compactor"
DEFAULT_REASON = "compactor"
SUMMARY_PREFIX = "[Archived Context Summary]\n\n"
DEFAULT_SYSTEM_PROMPT = (
    "You compact the conversation that follows for an AI agent that must continue it without "
    "seeing it again. Write a concise summary that keeps every fact, decision, open task, user "
    "preference, file name, identifier and number the agent will still need, and the results of "
    "tool calls that matter. If the conversation starts with an earlier summary, merge it in. "
    "Answer with the summary only."
)

# The outcomes of one session's check.
UNDER = "under"  # at or under the budget: nothing to do
COMPACTED = "compacted"  # a cut was written (or found landed after a lost reply)
UNCUTTABLE = "uncuttable"  # over budget, but no legal boundary leaves anything to summarise
BUSY = "busy"  # another compactor holds the session's lock: retried on a later loop
DELETED = "deleted"  # the session is gone (or was deleted and created again): acked
FAILED = "failed"  # the summarizer or the store failed: left pending, retried after claim_idle_ms

OUTCOMES = (UNDER, COMPACTED, UNCUTTABLE, BUSY, DELETED, FAILED)

ChatMessage = dict[str, Any]
SummaryResult = str | Sequence[Mapping[str, Any]]
Summarizer = Callable[[builtins.list[ChatMessage]], SummaryResult | Awaitable[SummaryResult]]

_FeedRow = FeedRow


# --------------------------------------------------------------------------- summarizers


class ChatCompletionsSummarizer:
    """A summarizer that POSTs to an OpenAI-compatible chat-completions endpoint.

    The request is ``{model, messages: [system prompt, *messages to summarise], **extra}`` with
    ``Authorization: Bearer <api_key>`` when a key is given; the summary is
    ``choices[0].message.content``. `url` is either the full endpoint or a base URL
    (``https://api.openai.com/v1``), to which ``/chat/completions`` is added. HTTP errors,
    timeouts and answers without text raise (the compactor logs them and retries later)."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        extra: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"summarizer url must be http(s)://…, got {url!r}")
        if not model:
            raise ValueError("a chat-completions summarizer needs a model name")
        base = url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.system_prompt = system_prompt
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"ChatCompletionsSummarizer({self.url!r}, model={self.model!r})"

    async def __call__(self, messages: builtins.list[ChatMessage]) -> str:
        body = {
            **self.extra,
            "model": self.model,
            "messages": [{"role": "system", "content": self.system_prompt}, *messages],
        }
        return await anyio.to_thread.run_sync(self._post, body, abandon_on_cancel=True)

    def _post(self, body: dict[str, Any]) -> str:
        headers = {"Content-Type": "application/json", "Accept": "application/json", **self.headers}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read(500).decode("utf-8", "replace") if e.fp is not None else ""
            raise OSError(f"summarizer {self.url} answered HTTP {e.code}: {detail}".strip()) from None
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"summarizer {self.url} answered no choices[0].message.content") from None
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"summarizer {self.url} answered an empty summary")
        return content


def chat_completions(
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    api_key_env: str | None = None,
    timeout: float = 120.0,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    extra: Mapping[str, Any] | None = None,
) -> ChatCompletionsSummarizer:
    """`ChatCompletionsSummarizer` with the key taken from `api_key` or the variable `api_key_env`."""
    if api_key is None and api_key_env:
        api_key = os.environ.get(api_key_env) or None
    return ChatCompletionsSummarizer(
        url, model, api_key=api_key, timeout=timeout, system_prompt=system_prompt, extra=extra
    )


def load_summarizer(spec: str) -> Summarizer:
    """The callable named by ``"package.module:attribute"`` (a summarizer for the CLI)."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"summarizer must be given as module:function, got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod)
    except ImportError as e:  # a typo, or a file not on the path: the one-line error the CLI prints
        raise ValueError(
            f"summarizer {spec!r}: cannot import module {mod!r} ({e}; is its folder on PYTHONPATH?)"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"summarizer {spec!r}: {mod!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    return cast(Summarizer, obj)


# --------------------------------------------------------------------------- metrics


class CompactorMetrics:
    """The worker's Prometheus metrics, in their own registry (``metrics.registry``)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = "redis_session_compactor"
        self.processed = Counter(f"{p}_processed", "Feed entries handled and acked", registry=r)
        self.reclaimed = Counter(f"{p}_reclaimed", "Feed entries reclaimed from idle consumers", registry=r)
        self.checks = Counter(f"{p}_checks", "Session checks by outcome", ["outcome"], registry=r)
        self.conflicts = Counter(f"{p}_conflicts", "Cuts refused because the session moved on", registry=r)
        self.summarizer_errors = Counter(f"{p}_summarizer_errors", "Summarizer calls that failed", registry=r)
        self.tokens_removed = Counter(f"{p}_tokens_removed", "Estimated tokens taken off projections", registry=r)
        self.summarize_seconds = Histogram(f"{p}_summarize_seconds", "Time of one summarizer call", registry=r)
        self.lag = Gauge(f"{p}_lag", "Feed entries not yet delivered to the group", ["shard"], registry=r)
        self.pending = Gauge(f"{p}_pending", "Feed entries delivered but not acked", ["shard"], registry=r)

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent), e.g. ``value("checks_total", outcome="under")``."""
        got = self.registry.get_sample_value(f"redis_session_compactor_{name}", labels or None)
        return 0.0 if got is None else float(got)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _View:
    """A session's projection at one head."""

    head: SessionHead
    state: ProjectionState
    messages: builtins.list[Message]
    tokens: int


@dataclass(frozen=True)
class _Plan:
    """One compaction: summarise ``messages[:idx]``, keep ``messages[idx:]`` (entries >= before)."""

    incarnation: str
    prev_cut: int | None
    idx: int
    before: int
    head: tuple[Message, ...]
    first_kept: tuple[int, ...]
    tokens: int
    kept_tokens: int

    @property
    def key(self) -> str:
        prev = "-" if self.prev_cut is None else str(self.prev_cut)
        return f"compactor:{self.incarnation}:{prev}:{self.before}"

    def holds(self, view: _View) -> bool:
        """True when `view` (a fresher head) still has exactly this range in front: the same
        summarised messages, the same first kept message, the same previous cut."""
        msgs = view.messages
        return (
            view.head.header.incarnation == self.incarnation
            and view.state.last_cut == self.prev_cut
            and len(msgs) > self.idx
            and msgs[self.idx].source == self.first_kept
            and tuple(msgs[: self.idx]) == self.head
        )


@dataclass
class _Work:
    """The feed entries of one session in this batch (coalesced: one check for all)."""

    session_id: str
    ids: dict[str, set[str]] = field(default_factory=dict)  # feed key -> entry ids

    def add(self, key: str, rid: str) -> None:
        self.ids.setdefault(key, set()).add(rid)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.ids.values())


# --------------------------------------------------------------------------- the worker


class Compactor(FeedWorker):
    kind = "compactor"
    in_hand = "the sessions in hand"

    """One compactor worker (a consumer of the change feed in its own group).

    >>> c = Compactor(store, summarize=my_summarizer, budget_tokens=32_000, keep_recent=20)
    >>> await c.run_forever()          # until SIGTERM/SIGINT; the sessions in hand are finished

    `summarize(messages) -> str | list[chat messages]` (sync or async) gets the part to summarise
    as OpenAI chat messages (`to_openai`: always a legal request; a previous summary first);
    `chat_completions(url, model, ...)` builds one for an OpenAI-compatible endpoint. `run()`
    until `stop()`; `run_once()` handles one batch; `check(id)` one session now (returns one of
    `OUTCOMES`).

    Policy: a session is compacted when its projection estimates over `budget_tokens`; the part
    kept is the longest legal suffix with at most `keep_recent` messages and `keep_tokens` tokens
    (default a quarter of the budget), see `history`; `estimator` counts tokens (default
    `estimate_tokens`). The cut's ``reason`` is `reason`; the summary message has role
    `summary_role` and starts with `summary_prefix`. `timeout` bounds one summarizer call.

    Worker: `group`, `consumer`, `batch` (feed entries per shard per read), `claim_idle_ms` (how
    long a feed entry stays pending before it is reclaimed, which is also when a failed session is
    retried), `lock_ms` (the per-session lock's expiry, renewed while summarising; 0: no lock),
    `concurrency` (sessions checked at once), `max_conflicts` (re-decisions in a row before the
    session is left for later), `block_ms`, `metrics_port`, `snapshot_cache`. `from_start`: a group
    created now starts at the feed's first entry (every retained session is checked) instead of
    its end (only sessions written from now on); an existing group resumes where it was.
    """

    def groups_created(self, keys: builtins.list[str]) -> None:
        if self.from_start:
            log.info(
                "compactor %s: created group %r at the start of the feed (%d shards): every session in the "
                "retained feed is checked now, and cut if over %d tokens",
                self.consumer, self.group, len(keys), self.budget_tokens,
            )  # fmt: skip
        else:
            log.info(
                "compactor %s: created group %r at the end of the feed (%d shards): sessions written before now "
                "are checked when they are next written (--from-start / from_start=True checks them all now)",
                self.consumer, self.group, len(keys),
            )  # fmt: skip

    def __init__(
        self,
        store: RedisSessionStore,
        *,
        summarize: Summarizer,
        budget_tokens: int = 32_000,
        keep_recent: int | None = 20,
        keep_tokens: int | None = None,
        estimator: Callable[[Message], int] | None = None,
        reason: str = DEFAULT_REASON,
        summary_role: str = "user",
        summary_prefix: str = SUMMARY_PREFIX,
        timeout: float | None = 300.0,
        consumer: str | None = None,
        group: str = DEFAULT_GROUP,
        batch: int = 100,
        claim_idle_ms: int = 30_000,
        block_ms: int = 2_000,
        lock_ms: int = 30_000,
        concurrency: int = 4,
        max_conflicts: int = 5,
        stats_interval: float = 5.0,
        consumer_ttl_ms: int = 3_600_000,
        metrics_port: int | None = None,
        metrics_addr: str = "0.0.0.0",
        registry: Any = None,
        snapshot_cache: SnapshotCache | None = None,
        from_start: bool = False,
    ) -> None:
        if not callable(summarize):
            raise TypeError("summarize must be a callable: messages -> str | list of messages")
        if budget_tokens < 1:
            raise ValueError("budget_tokens must be >= 1")
        if keep_recent is not None and keep_recent < 1:
            raise ValueError("keep_recent must be >= 1 (or None: no message cap)")
        if batch < 1 or claim_idle_ms < 1 or concurrency < 1 or block_ms < 1 or lock_ms < 0 or max_conflicts < 0:
            raise ValueError("batch, claim_idle_ms, concurrency and block_ms must be >= 1; lock_ms, max_conflicts >= 0")
        if summary_role not in ("user", "system", "assistant"):
            raise ValueError(f"summary_role must be user, system or assistant, got {summary_role!r}")
        self.store = store
        self.summarize = summarize
        self.budget_tokens = budget_tokens
        self.keep_recent = keep_recent
        self.keep_tokens = keep_tokens if keep_tokens is not None else max(1, budget_tokens // 4)
        self.estimator = estimator or estimate_tokens
        self.reason = reason
        self.summary_role = summary_role
        self.summary_prefix = summary_prefix
        self.timeout = timeout
        self.group = validate_group(group)
        self.consumer = validate_group(consumer or default_consumer())
        self.batch = batch
        self.claim_idle_ms = claim_idle_ms
        self.block_ms = block_ms
        self.lock_ms = lock_ms
        self.concurrency = concurrency
        self.max_conflicts = max_conflicts
        self.stats_interval = stats_interval
        self.consumer_ttl_ms = consumer_ttl_ms
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.metrics = CompactorMetrics(registry)
        self.cache = snapshot_cache
        self.feeds = store.keys.all_feeds()
        self._r = feed_client_of(store)
        self._stats_key = store.keys.compactor_stats(self.group)
        self._stopping = False
        self._idle_scope: anyio.CancelScope | None = None
        self._deferred: dict[str, _Work] = {}
        self._claim_cursor = {k: "0-0" for k in self.feeds}
        self._next_claim = 0.0
        self._next_stats = 0.0
        self._groups_ready = False
        self._http: Any = None
        self.batches = 0
        self.from_start = from_start
        self.group_start = "0" if from_start else "$"

    # ------------------------------------------------------------------ lifecycle

    # ------------------------------------------------------------------ one batch

    async def run_once(self, *, block: bool = False) -> int:
        """Read one batch (reclaimed entries, deferred sessions or new entries) and check each
        session in it; returns the number of feed entries acked. With `block`, an empty feed is
        waited on for up to ``block_ms`` (interrupted by `stop()`)."""
        await self.ensure_groups()
        now = time.monotonic()
        if now >= self._next_stats:
            self._next_stats = now + self.stats_interval
            await self.refresh_gauges()
        rows: builtins.list[_FeedRow] = []
        if now >= self._next_claim:
            self._next_claim = now + max(self.claim_idle_ms / 2000, 0.05)
            rows = await self._autoclaim()
        if not rows and not (block and self._stopping):
            wait = None if not block else (250 if self._deferred else self.block_ms)
            with anyio.CancelScope() as scope:
                self._idle_scope = scope
                rows = await self._read(dict.fromkeys(self.feeds, ">"), wait)
            self._idle_scope = None
            if scope.cancelled_caught:
                rows = []
        works, garbage = self._coalesce(rows)
        if not works and not garbage:
            return 0
        return await self._handle(works, garbage)

    def _coalesce(self, rows: Sequence[_FeedRow]) -> tuple[dict[str, _Work], dict[str, set[str]]]:
        works = self._deferred
        self._deferred = {}
        garbage: dict[str, set[str]] = {}
        for key, rid, fields in rows:
            sid = (fields or {}).get("s")
            try:
                validate_session_id(sid)
            except InvalidSessionIdError:
                garbage.setdefault(key, set()).add(rid)  # trimmed while pending, or not ours
                continue
            assert sid is not None
            w = works.get(sid)
            if w is None:
                w = works[sid] = _Work(sid)
            w.add(key, rid)
        return works, garbage

    async def _handle(self, works: dict[str, _Work], garbage: dict[str, set[str]]) -> int:
        acked = 0
        if garbage:
            pipe = self._r.pipeline(transaction=False)
            for key, rids in garbage.items():
                pipe.execute_command("XACK", key, self.group, *sorted(rids))
            await pipe.execute()
            acked += sum(len(v) for v in garbage.values())
            self.metrics.processed.inc(acked)
        limiter = anyio.Semaphore(self.concurrency)

        async def one(w: _Work) -> None:
            nonlocal acked
            async with limiter:
                outcome, count = await self._work(w)
            if outcome == BUSY:
                self._deferred[w.session_id] = w
            acked += count

        async with anyio.create_task_group() as tg:
            for w in works.values():
                tg.start_soon(one, w)
        self.batches += 1
        return acked

    async def _work(self, w: _Work) -> tuple[str, int]:
        """Check one session for its feed entries; returns (outcome, feed entries acked)."""
        counters: dict[str, int] = {}
        outcome = await self._check(w.session_id, counters)
        self.metrics.checks.labels(outcome).inc()
        if outcome == BUSY:
            return outcome, 0
        ack = outcome != FAILED  # a failure stays pending: reclaimed and retried after claim_idle_ms
        count = w.count if ack else 0
        counters["checked"] = 1
        name = "errors" if outcome == FAILED else outcome
        counters[name] = counters.get(name, 0) + 1
        try:
            with anyio.CancelScope(shield=True):
                pipe = self._r.pipeline(transaction=False)
                if count:
                    for key, rids in w.ids.items():
                        pipe.execute_command("XACK", key, self.group, *sorted(rids))
                    counters["processed"] = count
                for name, value in counters.items():
                    pipe.execute_command("HINCRBY", self._stats_key, name, value)
                await pipe.execute()
        except (RedisError, OSError) as e:
            log.warning("compactor %s: ack of %r failed: %s", self.consumer, w.session_id, e)
            return outcome, 0
        self.metrics.processed.inc(count)
        return outcome, count

    # ------------------------------------------------------------------ one session

    async def check(self, session_id: str) -> str:
        """Check one session now (no feed entry needed) and compact it when it is over budget;
        returns UNDER, COMPACTED, UNCUTTABLE, BUSY, DELETED or FAILED. Counted like a feed check."""
        validate_session_id(session_id)
        outcome, _ = await self._work(_Work(session_id))
        return outcome

    async def _check(self, session_id: str, counters: dict[str, int]) -> str:
        try:
            view = await self._view(session_id)  # cheap path first: no lock for a session under budget
            if view is None:
                return DELETED
            if view.tokens <= self.budget_tokens:
                return UNDER
            return await self._locked(session_id, counters)
        except SessionNotFoundError:  # SessionReplacedError included: another life of the id now
            return DELETED
        except (StoreUnavailableError, RedisError, OSError) as e:
            log.warning("compactor %s: check of %r failed: %s", self.consumer, session_id, e)
            return FAILED
        except Exception:
            log.exception("compactor %s: check of %r failed", self.consumer, session_id)
            return FAILED

    async def _view(self, session_id: str) -> _View | None:
        head = await self.store.head(session_id)
        if head is None:
            return None
        state = await load_state(self.store, head, cache=self.cache)
        msgs = state.messages()
        return _View(head, state, msgs, sum(self.estimator(m) for m in msgs))

    def plan(self, view: _View) -> _Plan | None:
        """Where to cut `view`, or None when no legal boundary leaves anything to summarise."""
        msgs, last_cut = view.messages, view.state.last_cut
        k = 0  # the current summary: the messages the last cut put in front
        if last_cut is not None:
            while k < len(msgs) and msgs[k].source == (last_cut,):
                k += 1
        body = msgs[k:]
        kept = history(body, self.keep_recent, self.keep_tokens, estimator=self.estimator)
        if not kept:
            return None
        first = next((i for i, m in enumerate(body) if m is kept[0]), None)
        if not first:  # None (not found) or 0: everything after the summary would be kept
            return None
        idx = k + first
        if msgs[idx].role != "user" or any(not m.source for m in msgs[idx:]):
            return None
        before = min(min(m.source) for m in msgs[idx:])
        if any(m.source and max(m.source) >= before for m in msgs[k:idx]):
            return None  # a replace put a summarised entry after `before`: the cut would show it
        kept_tokens = sum(self.estimator(m) for m in msgs[idx:])
        return _Plan(
            incarnation=view.head.header.incarnation,
            prev_cut=last_cut,
            idx=idx,
            before=before,
            head=tuple(msgs[:idx]),
            first_kept=msgs[idx].source,
            tokens=view.tokens,
            kept_tokens=kept_tokens,
        )

    async def _compact(self, session_id: str, counters: dict[str, int]) -> str:
        """The decision and the write, under the lock; re-decided from a fresh head on conflict."""
        plan: _Plan | None = None
        summary: builtins.list[ChatMessage] = []
        for attempt in range(self.max_conflicts + 1):
            view = await self._view(session_id)
            if view is None:
                return DELETED
            if view.tokens <= self.budget_tokens:
                return UNDER  # another writer's cut (or a replace) brought it under the budget
            if plan is None or not plan.holds(view):
                plan = self.plan(view)
                if plan is None:
                    log.info(
                        "compactor %s: %r is over budget (%d tokens) but has no boundary to cut at",
                        self.consumer, session_id, view.tokens,
                    )  # fmt: skip
                    return UNCUTTABLE
                summary = await self._summary(session_id, plan, counters)
                if not summary:
                    return FAILED
            try:
                await self._write(session_id, view, plan, summary)
            except (SessionConflictError, IdempotencyKeyReusedError) as e:
                counters["conflicts"] = counters.get("conflicts", 0) + 1
                self.metrics.conflicts.inc()
                log.info("compactor %s: %r moved on (%s); deciding again", self.consumer, session_id, e)
                await conflict_backoff(attempt)
                continue
            self.metrics.tokens_removed.inc(max(0, view.tokens - plan.kept_tokens))
            log.info(
                "compactor %s: compacted %r at before=%d: ~%d tokens over the %d budget; %d messages summarised, "
                "~%d tokens kept + the summary",
                self.consumer, session_id, plan.before, view.tokens, self.budget_tokens, plan.idx, plan.kept_tokens,
            )  # fmt: skip
            return COMPACTED
        log.warning("compactor %s: %r kept moving; left for a later retry", self.consumer, session_id)
        return FAILED

    async def _summary(self, session_id: str, plan: _Plan, counters: dict[str, int]) -> builtins.list[ChatMessage]:
        """The summary messages for `plan` (empty on a failure, logged and counted)."""
        t0 = time.perf_counter()
        try:
            if self.timeout is None:
                result = await self._call_summarizer(to_openai(plan.head))
            else:
                with anyio.fail_after(self.timeout):
                    result = await self._call_summarizer(to_openai(plan.head))
            return self._shape(result)
        except Exception as e:
            counters["summarizer_errors"] = counters.get("summarizer_errors", 0) + 1
            self.metrics.summarizer_errors.inc()
            why = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            log.warning("compactor %s: summarizer failed for %r (%s); retried later", self.consumer, session_id, why)
            return []
        finally:
            self.metrics.summarize_seconds.observe(time.perf_counter() - t0)

    async def _call_summarizer(self, chat: builtins.list[ChatMessage]) -> SummaryResult:
        fn = self.summarize
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):  # noqa: B004
            result: Any = fn(chat)
        else:  # a sync callable may block (an HTTP client): keep it off the event loop
            result = await anyio.to_thread.run_sync(fn, chat, abandon_on_cancel=True)
        if inspect.isawaitable(result):
            result = await result
        return cast(SummaryResult, result)

    def _shape(self, result: Any) -> builtins.list[ChatMessage]:
        if isinstance(result, str):
            text = result.strip()
            if not text:
                raise ValueError("the summarizer returned an empty summary")
            return [{"role": self.summary_role, "content": self.summary_prefix + text}]
        if isinstance(result, Sequence) and result and all(isinstance(m, Mapping) for m in result):
            out = [dict(m) for m in result]
            for m in out:
                if m.get("role") not in ("system", "user", "assistant") or not m.get("content"):
                    raise ValueError("summary messages need a role (system, user, assistant) and content")
            return out
        raise TypeError(f"the summarizer returned {type(result).__name__}; expected str or a list of messages")

    async def _write(self, session_id: str, view: _View, plan: _Plan, summary: builtins.list[ChatMessage]) -> None:
        """Append the cut at `view`'s head with the range's idempotency key. A lost reply is sent
        again with the same key (it returns the cut that landed); conflicts propagate."""
        data = {"before": plan.before, "summary": summary, "reason": self.reason}
        meta = {
            "compactor": {
                "tokens": plan.tokens,
                "kept_tokens": plan.kept_tokens,
                "summarised": plan.idx,
                "budget": self.budget_tokens,
            }
        }
        entry = NewEntry(CUT, data, meta)
        for attempt in range(3):
            try:
                await self.store.put(
                    session_id,
                    view.head.n,
                    [entry],
                    idempotency_key=plan.key,
                    incarnation=plan.incarnation,
                )
                return
            except StoreUnavailableError:
                if attempt == 2:
                    raise
                await anyio.sleep(0.2 * (attempt + 1))

    # ------------------------------------------------------------------ the lock

    async def _locked(self, session_id: str, counters: dict[str, int]) -> str:
        """`_compact` under the session's lock (BUSY when another worker holds it; no lock with
        lock_ms=0). The lock is renewed every lock_ms/3 meanwhile, then released if still ours."""
        if not self.lock_ms:
            return await self._compact(session_id, counters)
        key = self.store.keys.compact_lock(session_id)
        token = f"{self.consumer}:{secrets.token_hex(4)}"
        if not await self._r.execute_command("SET", key, token, "NX", "PX", self.lock_ms):
            return BUSY
        outcome = FAILED
        error: Exception | None = None  # raised as itself, not in the task group's ExceptionGroup
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._renew, key, token)
                try:
                    outcome = await self._compact(session_id, counters)
                except Exception as e:
                    error = e
                finally:
                    tg.cancel_scope.cancel()
            if error is not None:
                raise error
            return outcome
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                if as_str(await self._r.execute_command("GET", key, **RAW) or b"") == token:
                    await self._r.execute_command("DEL", key)

    async def _renew(self, key: str, token: str) -> None:
        while True:
            await anyio.sleep(self.lock_ms / 3000)
            with contextlib.suppress(RedisError, OSError):
                if as_str(await self._r.execute_command("GET", key, **RAW) or b"") != token:
                    return  # lapsed and taken: expected_n and the range key still keep us right
                await self._r.execute_command("PEXPIRE", key, self.lock_ms)

    # ------------------------------------------------------------------ health

    async def refresh_gauges(self) -> dict[str, Any]:
        """Update the lag/pending gauges and forget consumers gone for ``consumer_ttl_ms`` with
        nothing pending; returns `status()`."""
        st = await status(self.store, group=self.group)
        for sh in st["shards"]:
            self.metrics.lag.labels(str(sh["shard"])).set(sh["lag"] or 0)
            self.metrics.pending.labels(str(sh["shard"])).set(sh["pending"])
            for c in sh["consumers"]:
                if c["pending"] == 0 and c["idle_ms"] >= self.consumer_ttl_ms and c["name"] != self.consumer:
                    await self._r.execute_command("XGROUP", "DELCONSUMER", sh["key"], self.group, c["name"])
        return st


# --------------------------------------------------------------------------- status


async def status(store: RedisSessionStore, *, group: str = DEFAULT_GROUP) -> dict[str, Any]:
    """The group's health, as `projector.status` reports it (per shard: length, lag, pending,
    consumers), with the compactor's counters summed over its workers: ``checked``, ``under``,
    ``compacted``, ``uncuttable``, ``deleted``, ``errors``, ``conflicts``, ``summarizer_errors``,
    ``processed``, ``reclaimed``."""
    st = await _feed_status(store, group=group)
    raw = await feed_client_of(store).execute_command("HGETALL", store.keys.compactor_stats(group), **RAW)
    st["counters"] = {k: int(v) for k, v in as_map(raw).items()}
    return st
