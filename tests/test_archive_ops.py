"""Operating the cold tier: the `archive` / `restore` commands, the change-feed worker, a real
S3-compatible server (moto) through obstore, and an archiver process killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from test_cli import cli

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.archiver import Archiver, ArchiveWorker, Policy, set_cold_url
from redis_session.cold import ColdTier

from support import wait_for

pytestmark = pytest.mark.anyio


def um(i: int) -> NewEntry:
    return NewEntry("user/message", {"content": f"m{i}"})


async def seed(store: RedisSessionStore, sid: str, k: int = 30) -> list[Any]:
    await store.create(SessionHeader(id=sid), [um(i) for i in range(k)])
    return list(await store.read(sid))


async def test_cli_archive_restore_and_sweep(redis_store: RedisSessionStore, redis_url: str, tmp_path: Path) -> None:
    p = redis_store.prefix
    before = await seed(redis_store, "a")
    await seed(redis_store, "b")
    r = cli("archive", "a", "--to", str(tmp_path / "cold"), "--json", url=redis_url, prefix=p)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "archived"
    assert await redis_store._raw("XLEN", redis_store.keys.log("a")) == 0
    # the URL is recorded: this store (built without a tier) reads it back
    assert msgspec.json.encode(await redis_store.read("a")) == msgspec.json.encode(before)
    r = cli("archive", "--keep", "10", "--json", url=redis_url, prefix=p)
    assert r.returncode == 0, r.stderr
    got = {d["session"]: d for d in map(json.loads, r.stdout.splitlines())}
    assert got["b"]["status"] == "archived" and (got["b"]["lo"], got["b"]["hi"]) == (0, 20)
    r = cli("restore", "a", "--json", url=redis_url, prefix=p)
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "restored", r.stderr
    assert await redis_store._raw("XLEN", redis_store.keys.log("a")) == 30
    r = cli("archive", "--sweep", "--grace", "0s", "--json", url=redis_url, prefix=p)
    assert r.returncode == 0 and json.loads(r.stdout)["swept"] == 0, r.stderr
    r = cli("archive", "--status", url=redis_url, prefix=p)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["cold"].startswith("file://") and st["redis_used_memory"] > 0
    r = cli("archive", url=redis_url, prefix=p)
    assert r.returncode != 0 and "give a SESSION_ID" in r.stderr
    r = cli("archive", "--idle", "soon", url=redis_url, prefix=p)
    assert r.returncode != 0 and "not a duration" in r.stderr
    r = cli("archive", "b", "--to", str(tmp_path / "elsewhere"), url=redis_url, prefix=p)
    assert r.returncode == 1 and "cold segments live in" in r.stderr  # the recorded place is kept
    r = cli("archive", "a", "--to", "ftp://example.com/x", url=redis_url, prefix=p)
    assert r.returncode == 1 and "unsupported object store URL" in r.stderr and "Traceback" not in r.stderr


async def test_cli_archive_of_one_session_leaves_it_hot_below_min_entries(
    redis_store: RedisSessionStore, redis_url: str, tmp_path: Path
) -> None:
    # `archive SESSION --min-entries N` archived the whole log whatever N was
    p = redis_store.prefix
    await seed(redis_store, "short", 5)
    r = cli("archive", "short", "--min-entries", "6", "--to", str(tmp_path / "cold"), "--json", url=redis_url, prefix=p)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "nothing"
    assert await redis_store._raw("XLEN", redis_store.keys.log("short")) == 5
    r = cli("archive", "short", "--min-entries", "5", "--json", url=redis_url, prefix=p)
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "archived", r.stderr
    assert await redis_store._raw("XLEN", redis_store.keys.log("short")) == 0
    r = cli("restore", "nope", url=redis_url, prefix=p)
    assert r.returncode != 0 and "not found" in r.stderr


async def test_worker_keeps_n_hot_from_the_feed(redis_store: RedisSessionStore, tmp_path: Path) -> None:
    await set_cold_url(redis_store, str(tmp_path / "cold"))
    w1 = ArchiveWorker(redis_store, Policy(keep=5, min_entries=10), block_ms=100, consumer="w1")
    w2 = ArchiveWorker(redis_store, Policy(keep=5, min_entries=10), block_ms=100, consumer="w2")
    before = await seed(redis_store, "s1", 3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(w1.run)
        tg.start_soon(w2.run)
        for i in range(3, 40):
            before += await redis_store.put("s1", i, [um(i)])

        async def hot_small() -> bool:
            st = await redis_store.cold_state("s1")
            return st is not None and st.n == 40 and st.n - st.hot_start < 15

        await wait_for(hot_small, within=45)
        w1.stop()
        w2.stop()
    assert msgspec.json.encode(await redis_store.read("s1")) == msgspec.json.encode(before)
    archived = w1.metrics.value("entries_total") + w2.metrics.value("entries_total")
    st = await redis_store.cold_state("s1")
    assert st is not None and archived == st.hot_start


async def test_worker_archives_idle_sessions(redis_store: RedisSessionStore, tmp_path: Path) -> None:
    await set_cold_url(redis_store, str(tmp_path / "cold"))
    w = ArchiveWorker(redis_store, Policy(idle_ms=300), block_ms=100)
    before = await seed(redis_store, "idle")
    await redis_store.put("idle", 30, [um(30)])  # a feed hint (a create with entries gives one too)
    async with anyio.create_task_group() as tg:
        tg.start_soon(w.run)

        async def cold() -> bool:
            st = await redis_store.cold_state("idle")
            return st is not None and st.hot_start == 31

        await wait_for(cold, within=45)
        w.stop()
    assert len(await redis_store.read("idle")) == len(before) + 1


# --------------------------------------------------------------------------- S3 (moto)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    pytest.importorskip("obstore")
    try:
        import moto.server  # noqa: F401
    except ImportError:
        pytest.skip("moto[server] is not installed")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.skip("moto server did not start")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_s3_compatible_server_through_obstore(redis_store: RedisSessionStore, s3_url: str) -> None:
    import urllib.request

    bucket = urllib.request.Request(f"{s3_url}/cold-bucket", method="PUT")
    await anyio.to_thread.run_sync(lambda: urllib.request.urlopen(bucket).read())
    from redis_session.cold import CloudObjects

    objects = CloudObjects(
        "s3://cold-bucket/tier",
        endpoint=s3_url,
        region="us-east-1",
        access_key_id="test",
        secret_access_key="test",
        client_options={"allow_http": True},
    )
    redis_store.cold = ColdTier(objects, prefix=redis_store.prefix)
    before = await seed(redis_store, "s3")
    res = await Archiver(redis_store).archive("s3", upto=25)
    assert res.status == "archived"
    redis_store.cold.clear_cache()
    assert msgspec.json.encode(await redis_store.read("s3")) == msgspec.json.encode(before)
    segments = [o.key async for o in objects.list("") if o.key.endswith(".jsonl.zst")]
    assert len(segments) == 1
    assert await Archiver(redis_store, grace_ms=0).sweep() == []
    await redis_store.delete("s3")
    assert [o.key async for o in objects.list("")] == [f"{redis_store.prefix}/store-id"]  # the tier's owner


# --------------------------------------------------------------------------- a real kill


_ROOT = str(Path(__file__).resolve().parents[1])
_KILLED_ARCHIVER = """
import anyio, os, sys
from redis_session import RedisSessionStore
from redis_session.archiver import Archiver
from redis_session.cold import ColdTier

async def main():
    url, prefix, folder, step = sys.argv[1:5]
    store = RedisSessionStore.from_url(url, prefix=prefix, cold=ColdTier(folder, prefix=prefix))
    async def hook(at):
        if at == step:
            os.kill(os.getpid(), 9)
    await Archiver(store, hook=hook).archive("k")

anyio.run(main)
"""


@pytest.mark.parametrize("step", ["before_upload", "after_upload", "after_script"])
async def test_sigkill_at_every_step(redis_store: RedisSessionStore, redis_url: str, tmp_path: Path, step: str) -> None:
    before = await seed(redis_store, "k", 50)
    env = {**os.environ, "PYTHONPATH": _ROOT}
    folder = str(tmp_path / "cold")
    argv = [sys.executable, "-c", _KILLED_ARCHIVER, redis_url, redis_store.prefix, folder, step]
    r = await anyio.run_process(argv, env=env, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    redis_store.cold = ColdTier(folder, prefix=redis_store.prefix)
    assert msgspec.json.encode(await redis_store.read("k")) == msgspec.json.encode(before)
    await Archiver(redis_store).archive("k")
    assert msgspec.json.encode(await redis_store.read("k")) == msgspec.json.encode(before)
    st = await redis_store.cold_state("k")
    assert st is not None and st.hot_start == 50
    assert await redis_store._raw("XLEN", redis_store.keys.log("k")) == 0


async def test_gateway_reads_an_archived_session_as_before(redis_store: RedisSessionStore, tmp_path: Path) -> None:
    import httpx
    from test_gateway import collect_entries, path

    from support import running_gateway

    redis_store.cold = ColdTier(str(tmp_path / "cold"), prefix=redis_store.prefix)
    await seed(redis_store, "g", 30)
    cut = NewEntry("cut", {"before": 25, "summary": [{"role": "user", "content": "sum"}], "reason": "manual"})
    await redis_store.put("g", 30, [cut, um(31)])
    with anyio.fail_after(30):
        async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as client:
            urls = [path("g", "entries"), path("g", "entries") + "?start=3&stop=28", path("g", "messages"), path("g")]
            hot = [(await client.get(u)).content for u in urls]
            assert (await Archiver(redis_store).archive("g", upto=29)).status == "archived"
            redis_store.cold.clear_cache()
            assert [(await client.get(u)).content for u in urls] == hot
            assert await collect_entries(client, path("g", "events"), 31) == list(range(32))
            head = await redis_store.head("g")
            assert head is not None
            resume = {"Last-Event-ID": f"{head.header.incarnation}:10"}  # an SSE id names the life
            assert await collect_entries(client, path("g", "events"), 31, resume) == list(range(11, 32))


async def test_idle_worker_schedules_sessions_the_feed_no_longer_names(
    redis_store: RedisSessionStore, tmp_path: Path
) -> None:
    await set_cold_url(redis_store, str(tmp_path / "cold"))
    await seed(redis_store, "old", 20)
    for key in redis_store.keys.all_feeds():
        await redis_store._raw("DEL", key)  # its hint trimmed long ago
    w = ArchiveWorker(redis_store, Policy(idle_ms=200), block_ms=100)
    async with anyio.create_task_group() as tg:
        tg.start_soon(w.run)

        async def cold() -> bool:
            st = await redis_store.cold_state("old")
            return st is not None and st.hot_start == 20

        await wait_for(cold, within=45)
        w.stop()


async def test_worker_survives_a_failing_object_store_and_retries(
    redis_store: RedisSessionStore, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    bad = ColdTier(str(blocker / "cold"), prefix=redis_store.prefix)  # every write fails (OSError)
    redis_store.cold = bad
    w = ArchiveWorker(redis_store, Policy(keep=2), tier=bad, block_ms=100, claim_idle_ms=300)
    before = await seed(redis_store, "f", 3)
    before += await redis_store.put("f", 3, [um(3), um(4)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(w.run)
        await wait_for(lambda: w.metrics.value("sessions_total", outcome="error") >= 1, within=45)
        good = ColdTier(str(tmp_path / "good"), prefix=redis_store.prefix)
        w.archiver.tier = redis_store.cold = good

        async def archived() -> bool:
            st = await redis_store.cold_state("f")
            return st is not None and st.hot_start == 3

        await wait_for(archived, within=45)  # the pending feed entry, reclaimed
        w.stop()
    assert msgspec.json.encode(await redis_store.read("f")) == msgspec.json.encode(before)


async def test_archive_restore_and_branch_on_the_cluster(cluster_url: str, prefix: str, tmp_path: Path) -> None:
    from support import cleanup_cluster_prefix

    store = RedisSessionStore.from_url(cluster_url, prefix=prefix, cluster=True)
    try:
        await set_cold_url(store, str(tmp_path / "cold"))
        before = await seed(store, "c1", 40)
        await store.create(SessionHeader(id="c1-b", parent="c1", at=30), [um(100)])  # another slot
        a = Archiver(store, segment_entries=12)
        assert (await a.archive("c1")).status == "archived"
        assert msgspec.json.encode(await store.read("c1")) == msgspec.json.encode(before)
        assert msgspec.json.encode((await store.read("c1-b"))[:30]) == msgspec.json.encode(before[:30])
        assert (await a.restore("c1")).status == "restored"
        assert msgspec.json.encode(await store.read("c1")) == msgspec.json.encode(before)
        st = await store.cold_state("c1")
        assert st is not None and st.cold == []
    finally:
        await store.aclose()
        await cleanup_cluster_prefix(cluster_url, prefix)
