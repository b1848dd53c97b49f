"""The cold tier: archive a prefix of a session into segment objects, read it back transparently,
never lose an entry (crash points, concurrent appends, delete + re-create, two archivers), typed
errors for missing or corrupt segments, doctor, delete and sweep, restore."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest

from redis_session import MemorySessionStore, NewEntry, RedisSessionStore, SessionHeader, Sessions
from redis_session.archiver import Archiver, Policy
from redis_session.cold import ColdTier
from redis_session.errors import SegmentCorruptError, SegmentMissingError, SessionReplacedError
from redis_session.importers import export_session
from redis_session.sessions import doctor

from support import cleanup_prefix

pytestmark = pytest.mark.anyio


def um(i: int) -> NewEntry:
    return NewEntry("user/message", {"content": f"m{i}", "x": [i, 1.5, None]}, meta={"k": i} if i % 3 == 0 else None)


def cut(before: int) -> NewEntry:
    return NewEntry("cut", {"before": before, "summary": [{"role": "user", "content": "sum"}], "reason": "manual"})


@pytest.fixture(params=["memory", "redis"])
async def astore(request: pytest.FixtureRequest, redis_url: str, prefix: str, tmp_path: Path) -> AsyncIterator[Any]:
    tier = ColdTier(str(tmp_path / "cold"), prefix=prefix)
    if request.param == "memory":
        yield MemorySessionStore(cold=tier)
        return
    s = RedisSessionStore.from_url(redis_url, prefix=prefix, cold=tier)
    try:
        yield s
    finally:
        await s.aclose()
        await cleanup_prefix(redis_url, prefix)


async def seeded(store: Any, sid: str = "s1", k: int = 40) -> list[Any]:
    await store.create(SessionHeader(id=sid, title="t"), [um(i) for i in range(k // 2)])
    await store.put(sid, None, [um(i) for i in range(k // 2, k - 1)] + [cut(k - 5)])
    return list(await store.read(sid))


def enc(entries: list[Any]) -> bytes:
    return msgspec.json.encode(entries)


async def objects(store: Any) -> list[str]:
    return [o.key async for o in store.cold.objects.list("") if o.key.endswith(".jsonl.zst")]  # segments


async def test_archived_prefix_reads_back_byte_for_byte(astore: Any) -> None:
    before = await seeded(astore)
    head0 = await astore.head("s1")
    res = await Archiver(astore).archive("s1", upto=30)
    assert (res.status, res.lo, res.hi) == ("archived", 0, 30)
    assert enc(await astore.read("s1")) == enc(before)
    for lo, hi in [(0, 1), (5, 31), (29, 30), (30, 40), (0, None), (35, None), (10, 10)]:
        assert enc(await astore.read("s1", lo, hi)) == enc(before[lo:hi])
    assert await astore.head("s1") == head0
    if isinstance(astore, RedisSessionStore):
        assert await astore._raw("XLEN", astore.keys.log("s1")) == 10
    # every reader: the service, export, doctor, a tail from 0
    sessions = Sessions(astore)
    s = await sessions.open("s1")
    ref = Sessions(MemorySessionStore())
    assert len(await s.messages()) > 0
    assert enc(await s.read()) == enc(before)
    out = io.StringIO()
    assert await export_session(astore, "s1", out) == 40
    assert out.getvalue().count("\n") == 41
    assert (await doctor(astore, "s1")).problems == []
    got = []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            async for e in astore.tail("s1", 0):
                got.append(e)
                if e.n == 40:
                    tg.cancel_scope.cancel()

        tg.start_soon(consume)
        await astore.put("s1", 40, [um(40)])
    assert enc(got[:40]) == enc(before) and got[40].n == 40
    del ref


async def test_append_after_archive_and_archive_again(astore: Any) -> None:
    before = await seeded(astore)
    a = Archiver(astore, merge_below=0)  # no merge: two segments (test_archive_promises merges)
    await a.archive("s1", upto=20)
    more = await astore.put("s1", 40, [um(i) for i in range(40, 50)])
    res = await a.archive("s1", policy=Policy(keep=5))
    assert (res.lo, res.hi) == (20, 45)
    assert enc(await astore.read("s1")) == enc(before + more)
    assert len(await objects(astore)) == 2
    assert (await a.archive("s1", policy=Policy(keep=5))).status == "nothing"


async def test_branch_and_fork_of_an_archived_parent(astore: Any) -> None:
    before = await seeded(astore)
    await Archiver(astore).archive("s1")  # the whole log
    await astore.create(SessionHeader(id="b1", parent="s1", at=25), [um(100)])
    got = await astore.read("b1")
    assert enc(got[:25]) == enc(before[:25]) and got[25].data["content"] == "m100"
    # the branch's own log archived too, and the parent deleted (hidden for its branch)
    await Archiver(astore).archive("b1")
    assert await astore.delete("s1")
    assert enc((await astore.read("b1"))[:25]) == enc(before[:25])
    assert len(await objects(astore)) == 2  # the hidden parent's segment is kept for its branch
    assert await Archiver(astore, grace_ms=0).sweep() == []


async def test_policy_before_last_cut_and_idle(astore: Any) -> None:
    await seeded(astore)
    a = Archiver(astore)
    assert (await a.archive("s1", policy=Policy(idle_ms=60_000))).status == "nothing"  # written just now
    res = await a.archive("s1", policy=Policy(before_last_cut=True))
    assert (res.lo, res.hi) == (0, 35)
    head = await astore.head("s1")
    res = await a.archive("s1", policy=Policy(idle_ms=1), now=head.updated_at + 10)
    assert (res.lo, res.hi) == (35, 40)
    with pytest.raises(ValueError):
        Policy()


async def test_missing_and_corrupt_segments_are_typed_errors_naming_the_range(astore: Any) -> None:
    await seeded(astore)
    await Archiver(astore).archive("s1", upto=30)
    (key,) = await objects(astore)
    path = Path(astore.cold.objects.root) / key
    data = path.read_bytes()
    astore.cold.clear_cache()
    path.write_bytes(data[:-3] + b"xyz")
    with pytest.raises(SegmentCorruptError) as e:
        await astore.read("s1")
    assert (e.value.lo, e.value.hi) == (0, 30) and "[0, 30)" in str(e.value)
    assert (await astore.read("s1", 30)) != []  # the hot tail is still served
    if isinstance(astore, RedisSessionStore):
        codes = {p.code for p in (await doctor(astore, "s1")).problems}
        assert "segment-corrupt" in codes
    path.unlink()
    astore.cold.clear_cache()
    with pytest.raises(SegmentMissingError) as e2:
        await astore.read("s1", 3, 5)
    assert (e2.value.lo, e2.value.hi) == (0, 30)
    if isinstance(astore, RedisSessionStore):
        codes = {p.code for p in (await doctor(astore, "s1")).problems}
        assert "segment-missing" in codes


@pytest.mark.parametrize("step", ["before_upload", "after_upload", "after_script"])
async def test_a_killed_archiver_loses_nothing_and_a_rerun_finishes(astore: Any, step: str) -> None:
    before = await seeded(astore)

    class Killed(BaseException):
        pass

    async def kill(at: str) -> None:
        if at == step:
            raise Killed

    with pytest.raises(Killed):
        await Archiver(astore, hook=kill).archive("s1")
    assert enc(await astore.read("s1")) == enc(before)  # hot copy, or both
    res = await Archiver(astore).archive("s1")
    assert res.status == ("nothing" if step == "after_script" else "archived")
    assert enc(await astore.read("s1")) == enc(before)
    # an upload the crash left unnamed is an orphan: the sweep takes it, and only it
    assert len(await Archiver(astore, grace_ms=0).sweep()) == (1 if step == "after_upload" else 0)
    assert len(await objects(astore)) == 1
    assert enc(await astore.read("s1")) == enc(before)


async def test_a_concurrent_append_is_kept(astore: Any) -> None:
    before = await seeded(astore)
    landed = []

    async def append(at: str) -> None:
        if at == "after_upload":
            landed.extend(await astore.put("s1", None, [um(99)]))

    res = await Archiver(astore, hook=append).archive("s1")
    assert (res.status, res.hi) == ("archived", 40)
    assert enc(await astore.read("s1")) == enc(before + landed)


async def test_delete_and_recreate_during_archive_keeps_the_lives_apart(astore: Any) -> None:
    await seeded(astore)

    async def replace(at: str) -> None:
        if at == "after_upload":
            await astore.delete("s1")
            await astore.create(SessionHeader(id="s1"), [um(1000 + i) for i in range(40)])

    res = await Archiver(astore, hook=replace).archive("s1")
    assert res.status == "replaced"
    new = await astore.read("s1")
    assert [e.data["content"] for e in new] == [f"m{1000 + i}" for i in range(40)]
    # the old life's object is an orphan: swept (after its grace), and the new life archives its own
    assert len(await objects(astore)) == 1
    assert await Archiver(astore, grace_ms=3_600_000).sweep() == []
    assert len(await Archiver(astore, grace_ms=0).sweep()) == 1
    assert (await Archiver(astore).archive("s1")).status == "archived"
    assert [e.data["content"] for e in await astore.read("s1")] == [f"m{1000 + i}" for i in range(40)]


async def test_two_archivers_at_once_commit_once(astore: Any) -> None:
    before = await seeded(astore)
    other: list[Any] = []

    async def race(at: str) -> None:
        if at == "after_upload" and not other:
            other.append(await Archiver(astore).archive("s1", upto=25))

    res = await Archiver(astore, hook=race).archive("s1", upto=30)
    assert other[0].status == "archived" and res.status == "moved"
    assert enc(await astore.read("s1")) == enc(before)
    assert (await Archiver(astore).archive("s1", upto=30)).lo == 25


async def test_delete_removes_segments_and_restore_brings_back_hot(astore: Any) -> None:
    before = await seeded(astore)
    a = Archiver(astore)
    await a.archive("s1", upto=20)
    await a.archive("s1", upto=30)
    assert (await a.restore("s1")).status == "restored"
    assert await objects(astore) == []
    assert enc(await astore.read("s1")) == enc(before)
    if isinstance(astore, RedisSessionStore):
        assert await astore._raw("XLEN", astore.keys.log("s1")) == 40
        assert (await doctor(astore, "s1")).problems == []
    more = await astore.put("s1", 40, [um(40)])
    assert enc(await astore.read("s1")) == enc(before + more)
    await a.archive("s1")
    assert len(await objects(astore)) == 1
    assert await astore.delete("s1")
    assert await objects(astore) == []
    assert (await a.restore("s1")).status == "absent"


async def test_a_reader_racing_a_restore_sees_every_entry(astore: Any) -> None:
    before = await seeded(astore)
    a = Archiver(astore)
    for _ in range(3):
        await a.archive("s1")
        astore.cold.clear_cache()
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.restore, "s1")
            for _ in range(5):
                assert enc(await astore.read("s1")) == enc(before)
                await anyio.lowlevel.checkpoint()


async def test_a_store_without_a_tier_says_so(redis_url: str, prefix: str, tmp_path: Path) -> None:
    tier = ColdTier(str(tmp_path / "c"), prefix=prefix)
    s = RedisSessionStore.from_url(redis_url, prefix=prefix, cold=tier)
    bare = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        before = await seeded(s)
        await Archiver(s).archive("s1")
        # the archive recorded the URL under {prefix}:cold:url: every store of the prefix finds it
        assert enc(await bare.read("s1")) == enc(before)
        await s._raw("DEL", s.keys.cold_url)  # a URL never recorded: the read says what is missing
        bare2 = RedisSessionStore.from_url(redis_url, prefix=prefix)
        try:
            with pytest.raises(SegmentMissingError, match="no cold tier"):
                await bare2.read("s1")
        finally:
            await bare2.aclose()
    finally:
        await s.aclose()
        await bare.aclose()
        await cleanup_prefix(redis_url, prefix)


async def test_archive_refuses_a_replaced_session_in_the_script(redis_store: RedisSessionStore, tmp_path: Path) -> None:
    redis_store.cold = ColdTier(str(tmp_path), prefix=redis_store.prefix)
    await seeded(redis_store)
    state = await redis_store.cold_state("s1")
    assert state is not None
    seg = await redis_store.cold.write("s1", state.incarnation, await redis_store.read("s1", 0, 10))
    await redis_store.delete("s1")
    await redis_store.create(SessionHeader(id="s1"), [um(i) for i in range(40)])
    with pytest.raises(SessionReplacedError):
        await redis_store.commit_archive("s1", state, seg)
    assert await redis_store._raw("XLEN", redis_store.keys.log("s1")) == 40


@pytest.mark.parametrize(
    "sid", ["../../etc/passwd", "a/b/./c", "a/..", "./.", "日本語:チャット", "x" * 256, "%2E%2E", "a\\b"]
)
async def test_hostile_ids_stay_inside_the_folder(astore: Any, sid: str) -> None:
    before = await seeded(astore, sid, 10)
    assert (await Archiver(astore).archive(sid)).status == "archived"
    root = Path(astore.cold.objects.root)
    (key,) = await objects(astore)
    path = (root / key).resolve()
    assert path.is_relative_to(root) and len(path.relative_to(root).parts) == 4
    astore.cold.clear_cache()
    assert enc(await astore.read(sid)) == enc(before)
    assert await Archiver(astore, grace_ms=0).sweep() == []  # the sweep maps the folder back to the id


async def test_a_damaged_cold_field_is_a_typed_error(redis_store: RedisSessionStore, tmp_path: Path) -> None:
    from redis_session.errors import SessionError

    redis_store.cold = ColdTier(str(tmp_path), prefix=redis_store.prefix)
    await seeded(redis_store)
    await Archiver(redis_store).archive("s1", upto=20)
    await redis_store._raw("HSET", redis_store.keys.hdr("s1"), "cold", "0:20:nothex")
    with pytest.raises(SessionError, match="cold field is damaged"):
        await redis_store.read("s1")
    assert len(await redis_store.read("s1", 20)) == 20  # the hot part still reads
    assert any(p.code == "segment-corrupt" for p in (await doctor(redis_store, "s1")).problems)


async def test_the_contract_wrapper_really_archives(astore: Any) -> None:
    from redis_session.testing.contract import ArchivedPrefixStore, SessionStoreContract

    wrapped = ArchivedPrefixStore(astore)
    await SessionStoreContract().test_branch_stitches_parent_prefix(wrapped)
    assert wrapped.archived > 0
    assert await objects(astore)


@pytest.mark.parametrize("live", [False, True])
async def test_tail_of_a_wholly_archived_idle_session_yields_its_backlog(astore: Any, live: bool) -> None:
    before = await seeded(astore)
    await Archiver(astore).archive("s1")
    got: list[Any] = []
    with anyio.fail_after(60):
        tail = astore.tail_live("s1", 3) if live else astore.tail("s1", 3)
        async for e in tail:
            got.append(e)
            if len(got) == 37:
                break
    assert enc(got) == enc(before[3:])


async def test_long_ranges_become_several_segments_and_the_lru_is_bounded(astore: Any) -> None:
    before = await seeded(astore, k=40)
    res = await Archiver(astore, segment_entries=15).archive("s1")
    assert (res.status, res.lo, res.hi) == ("archived", 0, 40)
    state = await astore.cold_state("s1")
    assert [(s.lo, s.hi) for s in state.cold] == [(0, 15), (15, 30), (30, 40)]
    astore.cold.cache_entries = 20
    astore.cold.clear_cache()
    assert enc(await astore.read("s1")) == enc(before)
    assert astore.cold._cached <= 20 and len(astore.cold._cache) == 1
    assert enc(await astore.read("s1", 16, 18)) == enc(before[16:18])


@pytest.mark.parametrize("which", ["commit_archive", "commit_restore"])
async def test_a_lost_script_reply_then_a_rerun_loses_nothing(astore: Any, which: str) -> None:
    from redis_session.errors import StoreUnavailableError

    before = await seeded(astore)
    a = Archiver(astore)
    if which == "commit_restore":
        await a.archive("s1")
    real = getattr(astore, which)

    async def ran_but_reply_lost(*args: Any) -> str:
        await real(*args)
        raise StoreUnavailableError("the reply was lost")

    setattr(astore, which, ran_but_reply_lost)
    with pytest.raises(StoreUnavailableError):
        await (a.archive("s1") if which == "commit_archive" else a.restore("s1"))
    setattr(astore, which, real)
    assert enc(await astore.read("s1")) == enc(before)
    again = await (a.archive("s1") if which == "commit_archive" else a.restore("s1"))
    assert again.status == "nothing"
    assert enc(await astore.read("s1")) == enc(before)
    # a restore whose reply was lost left its objects: unnamed now, the sweep takes them
    swept = await Archiver(astore, grace_ms=0).sweep()
    assert len(swept) == (1 if which == "commit_restore" else 0)
    assert enc(await astore.read("s1")) == enc(before)


async def test_an_ephemeral_session_is_never_archived(astore: Any) -> None:
    await astore.create(SessionHeader(id="e"), [um(i) for i in range(5)], ttl_ms=60_000)
    assert (await Archiver(astore).archive("e")).status == "ephemeral"
    assert (await Archiver(astore).archive("e", policy=Policy(keep=0))).status == "ephemeral"
    assert await objects(astore) == []


@pytest.mark.parametrize("seed", [2, 3, 7])  # 2 and 3 once found two restores mixing one staging stream
async def test_random_interleaving_of_appends_archives_restores_reads_and_a_tail(astore: Any, seed: int) -> None:
    """Writers, archivers (random k, several at once), restores, random-range readers and a tail
    from 0, all at once: every read is contiguous from its start with entry n's own content, and
    the tail yields every entry once, in order."""
    import random

    rng = random.Random(seed)
    total = 240
    await astore.create(SessionHeader(id="r"), [um(0)])
    tailed: list[int] = []
    errors: list[str] = []

    async def writer() -> None:
        n = 1
        while n < total:
            k = min(total - n, rng.randint(1, 6))
            await astore.put("r", n, [um(n + i) for i in range(k)])
            n += k
            await anyio.lowlevel.checkpoint()

    async def archiver(seed: int) -> None:
        r = random.Random(seed)
        a = Archiver(astore, segment_entries=r.randint(5, 40))
        for _ in range(25):
            head = await astore.head("r")
            if r.random() < 0.15:
                await a.restore("r")
            else:
                await a.archive("r", upto=r.randint(0, head.n))
            await anyio.lowlevel.checkpoint()

    async def reader() -> None:
        for _ in range(60):
            head = await astore.head("r")
            lo = rng.randint(0, head.n)
            hi = rng.randint(lo, head.n)
            got = await astore.read("r", lo, hi)
            if [e.n for e in got] != list(range(lo, hi)) or any(e.data["content"] != f"m{e.n}" for e in got):
                errors.append(f"read [{lo}, {hi}) gave {[e.n for e in got][:5]}…")
            await anyio.lowlevel.checkpoint()

    async def tail() -> None:
        async for e in astore.tail("r", 0):
            if e.data["content"] != f"m{e.n}":
                errors.append(f"tail n={e.n}")
            tailed.append(e.n)
            if e.n == total - 1:
                return

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tail)
            tg.start_soon(writer)
            for s in range(3):
                tg.start_soon(archiver, seed * 10 + s)
            tg.start_soon(reader)
    assert errors == []
    assert tailed == list(range(total))
    assert [e.data["content"] for e in await astore.read("r")] == [f"m{i}" for i in range(total)]
    if isinstance(astore, RedisSessionStore):
        assert (await doctor(astore, "r")).problems == []


async def test_two_restores_at_once_never_rename_a_stream_with_a_hole(astore: Any) -> None:
    before = await seeded(astore, k=40)
    await Archiver(astore, segment_entries=7).archive("s1")
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(Archiver(astore).restore, "s1")
    assert enc(await astore.read("s1")) == enc(before)
    state = await astore.cold_state("s1")
    assert state is not None and state.cold == []
    if isinstance(astore, RedisSessionStore):
        assert await astore._raw("XLEN", astore.keys.log("s1")) == 40
        assert await astore._raw("PTTL", astore.keys.log("s1")) == -1  # the staging expiry did not follow
        assert [k async for k in astore.client.scan_iter(match=f"{astore.prefix}:*restore*")] == []


async def test_a_restore_never_deletes_a_later_archivers_identical_upload(astore: Any) -> None:
    """Archive, restore, archive the same range again (same bytes): the restore's deletion of the
    objects it named must not take the second upload, whatever the interleaving."""
    before = await seeded(astore)
    a = Archiver(astore)
    await a.archive("s1", upto=10)
    state = await astore.cold_state("s1")
    entries = await astore.cold.read("s1", state.incarnation, state.cold, 0, 10)
    assert await astore.commit_restore("s1", state, entries) == "done"  # restored; objects not yet dropped
    assert (await a.archive("s1", upto=10)).status == "archived"  # the same bytes again
    await astore.cold.drop("s1", state.incarnation, state.cold)  # the restore's clean-up, late
    astore.cold.clear_cache()
    assert enc(await astore.read("s1")) == enc(before)


async def test_a_long_log_paged_while_it_is_archived_is_read_again(
    redis_store: RedisSessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis_session.redis.store as store_mod

    monkeypatch.setattr(store_mod, "MAX_READ_RANGE", 7)  # pages of 7 rows
    redis_store.cold = ColdTier(str(tmp_path), prefix=redis_store.prefix)
    before = await seeded(redis_store)
    assert enc(await redis_store.read("s1")) == enc(before)  # paged, all hot
    real = redis_store._page_on
    raced: list[int] = []

    async def archive_under_the_pages(*args: Any) -> Any:
        if not raced:
            raced.append(1)
            await Archiver(redis_store, segment_entries=5).archive("s1", upto=30)  # beyond the first page
        return await real(*args)

    monkeypatch.setattr(redis_store, "_page_on", archive_under_the_pages)
    assert enc(await redis_store.read("s1")) == enc(before)
    assert raced and (await redis_store.cold_state("s1")).hot_start == 30
