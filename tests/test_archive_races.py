"""The cold tier against what runs beside it: two stores pointed at one folder, a restore that
races a merging archive, a sweep that races deletes, a folder where an object should be."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.lowlevel
import msgspec
import pytest

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.archiver import Archiver, Policy
from redis_session.cold import ColdTier, LocalFolder
from redis_session.errors import SegmentMissingError

from support import cleanup_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


def um(i: int) -> NewEntry:
    return NewEntry("user/message", {"content": f"m{i}"})


def enc(entries: Any) -> bytes:
    return msgspec.json.encode(list(entries))


def other_db(url: str) -> str:
    """The same server, another database: to Redis clients, another store."""
    parts = urlsplit(url)
    db = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(db + 1) % 16}"))


@pytest.fixture
async def two_stores(redis_url: str, tmp_path: Path) -> AsyncIterator[tuple[RedisSessionStore, RedisSessionStore, str]]:
    prefix = f"tw{time.monotonic_ns()}"
    folder = str(tmp_path / "cold")
    a = RedisSessionStore.from_url(redis_url, prefix=prefix)
    b = RedisSessionStore.from_url(other_db(redis_url), prefix=prefix)
    try:
        yield a, b, folder
    finally:
        await a.aclose()
        await b.aclose()
        await cleanup_prefix(redis_url, prefix)
        await cleanup_prefix(other_db(redis_url), prefix)


async def test_a_second_store_is_refused_a_folder_another_store_archives_to(
    two_stores: tuple[RedisSessionStore, RedisSessionStore, str],
) -> None:
    """Two servers (or databases) with the same prefix and one folder would each sweep away the
    other's segments as "named by no header": the second one is refused before anything moves."""
    a, b, folder = two_stores
    await a.create(SessionHeader(id="s"), [um(i) for i in range(30)])
    await b.create(SessionHeader(id="s"), [um(i) for i in range(30)])
    before = await a.read("s")
    assert (await Archiver(a, ColdTier(folder)).archive("s", upto=20)).status == "archived"
    with pytest.raises(ValueError, match="another store"):
        await Archiver(b, ColdTier(folder), grace_ms=0).sweep()
    with pytest.raises(ValueError, match="another store"):
        await Archiver(b, ColdTier(folder)).archive("s", upto=20)
    assert (await b.cold_state("s")).cold == []  # type: ignore[union-attr]
    a.cold.clear_cache()  # type: ignore[union-attr]
    assert enc(await a.read("s")) == enc(before)  # a's segments are all there
    # a sweep by the owner itself still works (and takes nothing a header names)
    assert await Archiver(a, grace_ms=0).sweep() == []


class SlowGets(LocalFolder):
    """A folder whose reads wait for `gate` (a slow object store, or a long GC pause)."""

    def __init__(self, root: str, gate: anyio.Event) -> None:
        super().__init__(root)
        self.gate = gate
        self.waiting = anyio.Event()

    async def get(self, key: str) -> bytes:
        self.waiting.set()
        await self.gate.wait()
        return await super().get(key)


async def test_a_restore_that_races_a_merging_archive_restores_and_reports_no_loss(
    redis_store: RedisSessionStore, tmp_path: Path
) -> None:
    folder = str(tmp_path / "cold")
    await redis_store.create(SessionHeader(id="r"), [um(i) for i in range(40)])
    before = await redis_store.read("r")
    assert (await Archiver(redis_store, ColdTier(folder)).archive("r", upto=5)).status == "archived"
    gate = anyio.Event()
    slow = SlowGets(folder, gate)
    restorer = Archiver(redis_store, ColdTier(slow, prefix=redis_store.prefix))
    merger = Archiver(redis_store, ColdTier(folder, prefix=redis_store.prefix))  # merges [0, 5) into [0, 20)
    result: dict[str, Any] = {}

    async def restore() -> None:
        result["res"] = await restorer.restore("r")

    with anyio.fail_after(60):  # a hang guard
        async with anyio.create_task_group() as tg:
            tg.start_soon(restore)
            await slow.waiting.wait()  # the restore read the header and fetches [0, 5)
            res = await merger.archive("r", upto=20)
            assert (res.status, res.lo, res.hi) == ("archived", 5, 20)
            gate.set()
    assert result["res"].status == "restored", result
    redis_store.cold = None
    assert enc(await redis_store.read("r")) == enc(before)
    state = await redis_store.cold_state("r")
    assert state is not None and state.cold == []


async def test_a_restore_of_a_segment_really_gone_still_says_so(redis_store: RedisSessionStore, tmp_path: Path) -> None:
    folder = tmp_path / "cold"
    await redis_store.create(SessionHeader(id="g"), [um(i) for i in range(30)])
    archiver = Archiver(redis_store, ColdTier(str(folder)))
    assert (await archiver.archive("g", upto=20)).status == "archived"
    for p in folder.rglob("*.jsonl.zst"):
        p.unlink()
    redis_store.cold.clear_cache()  # type: ignore[union-attr]
    with pytest.raises(SegmentMissingError):
        await archiver.restore("g")


async def test_a_folder_where_a_segment_should_be_is_a_missing_segment(
    redis_store: RedisSessionStore, tmp_path: Path
) -> None:
    """Not "Redis is unreachable": the object store has no such object."""
    folder = tmp_path / "cold"
    await redis_store.create(SessionHeader(id="d"), [um(i) for i in range(30)])
    assert (await Archiver(redis_store, ColdTier(str(folder))).archive("d", upto=20)).status == "archived"
    [seg] = list(folder.rglob("*.jsonl.zst"))
    seg.unlink()
    seg.mkdir()
    redis_store.cold.clear_cache()  # type: ignore[union-attr]
    with pytest.raises(SegmentMissingError):
        await redis_store.read("d")


async def test_a_sweep_racing_merges_and_deletes_never_fails_on_a_vanished_object(
    redis_store: RedisSessionStore, tmp_path: Path
) -> None:
    folder = str(tmp_path / "cold")
    sids = [f"w{i}" for i in range(6)]
    for sid in sids:
        await redis_store.create(SessionHeader(id=sid), [um(i) for i in range(60)])
    archiver = Archiver(redis_store, ColdTier(folder), grace_ms=0, merge_below=1_000)
    sweeps: list[int] = []

    async def churn() -> None:
        for k in range(10, 60, 5):
            for sid in sids:
                await archiver.archive(sid, policy=Policy(keep=60 - k))
        for sid in sids[:3]:
            await redis_store.delete(sid)

    async def sweep() -> None:
        while not done.is_set():
            sweeps.append(len(await Archiver(redis_store, ColdTier(folder), grace_ms=0).sweep()))
            await anyio.lowlevel.checkpoint()

    done = anyio.Event()
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sweep)
            await churn()
            done.set()
    assert sweeps
    for sid in sids[3:]:
        assert [e.data["content"] for e in await redis_store.read(sid)] == [f"m{i}" for i in range(60)]


async def test_the_doctor_finds_nothing_wrong_with_a_session_written_and_archived_while_it_looks(
    redis_store: RedisSessionStore, tmp_path: Path
) -> None:
    """Appends past the n the doctor read first, and archives moving entries out of the stream
    while it walks it, are no ``stream-ahead`` / ``stream-gap`` / ``segment-missing``."""
    from redis_session.doctor import doctor

    await redis_store.create(SessionHeader(id="busy"), [um(i) for i in range(20)])
    archiver = Archiver(redis_store, ColdTier(str(tmp_path / "cold")), merge_below=50)
    reports: list[Any] = []
    done = anyio.Event()

    async def write() -> None:
        n = 20
        for _ in range(300):
            await redis_store.put("busy", n, [um(n)])
            n += 1
            if n % 10 == 0:
                await archiver.archive("busy", policy=Policy(keep=2))
        done.set()

    async def check() -> None:
        while not done.is_set():
            reports.append(await doctor(redis_store, "busy"))

    with anyio.fail_after(300):  # a hang guard
        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            tg.start_soon(check)
    assert len(reports) > 10
    assert [r.problems for r in reports if not r.ok] == []
    assert (await doctor(redis_store, "busy")).ok


async def test_the_clis_default_folders_of_two_stores_are_two_folders(
    two_stores: tuple[RedisSessionStore, RedisSessionStore, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis_session.cli.workers import _cold_tier

    monkeypatch.setenv("REDIS_SESSION_HOME", str(tmp_path / "home"))
    a, b, _ = two_stores
    ta, tb = await _cold_tier(a, None), await _cold_tier(b, None)
    assert ta.url != tb.url
    assert all(t.url.startswith((tmp_path / "home" / "cold").as_uri()) for t in (ta, tb))
    assert (await _cold_tier(a, None)).url == ta.url  # recorded: found again


async def test_two_stores_claiming_a_new_folder_at_once_one_wins(redis_url: str, tmp_path: Path) -> None:
    """Two deployments pointed at one new bucket, starting together: one store's claim is
    written, the other is refused (never both "archived", one sweep then taking the other's)."""
    for round_ in range(10):
        prefix, folder = f"tc{time.monotonic_ns()}", str(tmp_path / f"new{round_}")
        stores = [RedisSessionStore.from_url(u, prefix=prefix) for u in (redis_url, other_db(redis_url))]
        outcomes: list[str] = []

        async def archive(store: RedisSessionStore, folder: str = folder, outcomes: list[str] = outcomes) -> None:
            try:
                outcomes.append((await Archiver(store, ColdTier(folder)).archive("s")).status)
            except ValueError as e:
                assert "another store" in str(e)
                outcomes.append("refused")

        try:
            for store in stores:
                await store.create(SessionHeader(id="s"), [um(i) for i in range(10)])
            async with anyio.create_task_group() as tg:
                for store in stores:
                    tg.start_soon(archive, store)
        finally:
            for store in stores:
                await store.aclose()
            await cleanup_prefix(redis_url, prefix)
            await cleanup_prefix(other_db(redis_url), prefix)
        assert sorted(outcomes) == ["archived", "refused"], outcomes
