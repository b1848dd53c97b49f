"""The cold tier's promises (docs/design.md §9) where it once failed them, one regression test
each: objects namespaced by the store prefix, the URL recorded by every archiving path, a
sweep that never takes a pending upload whatever the graces, few merged segments under ``keep``,
segments deleted with a purged parent and with a replaced life, counters for one-pass runs."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_cli import cli

from redis_session import MemorySessionStore, NewEntry, RedisSessionStore, SessionHeader
from redis_session.archiver import Archiver, Policy, status
from redis_session.cold import ColdTier
from redis_session.importers import export_session, import_path

from support import cleanup_prefix

pytestmark = pytest.mark.anyio


def um(i: int, tag: str = "m") -> NewEntry:
    return NewEntry("user/message", {"content": f"{tag}{i}"})


def enc(entries: Any) -> bytes:
    return msgspec.json.encode(list(entries))


async def objects(tier: ColdTier, under: str = "") -> list[str]:
    return [o.key async for o in tier.objects.list(under) if o.key.endswith(".jsonl.zst")]  # segments


@pytest.fixture(params=["memory", "redis"])
async def astore(request: pytest.FixtureRequest, redis_url: str, prefix: str, tmp_path: Path) -> AsyncIterator[Any]:
    tier = ColdTier(str(tmp_path / "cold"))  # no prefix: the store's
    if request.param == "memory":
        yield MemorySessionStore(cold=tier)
        return
    s = RedisSessionStore.from_url(redis_url, prefix=prefix, cold=tier)
    try:
        yield s
    finally:
        await s.aclose()
        await cleanup_prefix(redis_url, prefix)


# ---------------------------------------------------------------- 1. one prefix, one namespace


async def test_a_sweep_from_one_prefix_spares_another_prefixs_segments(redis_url: str, tmp_path: Path) -> None:
    folder = str(tmp_path / "shared")
    pa, pb = f"ta{time.monotonic_ns()}", f"tb{time.monotonic_ns()}"
    a = RedisSessionStore.from_url(redis_url, prefix=pa, cold=ColdTier(folder))
    b = RedisSessionStore.from_url(redis_url, prefix=pb, cold=ColdTier(folder))
    try:
        await b.create(SessionHeader(id="p"), [um(i) for i in range(20)])
        hot = enc(await b.read("p"))
        assert (await Archiver(b).archive("p", upto=15)).status == "archived"
        assert b.cold is not None and all(k.startswith(f"{pb}/") for k in await objects(b.cold))
        # A has no session "p": its sweep (grace long past) must not even see B's objects
        assert await Archiver(a).sweep(now=int(time.time() * 1000) + 2 * 3_600_000) == []
        b.cold.clear_cache()
        assert enc(await b.read("p")) == hot
        # one tier object is never shared by two prefixes (its sweep would see both)
        shared = ColdTier(folder)
        RedisSessionStore.from_url(redis_url, prefix=pa, cold=shared)
        with pytest.raises(ValueError, match="give each store prefix its own ColdTier"):
            RedisSessionStore.from_url(redis_url, prefix=pb, cold=shared)
        with pytest.raises(ValueError, match="not the store's"):
            Archiver(b, shared)
    finally:
        await a.aclose()
        await b.aclose()
        await cleanup_prefix(redis_url, pa)
        await cleanup_prefix(redis_url, pb)


# ---------------------------------------------------------------- 2. the URL, recorded and checked


async def test_a_python_api_archive_records_the_url_and_refuses_another(
    redis_store: RedisSessionStore, redis_url: str, tmp_path: Path
) -> None:
    p = redis_store.prefix
    await redis_store.create(SessionHeader(id="p"), [um(i) for i in range(20)])
    await redis_store.create(SessionHeader(id="q"), [um(i) for i in range(20)])
    hot = enc(await redis_store.read("p"))
    tier = ColdTier(str(tmp_path / "cold"))
    assert (await Archiver(redis_store, tier).archive("p", upto=15)).status == "archived"
    assert await redis_store._raw("GET", redis_store.keys.cold_url) == tier.url.encode()
    other = RedisSessionStore.from_url(redis_url, prefix=p)  # another process: no cold=
    try:
        assert enc(await other.read("p")) == hot
    finally:
        await other.aclose()
    r = cli("show", "p", url=redis_url, prefix=p)  # the CLI finds it too
    assert r.returncode == 0 and "no cold tier" not in r.stderr, r.stderr
    # another place for the same prefix: refused before anything is uploaded or trimmed
    elsewhere = ColdTier(str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="cold segments live in"):
        await Archiver(redis_store, elsewhere).archive("q", upto=15)
    assert await redis_store._raw("XLEN", redis_store.keys.log("q")) == 20
    assert await objects(elsewhere, "") == []


# ---------------------------------------------------------------- 3. a sweep never takes a pending upload


@pytest.mark.parametrize("sweep_grace_min", [10, 0, 60])
async def test_a_sweep_during_an_upload_leaves_the_hot_copy_or_both(astore: Any, sweep_grace_min: int) -> None:
    await astore.create(SessionHeader(id="p"), [um(i) for i in range(20)])
    hot = enc(await astore.read("p"))
    sweeper = Archiver(astore, grace_ms=sweep_grace_min * 60_000)
    swept: list[str] = []

    async def hook(step: str) -> None:
        if step == "after_upload":  # the archiver is slow (20 min) between its upload and its script
            swept.extend(await sweeper.sweep(now=int(time.time() * 1000) + 20 * 60_000))

    res = await Archiver(astore, hook=hook).archive("p", upto=15)  # its own grace: the default 1 h
    astore.cold.clear_cache()
    assert enc(await astore.read("p")) == hot  # never neither
    if sweep_grace_min < 20:  # the sweep released the stale upload: the script refuses it
        assert swept and res.status == "slow"
        assert await objects(astore.cold) == []
        assert (await Archiver(astore).archive("p", upto=15)).status == "archived"  # a re-run succeeds
    else:  # still in its grace: the pending upload is kept, and commits
        assert swept == [] and res.status == "archived"
    astore.cold.clear_cache()
    assert enc(await astore.read("p")) == hot
    assert await sweeper.sweep(now=int(time.time() * 1000) + 2 * 3_600_000) == []


# ---------------------------------------------------------------- 4. few large segments under keep


async def test_keep_on_every_append_merges_into_one_listpack_segment(
    redis_store: RedisSessionStore, tmp_path: Path
) -> None:
    r = redis_store
    tier = ColdTier(str(tmp_path / "cold"))
    await r.create(SessionHeader(id="c"))
    await r.create(SessionHeader(id="h"))
    a = Archiver(r, tier)
    for i in range(400):  # what `archive --worker --keep 20` does on each change-feed hint
        await r.put("c", i, [um(i)])
        await r.put("h", i, [um(i)])
        await a.archive("c", policy=Policy(keep=20))
    cold = await r._raw("HGET", r.keys.hdr("c"), "cold")
    assert cold.count(b";") == 0  # one segment, 380 entries
    assert await objects(tier) and len(await objects(tier)) == 1  # the merged-away objects are gone
    assert await r._raw("OBJECT", "ENCODING", r.keys.hdr("c")) in (b"listpack", b"ziplist")
    mem = {s: sum([await r._raw("MEMORY", "USAGE", k(s)) for k in (r.keys.hdr, r.keys.log)]) for s in "ch"}
    assert mem["c"] < mem["h"] * 0.25, mem  # most of the session left Redis
    assert tier.stats.segment_reads == 0  # each merge found the last segment in the LRU
    tier.clear_cache()
    got, want = await r.read("c"), await r.read("h")
    assert [(e.n, e.type, e.data) for e in got] == [(e.n, e.type, e.data) for e in want]
    assert tier.stats.segment_reads == 1


async def test_a_merge_lost_to_a_concurrent_archive_keeps_every_entry(astore: Any) -> None:
    await astore.create(SessionHeader(id="s"), [um(i) for i in range(30)])
    a = Archiver(astore)
    assert (await a.archive("s", upto=10)).status == "archived"
    hot = enc(await astore.read("s"))

    async def hook(step: str) -> None:
        if step == "after_upload":  # another archiver merges first
            await Archiver(astore).archive("s", upto=20)

    res = await Archiver(astore, hook=hook).archive("s", upto=15)
    assert res.status == "moved"
    astore.cold.clear_cache()
    assert enc(await astore.read("s")) == hot
    state = await astore.cold_state("s")
    assert [(c.lo, c.hi) for c in state.cold] == [(0, 20)]


# ---------------------------------------------------------------- 5. a purged parent's segments


async def test_a_parent_purged_with_its_last_branch_takes_its_segments(astore: Any) -> None:
    await astore.create(SessionHeader(id="p"), [um(i) for i in range(20)])
    assert (await Archiver(astore).archive("p", upto=20)).status == "archived"
    await astore.create(SessionHeader(id="b", parent="p", at=10), [um(i, "b") for i in range(3)])
    await astore.delete("p")  # hidden: its entries stay readable for b
    astore.cold.clear_cache()
    assert [e.data["content"] for e in await astore.read("b")][:10] == [f"m{i}" for i in range(10)]
    assert len(await objects(astore.cold)) == 1
    await astore.delete("b")  # the last branch: p is purged with it
    assert await objects(astore.cold) == []


# ---------------------------------------------------------------- 6. a replaced life's segments


async def test_import_replace_drops_the_replaced_lifes_segments(astore: Any, tmp_path: Path) -> None:
    await astore.create(SessionHeader(id="q"), [um(i, "old") for i in range(30)])
    old = (await astore.head("q")).header.incarnation
    assert (await Archiver(astore).archive("q", policy=Policy(keep=0))).status == "archived"
    with pytest.raises(ValueError, match="still there"):
        await astore.drop_life_segments("q", old)  # the live life's segments are never dropped
    await astore.create(SessionHeader(id="src"), [um(i, "imp") for i in range(30)])
    exp = tmp_path / "src.jsonl"
    await export_session(astore, "src", str(exp))
    res = await import_path(astore, exp, session_id="q", on_exists="replace")
    assert [r.status for r in res] == ["replaced"]
    assert [e.data["content"] for e in await astore.read("q")] == [f"imp{i}" for i in range(30)]
    assert await objects(astore.cold) == []
    assert await astore.drop_life_segments("q", old) == 0  # idempotent


# ---------------------------------------------------------------- 7. counters for one-pass runs


async def test_one_pass_archives_count_in_status(
    redis_store: RedisSessionStore, redis_url: str, tmp_path: Path
) -> None:
    r, p = redis_store, redis_store.prefix
    await r.create(SessionHeader(id="s"), [um(i) for i in range(5)])
    await r.create(SessionHeader(id="t"), [um(i) for i in range(8)])
    rc = cli("archive", "--to", str(tmp_path / "cold"), "--keep", "0", "--json", url=redis_url, prefix=p)
    assert rc.returncode == 0, rc.stderr
    rc = cli("archive", "--status", "--json", url=redis_url, prefix=p)
    assert rc.returncode == 0, rc.stderr
    counters = json.loads(rc.stdout)["counters"]
    assert counters["sessions"] == 2 and counters["entries"] == 13 and counters["cold_bytes"] > 0
    await r.put("t", 8, [um(8), um(9)])
    assert (await Archiver(r).archive("t")).status == "archived"  # `archive ID` through the API
    got = (await status(r))["counters"]
    assert (got["sessions"], got["entries"]) == (3, 15)


# ---------------------------------------------------------------- doctor: one problem per missing segment


async def test_doctor_reports_a_missing_segment_and_no_false_last_cut(
    redis_store: RedisSessionStore, tmp_path: Path
) -> None:
    from redis_session.sessions import doctor

    r = redis_store
    cut = NewEntry("cut", {"before": 8, "summary": [{"role": "user", "content": "sum"}], "reason": "manual"})
    await r.create(SessionHeader(id="d"), [um(i) for i in range(10)])
    await r.put("d", 10, [cut, *[um(i) for i in range(11, 20)]])
    tier = ColdTier(str(tmp_path / "cold"))
    assert (await Archiver(r, tier).archive("d", upto=15)).status == "archived"  # the cut is archived
    assert {p.code for p in (await doctor(r, "d")).problems} == set()
    for key in await objects(tier):
        await tier.objects.delete(key)
    tier.clear_cache()
    problems = (await doctor(r, "d")).problems
    assert [p.code for p in problems] == ["segment-missing"], problems


class _MergeBeforeFirstGet:
    """A real local folder whose first `get` lets another archiver merge (and delete) the object
    being fetched first: a reader that read the header just before a merge."""

    def __init__(self, root: Path, merge: Any) -> None:
        from redis_session.cold import LocalFolder

        self.inner = LocalFolder(root)
        self.url = self.inner.url
        self.merge = merge
        self.list = self.inner.list
        self.put = self.inner.put
        self.delete = self.inner.delete

    async def get(self, key: str) -> bytes:
        merge, self.merge = self.merge, None
        if merge is not None:
            await merge()
        return await self.inner.get(key)


@pytest.mark.parametrize("reader", ["parent", "branch"])
async def test_a_read_racing_a_merge_reads_the_merged_segment(
    redis_store: RedisSessionStore, redis_url: str, tmp_path: Path, reader: str
) -> None:
    r = redis_store
    folder = tmp_path / "cold"
    r.cold = ColdTier(str(folder)).bind(r.prefix)
    await r.create(SessionHeader(id="p"), [um(i) for i in range(30)])
    await r.create(SessionHeader(id="b", parent="p", at=25), [um(i, "b") for i in range(3)])
    assert (await Archiver(r).archive("p", upto=10)).status == "archived"
    want = enc(await r.read("p" if reader == "parent" else "b"))

    async def merge() -> None:
        res = await Archiver(r).archive("p", upto=20)
        assert (res.status, res.lo, res.hi) == ("archived", 10, 20)

    other = RedisSessionStore.from_url(redis_url, prefix=r.prefix, cold=ColdTier(_MergeBeforeFirstGet(folder, merge)))
    try:
        assert enc(await other.read("p" if reader == "parent" else "b")) == want
        state = await r.cold_state("p")
        assert state is not None and [(c.lo, c.hi) for c in state.cold] == [(0, 20)]
    finally:
        await other.aclose()
