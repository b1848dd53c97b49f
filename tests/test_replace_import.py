"""`import --on-exists replace`: the staging copy and the swap.

A replace builds the new session under a staging id and swaps it in. The staging copy is never
listed and expires by itself (a killed import leaks nothing); the swap makes it lasting. Replacing
a branch unlinks it from its parent, as its delete would, so a hidden parent whose last branch it
was is purged and its id can be used again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from redis_session import MemorySessionStore, RedisSessionStore, Sessions
from redis_session.doctor import doctor
from redis_session.importers import import_path
from redis_session.importers.common import staging_id
from redis_session.keys import STAGING_TTL_MS, is_staging_id
from redis_session.model import NewEntry, SessionHeader

pytestmark = pytest.mark.anyio


def tutorial_file(path: Path, sid: str, n: int, size: int = 10) -> Path:
    with path.open("w") as f:
        f.write(json.dumps({"type": "session/meta", "id": sid}, separators=(",", ":")) + "\n")
        for i in range(n):
            t = "user/message" if i % 2 == 0 else "assistant/message"
            row = {"type": t, "seq": i, "ts": 1796098545.0 + i, "content": f"NEW{i} " + "x" * size}
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return path


async def make_old(sessions: Sessions, sid: str, n: int = 10) -> None:
    s = await sessions.open(sid)
    for i in range(n):
        await s.append("user/message" if i % 2 == 0 else "assistant/message", {"content": f"OLD{i}"})


async def all_ids(store: Any) -> list[str]:
    return sorted(h.id for h in (await store.list(limit=1000)).items)


def test_staging_ids_are_recognised() -> None:
    staged = staging_id("rep", "0123456789abcdef0123")
    assert is_staging_id(staged) and staged.startswith("rep.import-0123456789abcdef.")
    assert not is_staging_id("rep") and not is_staging_id("rep.import-xyz.1")


async def test_staging_copy_is_unlisted_and_expiring_until_the_swap(redis_url: str, prefix: str) -> None:
    """The copy an import builds is not listed and its keys carry a TTL; the swap clears it."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    r = aioredis.Redis.from_url(redis_url)
    try:
        await make_old(Sessions(store), "rep")
        staged = staging_id("rep", "ab" * 10)
        first = [NewEntry("user/message", {"content": "a"})]
        await store.create(SessionHeader(id=staged), first, ttl_ms=STAGING_TTL_MS)
        await store.put(staged, 1, [NewEntry("assistant/message", {"content": "b"})], idempotency_key="k")
        assert await all_ids(store) == ["rep"]
        for part in ("hdr", "log", "idem"):
            assert 0 < await r.pttl(f"{prefix}:{{{staged}}}:{part}") <= STAGING_TTL_MS
        old = await store.head("rep")
        assert old is not None
        await store.swap_session("rep", staged, incarnation=old.header.incarnation)
        assert await all_ids(store) == ["rep"]
        assert [e.data["content"] for e in await store.read("rep")] == ["a", "b"]
        for part in ("hdr", "log", "idem"):
            assert await r.pttl(f"{prefix}:{{rep}}:{part}") == -1
        assert await r.hget(f"{prefix}:{{rep}}:hdr", "ttl_ms") is None
        assert not await r.keys(f"{prefix}:{{{staged}}}:*")
    finally:
        await r.aclose()
        await store.aclose()


async def test_killed_replace_leaves_nothing_listed_and_its_staging_copy_expires(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """SIGKILL part-way through `redis-session import --on-exists replace`: the old session is
    as it was, list() never showed the staging copy (during or after), and what is left of it
    carries a TTL (so it goes by itself); doctor names it and --repair deletes it."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    r = aioredis.Redis.from_url(redis_url)
    try:
        await make_old(Sessions(store), "rep")
        before = [e.data for e in await store.read("rep")]
        path = tutorial_file(tmp_path / "big.jsonl", "rep", 1500, size=10_000)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), *sys.path]))
        cmd = [sys.executable, "-m", "redis_session.cli", "import", str(path), "--on-exists", "replace"]
        argv = [*cmd, "--url", redis_url, "--prefix", prefix]
        proc = await anyio.open_process(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen: list[list[str]] = []
        hdr: bytes | None = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.returncode is None:
            ks = await r.keys(f"{prefix}:{{rep.import-*}}:hdr")
            seen.append(await all_ids(store))
            if ks and int(await r.hget(ks[0], "n") or 0) > 0:
                hdr = ks[0]
                break
            await anyio.sleep(0.005)
        assert hdr is not None, "the import never began its staging copy"
        seen.append(await all_ids(store))
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        assert all(ids == ["rep"] for ids in seen)
        assert await all_ids(store) == ["rep"]
        assert [e.data for e in await store.read("rep")] == before
        left = await r.keys(f"{prefix}:{{rep.import-*}}:*")
        assert left
        for k in left:
            assert 0 < await r.pttl(k) <= STAGING_TTL_MS
        staged = hdr.decode().split("{", 1)[1].split("}", 1)[0]
        report = await doctor(store, staged)
        assert [p.code for p in report.problems] == ["staging-copy"]
        repair = ["doctor", staged, "--repair", "--url", redis_url, "--prefix", prefix]
        done = await anyio.run_process([sys.executable, "-m", "redis_session.cli", *repair], env=env, check=False)
        assert b"removed the staging copy" in done.stdout, done.stdout + done.stderr
        assert not await r.keys(f"{prefix}:{{rep.import-*}}:*")
        assert [e.data for e in await store.read("rep")] == before
    finally:
        await r.aclose()
        await store.aclose()


async def test_memory_staging_copy_is_unlisted_and_lasting_after_the_swap(tmp_path: Path) -> None:
    store = MemorySessionStore()
    await make_old(Sessions(store), "rep")
    staged = staging_id("rep", "cd" * 10)
    await store.create(SessionHeader(id=staged), [NewEntry("user/message", {"content": "a"})], ttl_ms=STAGING_TTL_MS)
    assert await all_ids(store) == ["rep"]
    old = await store.head("rep")
    assert old is not None
    await store.swap_session("rep", staged, incarnation=old.header.incarnation)
    s = store._sessions["rep"]
    assert s.ttl_ms is None and s.expires_at is None
    assert await all_ids(store) == ["rep"]


async def test_replacing_a_branch_unlinks_it_from_its_parent(store: Any, tmp_path: Path) -> None:
    """A branch replaced by a root session is no longer its parent's kid: doctor finds nothing."""
    sessions = Sessions(store)
    await make_old(sessions, "rep")
    c = await sessions.branch("rep", at=2)
    path = tutorial_file(tmp_path / "a.jsonl", "rep", 20)
    [res] = await import_path(store, path, format="tutorial", session_id=c.id, on_exists="replace")
    assert res.status == "replaced"
    head = await store.head(c.id)
    assert head is not None and head.header.parent is None and head.n == 20
    assert await store.links("rep") == ([], [])
    assert (await doctor(store, "rep")).ok
    assert (await doctor(store, c.id)).ok
    # the parent lives on, and can be deleted as a session without branches
    assert len(await store.read("rep")) == 10
    assert await store.delete("rep")
    assert await store.head("rep") is None


async def test_replacing_the_last_branch_of_a_deleted_parent_purges_the_parent(store: Any, tmp_path: Path) -> None:
    """As the delete of that branch would: the hidden parent goes, and its id is free again."""
    sessions = Sessions(store)
    await make_old(sessions, "rep")
    c = await sessions.branch("rep", at=2)
    await store.delete("rep")
    assert await store.head("rep") is None
    path = tutorial_file(tmp_path / "a.jsonl", "rep", 20)
    [res] = await import_path(store, path, format="tutorial", session_id=c.id, on_exists="replace")
    assert res.status == "replaced"
    assert await store.links("rep") == ([], [])
    if isinstance(store, RedisSessionStore):
        r = store.client
        left = [k async for k in r.scan_iter(match=f"{store.keys.prefix}:{{rep}}:*")] if not store.cluster else []
        assert left == []
    again = await sessions.open("rep")
    assert again.n == 0
    assert [e.data["content"] for e in await store.read(c.id)][:2] == ["NEW0 " + "x" * 10, "NEW1 " + "x" * 10]


async def test_replace_of_a_branch_keeps_sibling_links(store: Any, tmp_path: Path) -> None:
    """Only the replaced branch's link goes; a deleted parent with another live branch stays hidden."""
    sessions = Sessions(store)
    await make_old(sessions, "rep")
    c1 = await sessions.branch("rep", at=2)
    c2 = await sessions.branch("rep", at=3)
    await store.delete("rep")
    path = tutorial_file(tmp_path / "a.jsonl", "rep", 5)
    await import_path(store, path, format="tutorial", session_id=c1.id, on_exists="replace")
    live, stale = await store.links("rep")
    assert (live, stale) == ([c2.id], [])
    assert [e.data["content"] for e in await store.read(c2.id)][:3] == ["OLD0", "OLD1", "OLD2"]
    assert (await doctor(store, c2.id)).ok


async def test_create_of_a_deleted_parent_id_names_the_branches_that_hold_it(store: Any) -> None:
    """A deleted session with live branches keeps its id (they read its entries): a create or an
    open of the id says so, naming them, instead of a bare "already exists" for an id whose head
    is None. The last branch gone frees the id."""
    from redis_session import SessionAlreadyExistsError

    sessions = Sessions(store)
    await make_old(sessions, "hid", 3)
    b = await sessions.branch("hid", at=1)
    await store.delete("hid")
    assert await store.head("hid") is None
    for attempt in (lambda: sessions.open("hid"), lambda: store.create(SessionHeader(id="hid"))):
        with pytest.raises(SessionAlreadyExistsError, match="was deleted, but its branches") as info:
            await attempt()
        assert repr(b.id) in str(info.value)
    assert [e.data["content"] for e in await store.read(b.id)] == ["OLD0"]
    await store.delete(b.id)
    assert (await sessions.open("hid")).n == 0
