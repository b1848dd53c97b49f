"""A request pinned to one life of a session id (``X-Session-Incarnation``, ``If-Match:
"<n>;<incarnation>"``, ``?incarnation=``) is never served by another: every ``/sessions/{id}``
route on a real gateway over a real server answers 409 ``session_replaced`` once the id was
deleted and created again — before the handler runs, and, where a route is two steps, when the
re-creation lands between them (a store that deletes and re-creates the id right before one of
its own calls). The store and `Sessions` calls that close those windows (`set_draft(incarnation=)`,
`create(parent_incarnation=)`, `Sessions.branch/fork/repair(incarnation=)`) on every backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from redis_session import RedisSessionStore, SessionHeader, Sessions
from redis_session.errors import SessionReplacedError

from support import running_gateway

pytestmark = pytest.mark.anyio

TURN = [
    ("turn/start", {"turn": 1}),
    ("user/message", {"content": "hi"}),
    ("assistant/message", {"turn": 1, "step": 1, "content": "hello"}),
    ("turn/end", {"turn": 1, "reason": {"kind": "completed"}}),
]
OPEN_TURN = [("turn/start", {"turn": 1}), ("user/message", {"content": "hi"})]


def path(session_id: str, sub: str = "") -> str:
    return "/sessions/" + quote(session_id, safe="") + (f"/{sub}" if sub else "")


async def replace(store: Any, sid: str, entries: Any = TURN) -> str:
    """Delete `sid` and create it again (a new life); the new life's incarnation."""
    assert await store.delete(sid)
    head = await store.create(SessionHeader(id=sid, title="new life"), entries)
    return str(head.header.incarnation)


async def state(store: Any, sid: str) -> Any:
    """All a request could change of `sid`: its head, entries, draft and branches."""
    head = await store.head(sid)
    if head is None:
        return None
    kids = await store.list(parent=sid)
    return (head, await store.read(sid), await store.get_draft(sid), [h.id for h in kids.items])


# (method, sub-resource, body): every /sessions/{id} route
ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "", None),
    ("GET", "entries", None),
    ("GET", "messages", None),
    ("GET", "draft", None),
    ("GET", "events", None),
    ("POST", "entries", {"type": "user/message", "data": {"content": "to the old life"}}),
    ("PUT", "draft", {"text": "meant for the old life"}),
    ("POST", "branch", {"at": 1, "id": "old-branch"}),
    ("POST", "fork", {"id": "old-fork"}),
    ("POST", "repair", None),
    ("POST", "answers", {}),
    ("POST", "answers/a1/deltas", {"first_index": 0, "deltas": [{"text": "x"}]}),
    ("POST", "answers/a1/end", {"reason": "committed"}),
    ("DELETE", "", None),
]


async def send(client: httpx.AsyncClient, method: str, sub: str, body: Any, pin: dict[str, Any]) -> httpx.Response:
    url = path("p", sub)
    kw: dict[str, Any] = {"headers": pin.get("headers", {}), "params": pin.get("params", {})}
    if body is not None:
        kw["json"] = body
    if sub == "events":
        async with client.stream(method, url, **kw) as r:
            await r.aread()  # a 409 is answered before any stream opens: the body is the JSON error
            return r
    return await client.request(method, url, **kw)


@pytest.mark.parametrize("how", ["query", "header", "if-match", "old-first", "empty-query"])
async def test_a_pin_sent_twice_or_empty_is_refused_on_every_route(redis_store: RedisSessionStore, how: str) -> None:
    """``?incarnation=OLD&incarnation=NEW`` (the last won) and two ``X-Session-Incarnation`` or
    ``If-Match`` headers (the first won) were served by whichever life the parser picked: a pin
    sent twice is ambiguous and answers 400 on every route, nothing read or written; so does an
    empty ``?incarnation=`` (an empty header already did)."""
    old = str((await redis_store.create(SessionHeader(id="p"), TURN)).header.incarnation)
    await replace(redis_store, "p", OPEN_TURN)
    await redis_store.set_draft("p", {"text": "the new life's own"})
    before = await state(redis_store, "p")
    new = str(before[0].header.incarnation)
    pins: dict[str, dict[str, Any]] = {
        "query": {"params": [("incarnation", old), ("incarnation", new)]},
        "header": {"headers": [("X-Session-Incarnation", new), ("X-Session-Incarnation", old)]},
        "if-match": {"headers": [("If-Match", f'"2;{new}"'), ("If-Match", f'"2;{old}"')]},
        "old-first": {"headers": [("X-Session-Incarnation", old), ("X-Session-Incarnation", new)]},
        "empty-query": {"params": [("incarnation", "")]},
    }
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        for method, sub, body in ROUTES:
            r = await send(client, method, sub, body, pins[how])
            assert r.status_code == 400, (method, sub, r.status_code, r.text[:300])
        # two Last-Event-IDs naming two lives: which one does the stream resume? neither
        async with client.stream(
            "GET", path("p", "events"), headers=[("Last-Event-ID", f"{new}:1"), ("Last-Event-ID", f"{old}:1")]
        ) as r:
            await r.aread()
            assert r.status_code == 400, r.text[:300]
    assert await state(redis_store, "p") == before
    assert await redis_store.head("old-branch") is None and await redis_store.head("old-fork") is None


@pytest.mark.parametrize("how", ["header", "if-match", "query"])
async def test_every_route_refuses_a_pin_to_the_old_life(redis_store: RedisSessionStore, how: str) -> None:
    """Reads of the head, entries, messages and the draft, the SSE stream, draft PUT, branch, fork,
    repair, answers and delete all served (or changed) the new life of an id for a request pinned
    to the old one. Now each answers 409 ``session_replaced`` and nothing of the new life changes."""
    old = str((await redis_store.create(SessionHeader(id="p"), TURN)).header.incarnation)
    await replace(redis_store, "p", OPEN_TURN)  # an open turn: a repair would write
    await redis_store.set_draft("p", {"text": "the new life's own"})
    before = await state(redis_store, "p")
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        for method, sub, body in ROUTES:
            if how == "header":
                pin: dict[str, Any] = {"headers": {"X-Session-Incarnation": old}}
            elif how == "if-match":
                pin = {"headers": {"If-Match": f'"2;{old}"'}}
            else:
                pin = {"params": {"incarnation": old}}
            r = await send(client, method, sub, body, pin)
            assert r.status_code == 409, (method, sub, r.status_code, r.text[:300])
            assert r.json()["error"] == "session_replaced", (method, sub, r.text[:300])
        # the pin to the current life is served, as before
        now = str(before[0].header.incarnation)
        r = await client.get(path("p", "entries"), headers={"X-Session-Incarnation": now})
        assert r.status_code == 200 and len(r.json()["entries"]) == 2
    assert await state(redis_store, "p") == before
    assert await redis_store.head("old-branch") is None and await redis_store.head("old-fork") is None


class RacingStore(RedisSessionStore):
    """A real store that, when `armed` names one of its calls, deletes and re-creates the session
    (through another store on the same server) right before that call runs: the re-creation lands
    between a route's check and its write or read."""

    other: RedisSessionStore
    armed: str | None = None
    fired = 0

    async def _race(self, name: str) -> None:
        if self.armed == name:
            self.armed = None
            self.fired += 1
            await replace(self.other, "p", OPEN_TURN)

    async def set_draft(self, *a: Any, **kw: Any) -> None:
        await self._race("set_draft")
        await super().set_draft(*a, **kw)

    async def create(self, header: SessionHeader, *a: Any, **kw: Any) -> Any:
        if header.parent is not None:
            await self._race("link")
        return await super().create(header, *a, **kw)

    async def delete(self, *a: Any, **kw: Any) -> bool:
        await self._race("delete")
        return await super().delete(*a, **kw)

    async def read(self, *a: Any, **kw: Any) -> Any:
        await self._race("read")
        return await super().read(*a, **kw)

    async def get_draft(self, *a: Any, **kw: Any) -> Any:
        await self._race("get_draft")
        return await super().get_draft(*a, **kw)

    async def acquire_lease(self, *a: Any, **kw: Any) -> bool:
        await self._race("acquire_lease")
        return await super().acquire_lease(*a, **kw)


@pytest.fixture
async def racing(redis_url: str, prefix: str, redis_store: RedisSessionStore) -> AsyncIterator[RacingStore]:
    s = RacingStore.from_url(redis_url, prefix=prefix)
    assert isinstance(s, RacingStore)
    s.other = redis_store
    try:
        yield s
    finally:
        await s.aclose()


# (what the store is doing when the id is re-created, the request, whether it is pinned)
BETWEEN: list[tuple[str, str, str, Any, bool]] = [
    ("set_draft", "PUT", "draft", {"text": "meant for the old life"}, True),
    ("link", "POST", "branch", {"at": 1, "id": "old-branch"}, True),
    ("link", "POST", "branch", {"at": 1, "id": "old-branch"}, False),  # the life it read
    ("link", "POST", "fork", {"id": "old-fork"}, True),
    ("link", "POST", "fork", {"id": "old-fork"}, False),
    ("delete", "DELETE", "", None, True),
    ("acquire_lease", "POST", "repair", None, True),
    ("read", "GET", "entries", None, True),
    ("get_draft", "GET", "draft", None, True),
    ("read", "GET", "messages", None, True),
]


@pytest.mark.parametrize(("step", "method", "sub", "body", "pinned"), BETWEEN)
async def test_a_re_creation_between_the_steps_of_a_route_is_refused(
    racing: RacingStore, step: str, method: str, sub: str, body: Any, pinned: bool
) -> None:
    """The id deleted and created again after the gateway checked the pin, before the store
    wrote (or read): the draft, the branch's link in the parent, the delete and the repair's
    writes are checked against the life in their scripts, a read once more after it was read —
    409, and the new life is as the re-creation left it (an unpinned branch or fork is of the
    life it read: it is refused too, never a child of the new life with the old one's header)."""
    old = str((await racing.create(SessionHeader(id="p"), OPEN_TURN if sub == "repair" else TURN)).header.incarnation)
    headers = {"X-Session-Incarnation": old} if pinned else {}
    async with running_gateway(racing) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        racing.armed = step
        r = await client.request(method, path("p", sub), json=body, headers=headers)
        assert racing.fired == 1, "the re-creation did not happen inside the request"
        assert r.status_code == 409 and r.json()["error"] == "session_replaced", (step, sub, r.status_code, r.text)
    head = await racing.other.head("p")
    assert head is not None and head.header.title == "new life" and head.header.incarnation != old
    assert [e.type for e in await racing.other.read("p")] == [t for t, _ in OPEN_TURN]
    assert await racing.other.get_draft("p") is None
    assert (await racing.other.list(parent="p")).items == []
    assert await racing.other.head("old-branch") is None and await racing.other.head("old-fork") is None
    assert await racing.other.links("p") == ([], [])


async def test_sse_pinned_to_a_replaced_life_is_409_before_the_stream(redis_store: RedisSessionStore) -> None:
    """``GET /events`` pinned (header or ``?incarnation=``, what EventSource can send) to a life
    already gone is a 409 JSON answer, not a 200 stream; a resume by Last-Event-ID alone still
    gets ``event: replaced`` (an EventSource reconnecting cannot read a 409's body)."""
    old = str((await redis_store.create(SessionHeader(id="p"), TURN)).header.incarnation)
    await replace(redis_store, "p")
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        for kw in ({"headers": {"X-Session-Incarnation": old}}, {"params": {"incarnation": old}}):
            async with client.stream("GET", path("p", "events"), **kw) as r:  # type: ignore[arg-type]
                assert r.status_code == 409 and r.headers["content-type"].startswith("application/json")
                assert (await r.aread()).startswith(b'{"error":"session_replaced"')
        async with client.stream("GET", path("p", "events"), headers={"Last-Event-ID": f"{old}:1"}) as r:
            assert r.status_code == 200
            events = [line async for line in r.aiter_lines() if line.startswith("event:")]
        assert events[:1] == ["event: replaced"], events


# --------------------------------------------------------------------------- the Python API, every store


async def test_store_and_sessions_calls_refuse_another_life(store: Any) -> None:
    """`set_draft(incarnation=)`, `create(parent_incarnation=)` (the branch's link step) and
    `Sessions.branch/fork/repair/delete(incarnation=)` raise `SessionReplacedError` for a life
    that is gone and change nothing; given the current life they work as without it."""
    sessions = Sessions(store)
    old = str((await store.create(SessionHeader(id="p"), OPEN_TURN)).header.incarnation)
    new = await replace(store, "p", TURN)
    with pytest.raises(SessionReplacedError):
        await store.set_draft("p", {"text": "old"}, incarnation=old)
    assert await store.get_draft("p") is None
    with pytest.raises(SessionReplacedError):
        await store.create(SessionHeader(id="c1", parent="p", at=1), parent_incarnation=old)
    assert await store.head("c1") is None and await store.links("p") == ([], [])
    with pytest.raises(SessionReplacedError):
        await sessions.branch("p", 1, branch_id="c2", incarnation=old)
    with pytest.raises(SessionReplacedError):
        await sessions.fork("p", fork_id="c3", incarnation=old)
    with pytest.raises(SessionReplacedError):
        await sessions.repair("p", incarnation=old)
    with pytest.raises(SessionReplacedError):
        await sessions.delete("p", incarnation=old)
    assert [h.id for h in (await store.list(parent="p")).items] == []
    assert len(await store.read("p")) == len(TURN)
    # the current life
    await store.set_draft("p", {"text": "new"}, incarnation=new)
    assert await store.get_draft("p") == {"text": "new"}
    b = await sessions.branch("p", 1, branch_id="c4", incarnation=new)
    f = await sessions.fork("p", fork_id="c5", incarnation=new)
    assert b.header.parent == f.header.parent == "p"
    assert await sessions.repair("p", incarnation=new) == []
    # a handle is of one life: its branch, fork and draft refuse the next one
    handle = await sessions.open("p")
    await store.delete("c4")
    await store.delete("c5")
    assert await sessions.delete("p", incarnation=new)
    await store.create(SessionHeader(id="p"), TURN)
    for call in (handle.branch(1, branch_id="c6"), handle.fork(fork_id="c7"), handle.set_draft({"text": "x"})):
        with pytest.raises(SessionReplacedError):
            await call
    assert await store.head("c6") is None and await store.head("c7") is None


async def test_an_old_handle_neither_reads_the_new_lifes_draft_nor_takes_its_lease(store: Any) -> None:
    """An old handle's `draft()` returned the new life's draft (and its open answer's text), and
    `async with old.lease()` was granted on the new life, so the new life's own writer got
    `LeaseHeldError` for as long as the old one renewed it. Both are of the handle's life now:
    `SessionReplacedError`, nothing taken; `get_draft(incarnation=)` and
    `acquire_lease(incarnation=)` check the life with the read / the lease, in both stores."""
    sessions = Sessions(store)
    await store.create(SessionHeader(id="p"), TURN)
    old = await sessions.open("p")
    old_life = str(old.header.incarnation)
    await store.delete("p")
    new_life = str((await store.create(SessionHeader(id="p"), TURN)).header.incarnation)
    await store.set_draft("p", {"content": "NEW LIFE DRAFT"})

    with pytest.raises(SessionReplacedError):
        await old.draft()
    with pytest.raises(SessionReplacedError):
        await store.get_draft("p", incarnation=old_life)
    assert await store.get_draft("p", incarnation=new_life) == {"content": "NEW LIFE DRAFT"}

    with pytest.raises(SessionReplacedError):
        async with old.lease(ttl=30):
            pass
    with pytest.raises(SessionReplacedError):
        await store.acquire_lease("p", "old-token", 30_000, incarnation=old_life)
    new = await sessions.open("p")
    async with new.lease(ttl=30):  # the new life's writer is not locked out
        assert new.lease_held
    assert await store.acquire_lease("p", "t", 30_000, incarnation=new_life)


@pytest.mark.parametrize("tag", ['W/"{n}"', '"0{n}"', '"00{n}"', 'W/"{n};{life}"'])
async def test_a_weak_or_zero_padded_if_match_is_refused_and_writes_nothing(
    redis_store: RedisSessionStore, tag: str
) -> None:
    """``If-Match: W/"4"`` and ``"04"`` were taken as n=4 and the entry written: a weak tag never
    matches If-Match (RFC 9110 strong comparison) and the gateway never sends a padded n, so
    both are malformed: 400, nothing written."""
    life = str((await redis_store.create(SessionHeader(id="p"), TURN)).header.incarnation)
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        r = await client.post(
            path("p", "entries"),
            json={"type": "user/message", "data": {"content": "x"}},
            headers={"If-Match": tag.format(n=len(TURN), life=life)},
        )
        assert r.status_code == 400, r.text
        ok = await client.post(
            path("p", "entries"),
            json={"type": "user/message", "data": {"content": "y"}},
            headers={"If-Match": f'"{len(TURN)}"'},
        )
        assert ok.status_code == 201, ok.text
    assert [e.data for e in await redis_store.read("p", len(TURN))] == [{"content": "y"}]


async def test_out_of_range_arguments_of_the_python_api_are_typed(store: Any) -> None:
    """`Session.read(-1)`, `branch(at=-1)`, `list(limit=0)`, `reconstruct_request(n + 1)`,
    `lease(ttl=-1)`, `create(ttl=-1)` raised a bare ValueError: each is `InvalidArgumentError`
    (a `SessionError` and still a `ValueError`), nothing written."""
    from redis_session import InvalidArgumentError, SessionError

    sessions = Sessions(store)
    s = await sessions.create("args", entries=list(TURN))
    calls = [
        lambda: s.read(-1),
        lambda: s.read(0, -1),
        lambda: s.read(10**20),
        lambda: s.branch(-1),
        lambda: sessions.branch("args", -1),
        lambda: store.list(limit=0),
        lambda: store.list(limit=10**20),
        lambda: s.reconstruct_request(s.n + 1),
        lambda: sessions.create("args-2", ttl=-1),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError) as refused:
            await call()
        assert isinstance(refused.value, SessionError) and isinstance(refused.value, ValueError)
    with pytest.raises(InvalidArgumentError):
        s.lease(ttl=-1)
    assert await store.head("args-2") is None
    assert len(await store.read("args")) == len(TURN)
