"""One identity across every surface: the driver of the cross-surface model-based run.

A seeded random program mixes, on one session id, writers of every surface that holds a session
between calls — a `Session` handle, the OpenAI Agents and LangChain adapters, an HTTP client
pinned by ``X-Session-Incarnation`` (a real gateway over HTTP), a store writer whose replies a
proxy drops (then retries with its idempotency key) — with readers (`follow`, SSE) and with
delete + re-create of the id holding as many entries as the old life (the case a check by length
cannot see). Writes are also cancelled at random points.

Each write carries a unique tag and is classified by what its caller was told: acknowledged,
refused, or unknown (cancelled, or a reply lost without a retry). At each re-creation the dying
life's log is captured; at the end the current one. What must hold (`Run.check`):

- every acknowledged write is in the life it was written to, exactly once, and in no other;
- a refused write is in no life; an unknown one is at most once in its own life, in no other;
- no reader saw an entry that is not its own life's, and each saw its life's log in order.

``tests/reliability/test_identity_model.py`` runs a few short programs in CI;
``bench/identity_soak.py`` runs many long ones and prints what was done and what held.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import msgspec

from redis_session import (
    Entry,
    NewEntry,
    RedisSessionStore,
    SessionError,
    SessionHeader,
    SessionNotFoundError,
    Sessions,
    StoreUnavailableError,
)
from redis_session.live import follow

SID = "xs-life"

Outcome = str  # "ack" | "refused" | "unknown"


@dataclass
class Write:
    tag: str
    surface: str
    life: int
    outcome: Outcome = "unknown"
    error: str = ""


@dataclass
class Reader:
    surface: str
    life: int
    seen: list[str] = field(default_factory=list)  # tags (or entry digests) in the order seen
    n_seen: list[int] = field(default_factory=list)


@dataclass
class Stats:
    steps: int = 0
    writes: Counter[str] = field(default_factory=Counter)  # by outcome
    by_surface: Counter[str] = field(default_factory=Counter)
    recreations: int = 0
    lost_replies: int = 0
    cancellations: int = 0
    readers: int = 0
    entries_read: int = 0


def tags_of(e: Entry) -> list[str]:
    """The write tags an entry holds (each write puts one ``T<digits>Z`` token in its data)."""
    raw = msgspec.json.encode(e.data).decode()
    out, i = [], raw.find("T~")
    while i != -1:
        j = raw.find("~Z", i)
        out.append(raw[i : j + 2])
        i = raw.find("T~", j)
    return out


class Run:
    """One seeded program; `await run.go(steps)` then `run.check()`."""

    def __init__(
        self,
        store: RedisSessionStore,
        lossy: RedisSessionStore,
        proxy: Any,
        http: httpx.AsyncClient,
        seed: int,
    ) -> None:
        self.store, self.lossy, self.proxy, self.http = store, lossy, proxy, http
        self.rng = random.Random(seed)
        self.sessions = Sessions(store)
        self.life = 0
        self.incarnations: list[str] = []
        self.logs: dict[int, list[Entry]] = {}
        self.writes: list[Write] = []
        self.readers: list[Reader] = []
        self.stats = Stats()
        self._tag = 0
        self._surfaces: list[tuple[str, int, Any]] = []  # (kind, life, object) held between calls
        self.writer_kinds = ["handle", "openai", "langchain", "http"]
        self.moved = anyio.Event()  # set when the id is re-created (resuming readers wait for it)

    # ------------------------------------------------------------------ lives

    def tag(self) -> str:
        self._tag += 1
        return f"T~{self._tag:05d}~Z"

    async def _create(self, entries: int) -> None:
        seeds = [NewEntry("user/message", {"content": f"seed {self.life} {i}"}) for i in range(entries)]
        head = await self.store.create(SessionHeader(id=SID), seeds)
        self.incarnations.append(head.header.incarnation)

    async def recreate(self) -> None:
        """Capture the dying life's log, delete the id, create it again with as many entries."""
        old = await self.store.read(SID)
        self.logs[self.life] = old
        await self.store.delete(SID)
        self.life += 1
        await self._create(len(old))
        self.stats.recreations += 1
        self.moved.set()
        self.moved = anyio.Event()

    # ------------------------------------------------------------------ surfaces

    async def _surface(self, kind: str) -> Any:
        """A surface object of `kind` bound to the life current now (or one held from before)."""
        held = [(life, obj) for k, life, obj in self._surfaces if k == kind]
        if held and self.rng.random() < 0.7:
            return self.rng.choice(held)
        obj: Any
        if kind == "handle":
            obj = await self.sessions.open(SID)
        elif kind == "openai":
            from redis_session.adapters.openai_agents import RedisEventSession

            obj = RedisEventSession(SID, self.store)
            await obj.get_items()  # it sees (and pins) the current life now
        elif kind == "langchain":
            from redis_session.adapters.langchain import RedisChatMessageHistory

            obj = RedisChatMessageHistory(SID, self.store)
            await obj.aget_messages()
        elif kind == "http":
            r = await self.http.get(f"/sessions/{quote(SID, safe='')}")
            assert r.status_code == 200, r.text
            obj = r.headers["x-session-incarnation"]
        else:  # pragma: no cover
            raise AssertionError(kind)
        entry = (kind, self.life, obj)
        self._surfaces.append(entry)
        return self.life, obj

    async def _write_via(self, kind: str, obj: Any, tag: str) -> None:
        if kind == "handle":
            try:
                await obj.append("user/message", {"content": tag})
            except SessionError as e:
                if type(e).__name__ != "SessionConflictError":
                    raise
                await obj.refresh()  # another writer of this life moved n: catch up, once
                await obj.append("user/message", {"content": tag})
        elif kind == "openai":
            await obj.add_items([{"role": "user", "content": tag}])
        elif kind == "langchain":
            from langchain_core.messages import HumanMessage

            await obj.aadd_messages([HumanMessage(content=tag)])
        elif kind == "http":
            r = await self.http.post(
                f"/sessions/{quote(SID, safe='')}/entries",
                json={"type": "user/message", "data": {"content": tag}},
                headers={"X-Session-Incarnation": obj},
            )
            if r.status_code in (404, 409, 410, 412):
                raise _Refused(f"HTTP {r.status_code} {r.text[:120]}")
            assert r.status_code == 201, r.text
        else:  # pragma: no cover
            raise AssertionError(kind)

    async def write(self) -> None:
        kind = self.rng.choice(self.writer_kinds)
        life, obj = await self._surface(kind)
        w = Write(self.tag(), kind, life)
        self.writes.append(w)
        self.stats.by_surface[kind] += 1
        cancel_after = self.rng.random() * 0.004 if self.rng.random() < 0.15 else None
        await self._settle(w, lambda: self._write_via(kind, obj, w.tag), cancel_after)

    async def lossy_write(self) -> None:
        """A store writer pinned to the current life whose reply is dropped; retried by key."""
        life, inc = self.life, self.incarnations[-1]
        w = Write(self.tag(), "store+lost-reply", life)
        self.writes.append(w)
        self.stats.by_surface[w.surface] += 1
        key = f"k-{w.tag}"
        entry = [NewEntry("user/message", {"content": w.tag})]
        # the proxy cuts the connection on the way down: the command runs, its reply is lost
        self.proxy.cut_up, self.proxy.cut_rate = False, 1.0
        self.stats.lost_replies += 1
        try:
            await self.lossy.put(SID, None, entry, idempotency_key=key, incarnation=inc)
        except StoreUnavailableError:
            pass  # the reply was lost: retry it, as every client would
        except SessionError as e:
            w.outcome, w.error = "refused", repr(e)
            return
        finally:
            self.proxy.cut_rate = 0.0
        if self.rng.random() < 0.3:
            await self.recreate()  # the id moved on before the retry: the retry must be refused
        for _ in range(20):
            try:
                await self.lossy.put(SID, None, entry, idempotency_key=key, incarnation=inc)
                w.outcome = "ack"
                return
            except StoreUnavailableError:
                continue
            except SessionError as e:
                # the first attempt may have landed (its reply was lost) before its life ended:
                # a refused retry says nothing about it
                w.outcome, w.error = "unknown", repr(e)
                return

    async def _settle(self, w: Write, op: Callable[[], Awaitable[None]], cancel_after: float | None) -> None:
        try:
            if cancel_after is None:
                await op()
                w.outcome = "ack"
                return
            with anyio.move_on_after(cancel_after) as scope:
                await op()
                w.outcome = "ack"
            if scope.cancelled_caught:
                self.stats.cancellations += 1
                w.outcome = "unknown"
        except (SessionError, _Refused, ValueError, RuntimeError) as e:
            # the framework's own stale-session errors are ValueError/RuntimeError subclasses
            w.outcome, w.error = "refused", repr(e)

    # ------------------------------------------------------------------ readers

    async def _follow(self, r: Reader, start: int) -> None:
        with contextlib.suppress(SessionNotFoundError):
            async for e in follow(self.store, SID, start, incarnation=self.incarnations[r.life]):
                r.n_seen.append(e.n)
                r.seen.append(_digest(e))
                self.stats.entries_read += 1

    async def _sse(self, r: Reader, start: int, resume: bool = False) -> None:
        """An SSE reader; with `resume` it leaves after a few events and, once the id has moved
        on (or a moment passed), comes back with ``Last-Event-ID`` as a browser does."""
        url = f"/sessions/{quote(SID, safe='')}/events"
        last_id: str | None = None
        leave_after = self.rng.randrange(1, 4) if resume else None
        for attempt in (0, 1):
            headers = {} if last_id is None else {"Last-Event-ID": last_id}
            # the first request names the life the reader began on, as a client that read the
            # head first does (the task may connect after the id moved on); a resume's id names it
            inc = self.incarnations[r.life]
            params = {"start": start, "incarnation": inc} if last_id is None else {}
            async with self.http.stream("GET", url, params=params, headers=headers) as resp:
                if resp.status_code in (404, 410):
                    return  # the life it resumes is gone: told so
                if resp.status_code == 409:  # pinned to a life the id left before it connected: told so
                    assert msgspec.json.decode(await resp.aread())["error"] == "session_replaced"
                    return
                assert resp.status_code == 200, resp.status_code
                event, got = "", 0
                async for line in resp.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("id:"):
                        last_id = line[3:].strip()
                    elif line.startswith("data:") and event in ("", "entry"):
                        e = msgspec.json.decode(line[5:].strip().encode(), type=Entry)
                        r.n_seen.append(e.n)
                        r.seen.append(_digest(e))
                        self.stats.entries_read += 1
                        got += 1
                        if attempt == 0 and leave_after is not None and got >= leave_after:
                            break
                    elif line.startswith("data:") and event in ("replaced", "deleted"):
                        return
                    elif line == "":
                        event = ""
            if attempt == 0 and (leave_after is None or last_id is None):
                return
            if attempt == 0:
                moved = self.moved
                with anyio.move_on_after(1.0):
                    await moved.wait()

    async def reader(self, tg: anyio.abc.TaskGroup) -> None:
        kind = self.rng.choice(["follow", "sse", "sse-resume"])
        head = await self.store.head(SID)
        assert head is not None
        r = Reader(kind, self.life)
        self.readers.append(r)
        self.stats.readers += 1
        start = self.rng.randrange(0, head.n + 1)
        r.n_seen.append(start - 1)  # where it began (not an entry)
        if kind == "follow":
            tg.start_soon(self._follow, r, start)
        else:
            tg.start_soon(self._sse, r, start, kind == "sse-resume")

    # ------------------------------------------------------------------ the program

    async def go(self, steps: int) -> None:
        await self._create(self.rng.randrange(0, 3))
        async with anyio.create_task_group() as tg:
            for _ in range(steps):
                self.stats.steps += 1
                roll = self.rng.random()
                if roll < 0.12:
                    await self.recreate()
                elif roll < 0.20:
                    await self.lossy_write()
                elif roll < 0.28:
                    await self.reader(tg)
                elif roll < 0.36:
                    async with anyio.create_task_group() as pair:  # two surfaces at once
                        pair.start_soon(self.write)
                        pair.start_soon(self.write)
                else:
                    await self.write()
            self.logs[self.life] = await self.store.read(SID)
            await self.store.delete(SID)  # every reader ends: deleted, or its life replaced
            # readers still draining get a moment, then are stopped (what they saw is checked)
            tg.cancel_scope.deadline = anyio.current_time() + 3
        for w in self.writes:
            self.stats.writes[w.outcome] += 1

    # ------------------------------------------------------------------ the verdict

    def check(self) -> list[str]:
        """Every violation found (empty: the run held)."""
        problems: list[str] = []
        where: dict[str, Counter[int]] = {}
        for life, entries in self.logs.items():
            for e in entries:
                for t in tags_of(e):
                    where.setdefault(t, Counter())[life] += 1
        for w in self.writes:
            lives = where.get(w.tag, Counter())
            own, others = lives.get(w.life, 0), sum(c for life, c in lives.items() if life != w.life)
            if others:
                problems.append(f"{w} landed in another life: {dict(lives)}")
            if w.outcome == "ack" and own != 1:
                problems.append(f"{w} acknowledged but found {own} times in its life")
            if w.outcome == "refused" and own:
                problems.append(f"{w} refused but found {own} times in its life")
            if w.outcome == "unknown" and own > 1:
                problems.append(f"{w} found {own} times in its life")
        digests = {life: [_digest(e) for e in entries] for life, entries in self.logs.items()}
        for r in self.readers:
            log = digests.get(r.life, [])
            start, got = r.n_seen[0] + 1, r.seen
            if got != log[start : start + len(got)]:
                problems.append(
                    f"{r.surface} reader of life {r.life} from n={start} saw {got[:6]}… not its life's "
                    f"log {log[start : start + 6]}…"
                )
        return problems


class _Refused(Exception):
    """An HTTP refusal (404/409/412): the write did not land."""


def _digest(e: Entry) -> str:
    return f"{e.n}:{e.type}:{msgspec.json.encode(e.data).decode()}"


@contextlib.asynccontextmanager
async def http_client(base: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base, timeout=20) as c:
        yield c
