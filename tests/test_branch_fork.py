"""Branches (ChatLuna), forks at a turn/end (dsh) and forks before a user message (nanobot).

Every refused fork asserts that no child was created.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import anyio
import pytest

from redis_session import (
    Entry,
    InvalidEntryError,
    InvalidSessionIdError,
    NewEntry,
    SessionAlreadyExistsError,
    SessionForkError,
    SessionNotFoundError,
)
from redis_session.projection import project
from redis_session.sessions import Session, Sessions

from support import am, let_pass, um

pytestmark = pytest.mark.anyio


def turn(k: int, q: str, a: str, reason: str = "completed") -> list[NewEntry]:
    return [
        NewEntry("turn/start", {"turn": k}),
        um(q),
        NewEntry("step/start", {"turn": k, "step": 1}),
        NewEntry("assistant/message", {"turn": k, "step": 1, "content": a}),
        NewEntry("step/end", {"turn": k, "step": 1}),
        NewEntry("turn/end", {"turn": k, "reason": reason}),
    ]


async def full(store: Any, sid: str) -> list[Entry]:
    head = await store.head(sid)
    return await store.read(sid, 0, head.n)


async def all_ids(sessions: Sessions) -> set[str]:
    return {h.id for h in (await sessions.list(limit=1000)).items}


# --------------------------------------------------------------------------- branch


async def test_branch_holds_the_prefix_and_its_own_entries(store: Any) -> None:
    sessions = Sessions(store)
    parent = await sessions.create("p", delegation_depth=2, title="parent")
    await parent.append_many([um(f"m{i}") for i in range(10)])
    b = await sessions.branch("p", 6)
    assert b.id.startswith("p:branch:") and len(b.id) == len("p:branch:") + 8
    int(b.id.rsplit(":", 1)[1], 16)
    assert (b.header.parent, b.header.at, b.header.delegation_depth, b.n) == ("p", 6, 2, 6)
    assert await b.read() == (await full(store, "p"))[:6]
    await b.append("assistant/message", {"content": "child"})
    await parent.append("user/message", {"content": "parent only"})
    assert [e.data["content"] for e in await full(store, b.id)] == [*(f"m{i}" for i in range(6)), "child"]
    assert len(await full(store, "p")) == 11
    assert [m.text for m in await b.messages()][-2:] == ["m5", "child"]
    explicit = await sessions.branch("p", 0, branch_id="p-zero", delegation_depth=5)
    assert (explicit.id, explicit.n, explicit.header.delegation_depth) == ("p-zero", 0, 5)
    at_end = await parent.branch(parent.n)
    assert at_end.n == 11 and await at_end.read() == await full(store, "p")
    kids = {h.id for h in (await sessions.list(parent="p")).items}
    assert kids == {b.id, "p-zero", at_end.id}


async def test_branch_point_and_parent_are_checked(store: Any) -> None:
    sessions = Sessions(store)
    p = await sessions.create("p")
    await p.append_many([um("a"), um("b")])
    before = await all_ids(sessions)
    with pytest.raises(InvalidEntryError, match="beyond"):
        await sessions.branch("p", 3)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError):
            await sessions.branch("p", bad)  # type: ignore[arg-type]
    with pytest.raises(SessionNotFoundError):
        await sessions.branch("ghost", 0)
    await sessions.branch("p", 1, branch_id="taken")
    with pytest.raises(SessionAlreadyExistsError):
        await sessions.branch("p", 2, branch_id="taken")
    assert await all_ids(sessions) == before | {"taken"}
    assert (await full(store, "taken"))[0].data["content"] == "a" and (await store.head("taken")).n == 1


async def test_a_default_branch_id_that_is_too_long_asks_for_one(store: Any) -> None:
    sessions = Sessions(store)
    long_id = "x" * 250
    await sessions.create(long_id)
    with pytest.raises(InvalidSessionIdError, match="branch_id"):
        await sessions.branch(long_id, 0)
    assert (await sessions.list(parent=long_id)).items == []
    b = await sessions.branch(long_id, 0, branch_id="short")
    assert b.header.parent == long_id


async def test_branch_of_a_branch_reads_back_like_a_copy(store: Any) -> None:
    sessions = Sessions(store)
    p = await sessions.create("root")
    await p.append_many([um(f"p{i}") if i % 3 else am(f"p{i}") for i in range(10)])
    await p.compact(4, [{"role": "user", "content": "root summary"}], "manual")  # n=10
    await p.append_many([um("p11"), am("p12")])
    b1 = await sessions.branch("root", 11, branch_id="b1")
    await b1.append_many([um(f"b1-{i}") for i in range(4)])  # 11..14
    b2 = await b1.branch(13, branch_id="b2")
    await b2.append_many([am(f"b2-{i}") for i in range(3)])  # 13..15
    b3 = await b2.branch(16, branch_id="b3")
    await b3.append("user/message", {"content": "b3"})
    # the reference: plain copies of what each branch saw
    ref_root = await full(store, "root")
    ref_b1 = ref_root[:11] + (await store.read("b1", 11, 15))
    ref_b2 = ref_b1[:13] + (await store.read("b2", 13, 16))
    ref_b3 = ref_b2[:16] + (await store.read("b3", 16, 17))
    assert [e.n for e in ref_b3] == list(range(17))
    for sid, ref in (("b1", ref_b1), ("b2", ref_b2), ("b3", ref_b3)):
        assert await full(store, sid) == ref
        assert [e.n for e in await store.read(sid, 9, 14)] == [e.n for e in ref[9:14]]
        assert await (await sessions.open(sid)).messages() == project(ref)
        assert await sessions.messages(sid) == project(ref)
    assert [m.text for m in project(ref_b3)][:2] == ["root summary", "p4"]
    # deleting ancestors never breaks a descendant
    for sid in ("root", "b1"):
        assert await sessions.delete(sid)
        assert await sessions.head(sid) is None
        assert await full(store, "b3") == ref_b3 and await full(store, "b2") == ref_b2
    assert await (await sessions.open("b3")).messages() == project(ref_b3)
    await sessions.delete("b2")
    await sessions.delete("b3")
    assert await all_ids(sessions) == set()


async def test_branch_copies_nothing_on_redis(redis_store: Any, raw_redis: Any, prefix: str) -> None:
    sessions = Sessions(redis_store)
    p = await sessions.create("big")
    for k in range(3):
        await p.append_many([um(f"m{i}") for i in range(k * 1000, (k + 1) * 1000)])
    b = await sessions.branch("big", 2500, branch_id="big-b")
    assert await raw_redis.exists(f"{prefix}:{{big-b}}:log") == 0
    assert await raw_redis.hget(f"{prefix}:{{big-b}}:hdr", "n") == "2500"
    await b.append("user/message", {"content": "own"})
    assert await raw_redis.xlen(f"{prefix}:{{big-b}}:log") == 1
    assert [e.n for e in await b.read(2498)] == [2498, 2499, 2500]


async def test_branch_and_open_are_lazy(store: Any) -> None:
    reads: list[Any] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        async def read(self, *args: Any) -> Any:
            reads.append(args)
            return await store.read(*args)

    sessions = Sessions(Spy())  # type: ignore[arg-type]
    p = await sessions.create("lazy")
    await p.append_many([um(str(i)) for i in range(50)])
    b = await sessions.branch("lazy", 40)
    bb = await b.branch(20)
    assert reads == [] and (b.n, bb.n) == (40, 20)


async def test_branch_publishes_an_event_not_an_entry(
    store: Any, redis_url: str, prefix: str, request: pytest.FixtureRequest
) -> None:
    sessions = Sessions(store)
    p = await sessions.create("pub")
    await p.append_many([um("a"), um("b")])
    got: list[dict[str, Any]] = []
    if hasattr(store, "events"):  # the memory store records what it publishes
        b = await sessions.branch("pub", 1, branch_id="pub-b")
        got = [{"event": ev, **payload} for ev, payload in store.events]
    else:
        import redis.asyncio as aioredis

        # cluster PUBLISH reaches every node, so one node's connection hears it
        url = request.getfixturevalue("cluster_url") if store.cluster else redis_url
        sub = aioredis.Redis.from_url(url).pubsub()
        await sub.subscribe(f"{prefix}:events")
        try:
            b = await sessions.branch("pub", 1, branch_id="pub-b")
            with anyio.fail_after(60):
                while not got:
                    msg = await sub.get_message(ignore_subscribe_messages=True, timeout=1)
                    if msg is not None:
                        got.append(json.loads(msg["data"]))
        finally:
            await sub.aclose()
    assert got == [{"event": "session-branch", "parent": "pub", "session": "pub-b", "at": 1}]
    assert (await store.head("pub")).n == 2 and (await store.head("pub-b")).n == 1
    assert b.id == "pub-b"


# --------------------------------------------------------------------------- fork (dsh)


async def dsh_session(sessions: Sessions, sid: str, turns: int = 2) -> Session:
    s = await sessions.create(sid, delegation_depth=1)
    for k in range(1, turns + 1):
        await s.append_many(turn(k, f"q{k}", f"a{k}"))
    return s


async def test_fork_at_the_last_turn_end_by_default(store: Any) -> None:
    sessions = Sessions(store)
    src = await dsh_session(sessions, "src")
    child = await sessions.fork("src")
    assert child.header.parent == "src" and child.header.at == src.n == child.n
    assert child.header.delegation_depth == 1
    assert await child.read() == await full(store, "src")
    assert await child.check_invariants() == []
    named = await src.fork(fork_id="named")
    assert named.id == "named" and named.n == 12


async def test_fork_at_an_earlier_boundary_despite_an_open_turn(store: Any) -> None:
    sessions = Sessions(store)
    src = await dsh_session(sessions, "src")
    await src.append_many([("turn/start", {"turn": 3}), um("q3")])  # open turn after the boundary
    child = await sessions.fork("src", 5, fork_id="early")
    assert child.n == 6 and [m.text for m in await child.messages()] == ["q1", "a1"]
    assert await child.check_invariants() == []
    assert (await store.head("src")).n == 14  # the source is untouched


@pytest.mark.parametrize(
    "reason", ["completed", "aborted", "error", "disposed", "max-tokens", "rejected", "interrupted"]
)
async def test_every_turn_end_reason_is_a_boundary(store: Any, reason: str) -> None:
    sessions = Sessions(store)
    s = await sessions.create("r")
    await s.append_many(turn(1, "q", "a", reason))
    assert (await sessions.fork("r")).n == 6


async def test_fork_of_an_empty_source_is_an_empty_child(store: Any) -> None:
    sessions = Sessions(store)
    await sessions.create("empty")
    child = await sessions.fork("empty", fork_id="empty-child")
    assert (child.n, child.header.parent, child.header.at) == (0, "empty", 0)


async def _assert_fork_error(
    sessions: Sessions,
    code: str,
    source: str,
    boundary: Any = None,
    fork_id: str | None = None,
    match: str | None = None,
) -> None:
    before = await all_ids(sessions)
    with pytest.raises(SessionForkError, match=match) as ei:
        await sessions.fork(source, boundary, fork_id=fork_id)
    assert ei.value.code == code
    assert await all_ids(sessions) == before  # no child created


async def test_fork_error_codes_create_nothing(store: Any) -> None:
    sessions = Sessions(store)
    await dsh_session(sessions, "src")  # 12 entries, turn/end at 5 and 11
    await sessions.create("empty")
    bad = _assert_fork_error
    await bad(sessions, "INVALID_BOUNDARY", "empty", 0, match="last seq: none")
    for boundary in (-1, 1.5, 5.0, True, False, "5", 12, 13, 2**53):
        await bad(sessions, "INVALID_BOUNDARY", "src", boundary, match="last seq: 11")
    await bad(sessions, "OPEN_TURN", "src", 4, match="must be turn/end, got step/end")
    await bad(sessions, "OPEN_TURN", "src", 0, match="must be turn/end, got turn/start")
    await bad(sessions, "SESSION_NOT_FOUND", "ghost")
    await bad(sessions, "SESSION_NOT_FOUND", "ghost", 3)
    await sessions.create("taken")
    # SESSION_ALREADY_EXISTS is checked before the boundary
    await bad(sessions, "SESSION_ALREADY_EXISTS", "src", 4, fork_id="taken")
    await bad(sessions, "SESSION_ALREADY_EXISTS", "src", -7, fork_id="taken")
    await bad(sessions, "SESSION_ALREADY_EXISTS", "src", fork_id="src")
    open_turn = await sessions.create("open")
    await open_turn.append_many([("turn/start", {"turn": 1}), um("q")])
    await bad(sessions, "OPEN_TURN", "open", match="must be turn/end, got user/message")
    assert (await sessions.list(parent="src")).items == []


async def test_fork_onto_a_tombstoned_id_is_already_exists(store: Any) -> None:
    sessions = Sessions(store)
    await dsh_session(sessions, "src", turns=1)
    await sessions.create("old")
    await sessions.branch("old", 0, branch_id="old-kid")
    await sessions.delete("old")  # hidden, but its id is held while "old-kid" lives
    await _assert_fork_error(sessions, "SESSION_ALREADY_EXISTS", "src", fork_id="old")


# --------------------------------------------------------------------------- fork before a user message (nanobot)


async def nanobot_session(sessions: Sessions) -> Session:
    s = await sessions.create("nb")
    await s.append_many(
        [
            NewEntry("message", {"role": "user", "content": "r1"}),
            NewEntry("message", {"role": "assistant", "content": "a1"}),
            ("preset/selected", {"presetId": "x"}),
            um("r2"),  # dsh-style user input counts too
            NewEntry("message", {"role": "assistant", "content": "a2"}),
            NewEntry("message", {"role": "user", "content": "r3"}),
        ]
    )
    return s


async def test_fork_before_user_message(store: Any) -> None:
    sessions = Sessions(store)
    src = await nanobot_session(sessions)
    source_log = await full(store, "nb")
    child = await sessions.fork_before_user("nb", 1, fork_id="nb-1")
    assert child is not None and child.n == 3
    assert [m.text for m in await child.messages()] == ["r1", "a1"]
    k0 = await sessions.fork_before_user("nb", 0)
    assert k0 is not None and k0.n == 0 and k0.header.parent == "nb"
    k2 = await sessions.fork_before_user("nb", 2)
    assert k2 is not None and [m.text for m in await k2.messages()] == ["r1", "a1", "r2", "a2"]
    every = await sessions.fork_before_user("nb", 3)  # k may equal the number of user messages
    assert every is not None and await every.read() == source_log
    assert await full(store, "nb") == source_log and src.n == 6


async def test_fork_before_user_refusals_create_nothing(store: Any) -> None:
    sessions = Sessions(store)
    await nanobot_session(sessions)
    before = await all_ids(sessions)
    for k in (-1, 4, 100, 1.0, True, None):
        assert await sessions.fork_before_user("nb", k) is None  # type: ignore[arg-type]
    assert await sessions.fork_before_user("ghost", 0) is None
    assert await all_ids(sessions) == before
    with pytest.raises(SessionAlreadyExistsError):
        await sessions.fork_before_user("nb", 1, fork_id="nb")
    assert await all_ids(sessions) == before


# ------------------------------------------------------------------- a branch cut short (its two steps interrupted)


async def test_ephemeral_parent_is_kept_for_its_branches_then_expires(store: Any) -> None:
    from redis_session import SessionHeader

    # a ttl long enough for the branch to be made, and the parent looked at after its last branch
    # went, on a slow machine
    await store.create(SessionHeader(id="p"), [um("a"), um("b")], ttl_ms=1500)
    await store.create(SessionHeader(id="c", parent="p", at=2))
    await let_pass(store, 1.7)
    assert [e.data["content"] for e in await store.read("c")] == ["a", "b"]
    assert await store.head("p") is not None  # a parent with a live branch does not expire
    assert await store.delete("c") is True
    assert await store.head("p") is not None  # its clock restarts when its last branch goes
    await let_pass(store, 1.7)
    assert await store.head("p") is None


def _redis_only(store: Any) -> None:
    from redis_session import RedisSessionStore

    if not isinstance(store, RedisSessionStore):
        pytest.skip("the two steps of a branch (link, create) exist on Redis only")


async def _parent_keys(store: Any, pid: str) -> int:
    keys = [*store.keys.session_keys(pid), f"{store.prefix}:{{{pid}}}:plock"]
    return int(await store.client.execute_command("EXISTS", *keys))


async def _pttl(store: Any, pid: str) -> int:
    return int(await store.client.execute_command("PTTL", store.keys.hdr(pid)))


@pytest.mark.parametrize("point", ["during-link", "after-link", "before-create", "after-create"])
@pytest.mark.parametrize("ephemeral", [False, True])
async def test_branch_cancelled_between_link_and_create_leaks_nothing(store: Any, point: str, ephemeral: bool) -> None:
    """Cancellation injected at each await of a branch's two steps (link.lua in the parent's slot,
    append.lua's create in the child's): the clean-up runs shielded, so the parent keeps no stale
    link, an ephemeral parent gets its TTL back, and deleting it leaves no key."""
    from redis_session import SessionHeader

    _redis_only(store)
    await store.create(SessionHeader(id="p"), [um("a")], ttl_ms=60_000 if ephemeral else None)
    orig = store._eval_packed
    fired = False

    with anyio.CancelScope() as scope:

        async def cancelling(script: Any, count: int, body: bytes, route: Any, durable: bool = False) -> Any:
            nonlocal fired
            create = script.name == "append" and b"$6\r\ncreate\r\n" in body
            here = (script.name == "link" and point.endswith("link")) or (create and point.endswith("create"))
            if fired or not here:
                return await orig(script, count, body, route, durable)
            fired = True
            if point in ("during-link", "after-create"):  # the script runs; its reply is lost
                res = await orig(script, count, body, route, durable)
                scope.cancel()
                await anyio.lowlevel.checkpoint()
                return res
            scope.cancel()
            await anyio.lowlevel.checkpoint()
            return await orig(script, count, body, route, durable)

        store._eval_packed = cancelling
        await store.create(SessionHeader(id="c", parent="p", at=1))
    store._eval_packed = orig
    assert fired and scope.cancelled_caught
    live, stale = await store.links("p")
    assert stale == []
    if point == "after-create":  # the child landed: it is a whole branch (linked and listed)
        assert live == ["c"] and [h.id for h in (await store.list(parent="p")).items] == ["c"]
        assert [e.n for e in await store.read("c")] == [0]
        await store.delete("c")
    else:
        assert live == [] and await store.head("c") is None
    if ephemeral:
        assert await _pttl(store, "p") > 0
    assert await store.delete("p") is True
    assert await _parent_keys(store, "p") == 0
    await store.create(SessionHeader(id="p"))


async def _crash_link(store: Any, parent: str, child: str, at: int = 1) -> None:
    """What a process that dies between a branch's two steps leaves: link.lua ran, create never did."""
    from redis_session.keys import index_member
    from redis_session.model import now_ms

    k = store.keys
    res = await store._eval(
        "link",
        [k.hdr(parent), k.kids(parent), k.log(parent), k.idem(parent), k.proj(parent), k.draft(parent)],
        [at, index_member(now_ms(), child)],
    )
    assert int(res[0]) == 0


async def test_crash_between_link_and_create_is_repaired_by_delete(store: Any) -> None:
    from redis_session import SessionHeader

    _redis_only(store)
    await store.create(SessionHeader(id="p"), [um("a")])
    await store.create(SessionHeader(id="live", parent="p", at=1))
    await _crash_link(store, "p", "p:branch:dead")
    assert await store.links("p") == (["live"], ["p:branch:dead"])
    assert await store.delete("p") is True  # hidden for its live branch, not for the dead link
    assert await store.links("p") == (["live"], [])
    assert await store.delete("live") is True
    assert await _parent_keys(store, "p") == 0
    # a hidden parent that only a stale link kept (left by a crash before this repair existed)
    await store.create(SessionHeader(id="q"), [um("a")])
    await store.create(SessionHeader(id="q:b", parent="q", at=1))
    await _crash_link(store, "q", "q:branch:dead")
    assert await store.delete("q") is True
    await store.client.execute_command("ZADD", store.keys.kids("q"), 0, "9999999999999:q:branch:old")
    assert await store.delete("q:b") is True
    assert await _parent_keys(store, "q") == 0
    await store.create(SessionHeader(id="q"))
    await store.create(SessionHeader(id="p"))


async def test_crash_link_on_ephemeral_parent_doctor_reports_and_repair_removes(store: Any) -> None:
    from redis_session import SessionHeader
    from redis_session.sessions import Sessions, doctor

    _redis_only(store)
    await store.create(SessionHeader(id="p"), [um("a")], ttl_ms=60_000)
    await _crash_link(store, "p", "p:branch:dead")
    assert await _pttl(store, "p") == -1  # the dead link holds it forever
    report = await doctor(store, "p")
    assert [p.code for p in report.problems] == ["stale-link"] and "p:branch:dead" in report.problems[0].message
    assert await Sessions(store).repair("p") == []
    assert await store.links("p") == ([], [])
    assert await _pttl(store, "p") > 0
    assert (await doctor(store, "p")).ok
    # the next branch of an ephemeral parent repairs too
    await _crash_link(store, "p", "p:branch:dead2")
    b = await Sessions(store).branch("p", 1)
    assert await store.links("p") == ([b.id], [])
    await store.delete(b.id)
    assert await _pttl(store, "p") > 0


async def test_repair_racing_a_branch_keeps_its_link(store: Any) -> None:
    """A repair that runs between a branch's link and create takes the in-flight link for stale;
    the branch's check after its create links it again, so deleting the parent keeps its entries."""
    from redis_session import SessionHeader

    _redis_only(store)
    await store.create(SessionHeader(id="p"), [um("a"), um("b")])
    orig = store._eval_packed
    raced: list[str] = []

    async def racing(script: Any, count: int, body: bytes, route: Any, durable: bool = False) -> Any:
        if script.name == "append" and b"$6\r\ncreate\r\n" in body and not raced:
            raced.extend(await store.repair_links("p"))
        return await orig(script, count, body, route, durable)

    store._eval_packed = racing
    await store.create(SessionHeader(id="c", parent="p", at=2))
    store._eval_packed = orig
    assert raced == ["c"]
    assert await store.links("p") == (["c"], [])
    assert await store.delete("p") is True
    assert await store.head("p") is None
    assert [e.data["content"] for e in await store.read("c")] == ["a", "b"]


async def test_a_branch_deleted_while_its_prefix_is_read(redis_store: Any) -> None:
    """A branch read between its header and its parent's prefix: the branch deleted in between
    (its hidden parent's log goes with its last branch) answers `SessionNotFoundError`, as a read
    of a deleted session does, never a log without its prefix or a corruption error."""
    sessions = Sessions(redis_store)
    parent = await sessions.create("p")
    await parent.append_many([um(f"m{i}") for i in range(10)])
    b = await sessions.branch("p", 6, branch_id="b")
    await b.append("assistant/message", {"content": "child"})
    await redis_store.delete("p")  # hidden: the branch still reads its prefix
    assert len(await redis_store.read("b")) == 7
    own_range = redis_store._own_range

    async def deleted_first(session_id: str, lo: int, hi: int, _depth: int = 0) -> list[Entry]:
        assert await redis_store.delete("b")  # its parent's log with it
        return await own_range(session_id, lo, hi, _depth)

    redis_store._own_range = deleted_first
    try:
        with pytest.raises(SessionNotFoundError):
            await redis_store.read("b")
    finally:
        del redis_store._own_range


async def test_the_doctor_does_not_take_a_branch_between_its_steps_for_a_stale_link(redis_store: Any) -> None:
    """A branch is linked in its parent, then created: the doctor of the parent run in between
    finds no stale link (the link is looked at again after a grace); a link whose branch never
    comes is reported."""
    from redis_session import SessionHeader
    from redis_session.doctor import STALE_LINK_GRACE, doctor

    await redis_store.create(SessionHeader(id="p"), [um("a")])
    orig = redis_store._eval_packed
    linked = anyio.Event()

    async def slow_create(script: Any, count: int, body: bytes, route: Any, durable: bool = False) -> Any:
        if script.name == "append" and b"$6\r\ncreate\r\n" in body:
            linked.set()
            await anyio.sleep(STALE_LINK_GRACE / 3)  # the doctor runs now, the link without its branch
        return await orig(script, count, body, route, durable)

    redis_store._eval_packed = slow_create
    reports = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(Sessions(redis_store).branch, "p", 1, branch_id="p-child"))
            await linked.wait()
            reports.append(await doctor(redis_store, "p"))
    finally:
        del redis_store._eval_packed
    assert reports[0].ok, reports[0].problems
    assert (await redis_store.head("p-child")) is not None
    # a link whose branch never comes: reported, once the grace is over
    member = (await redis_store.client.zrange(redis_store.keys.kids("p"), 0, -1))[0]
    ghost = member.replace(b"p-child", b"p-ghost")
    await redis_store.client.zadd(redis_store.keys.kids("p"), {ghost: 0})
    assert [p.code for p in (await doctor(redis_store, "p")).problems] == ["stale-link"]
