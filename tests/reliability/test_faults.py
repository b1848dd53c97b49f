"""Fault injection against real servers.

- connections killed in a loop (CLIENT KILL from another client) while appends run;
- the server SIGKILLed and restarted on the same port and AOF dir (``appendfsync always``);
- the server unreachable (nothing listening, or a partition that swallows traffic);
- a TCP proxy that delays traffic and cuts connections mid-command and mid-reply.

What must hold: an append either landed once or raised; retried with its idempotency key it
lands exactly once; nothing acknowledged is lost; calls fail with `StoreUnavailableError` within
their timeout and never hang; reads never return a torn batch; the raw storage stays consistent
(header n == XLEN, IDs ``<n>-1`` contiguous).

CI runs each scenario for a couple of seconds; ``-m slow`` runs the long soaks.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from redis_session import (
    Entry,
    RedisSessionStore,
    SessionError,
    SessionHeader,
    SessionNotFoundError,
    StoreUnavailableError,
)
from redis_session.redis.embedded import ServerProcess, start_server
from redis_session.redis.wire import held

from ._proxy import FaultProxy
from ._util import (
    assert_batches_whole,
    assert_storage_consistent,
    batch,
    free_port,
    mark,
    occurrences,
    put_retrying,
)
from support import wait_blocked_in_xread

pytestmark = pytest.mark.anyio

CI_SECONDS = 2.5
SLOW_SECONDS = 30.0


# --------------------------------------------------------------------------- helpers


async def _killer(url: str, name: str, stop: anyio.Event, counter: list[int], seed: int = 0) -> None:
    """Kill every connection named `name` over and over until `stop`."""
    rng = random.Random(seed)
    r = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        while not stop.is_set():
            for c in await r.client_list():
                if c.get("name") == name:
                    try:
                        await r.execute_command("CLIENT", "KILL", "ID", c["id"])
                        counter[0] += 1
                    except aioredis.ResponseError:
                        pass  # gone already
            await anyio.sleep(rng.uniform(0.001, 0.012))
    finally:
        await r.aclose()


async def _writer(
    store: Any,
    sid: str,
    tag: str,
    until: float,
    acked: list[list[Entry]],
    failures: list[int],
    track_n: bool,
    seed: int,
    untyped: list[BaseException] | None = None,
) -> None:
    """Append batches of 1-3 entries with idempotency keys until `until`, retrying each one on
    StoreUnavailableError with the same key (and, with `track_n`, the same expected_n).

    With `untyped`, errors that are not `SessionError`s are collected there and retried too."""
    rng = random.Random(seed)
    n = None
    while track_n and n is None:
        try:
            n = (await store.head(sid)).n
        except StoreUnavailableError:
            await anyio.sleep(0.01)
    j = 0
    retry_on: tuple[type[BaseException], ...] = (StoreUnavailableError,)
    if untyped is not None:
        retry_on = (StoreUnavailableError, _Untyped)
        store = _Collecting(store, untyped)
    while time.monotonic() < until:
        key = f"{tag}-{j}"
        got, failed = await put_retrying(
            store, sid, batch(key, rng.randint(1, 3)), key, expected_n=n, retry_on=retry_on
        )
        failures[0] += failed
        acked.append(got)
        if n is not None:
            assert got[0].n == n, "an expected-n append landed somewhere else"
            n += len(got)
        j += 1


class _Untyped(Exception):
    pass


class _Collecting:
    """A store wrapper whose put turns errors that are not SessionErrors into `_Untyped`, after
    noting them."""

    def __init__(self, store: Any, seen: list[BaseException]) -> None:
        self._store, self._seen = store, seen

    async def put(self, *args: Any, **kwargs: Any) -> list[Entry]:
        try:
            return await self._store.put(*args, **kwargs)
        except SessionError:
            raise
        except Exception as e:
            self._seen.append(e)
            raise _Untyped(repr(e)) from e


async def _read_after_faults(store: Any, sid: str) -> list[Entry]:
    """Read a whole log once the faults are over. The pool may still hold connections the server
    closed while they were idle: each fails once (see test_read_after_idle_connections_were_killed)."""
    with anyio.fail_after(30):
        while True:
            try:
                return list(await store.read(sid))
            except StoreUnavailableError:
                await anyio.sleep(0.01)


def _check_exactly_once(entries: list[Entry], acked: list[list[Entry]]) -> None:
    occ = occurrences(entries)
    dups = {k: c for k, c in occ.items() if c > 1}
    assert not dups, f"duplicated entries: {list(dups)[:10]}"
    for got in acked:
        for e in got:
            assert occ[(e.data["k"], e.data["i"])] == 1, f"acknowledged entry {e.data} is not in the log"
            assert entries[e.n].data == e.data, f"acknowledged entry moved: {e.n}"
    assert [e.n for e in entries] == list(range(len(entries)))
    assert_batches_whole(entries)


# --------------------------------------------------------------------------- CLIENT KILL


async def _kill_loop_scenario(url: str, seconds: float, seed: int) -> None:
    name = f"victim{seed}"
    # A pool limit far above what a few seconds can leak: pool leaks have their own test
    # (test_failed_writes_do_not_leak_pool_connections); this one is about exactly-once.
    store = RedisSessionStore.from_url(
        url, prefix=f"kill{seed}", client_options={"client_name": name, "max_connections": 1_000_000}
    )
    check = aioredis.Redis.from_url(url)
    sids = [f"own-{i}" for i in range(6)]
    try:
        for sid in [*sids, "shared"]:
            await store.create(SessionHeader(id=sid))
        acked: dict[str, list[list[Entry]]] = {sid: [] for sid in [*sids, "shared"]}
        failures = [0]
        kills = [0]
        stop = anyio.Event()
        until = time.monotonic() + seconds
        with anyio.fail_after(seconds + 60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_killer, url, name, stop, kills, seed)
                async with anyio.create_task_group() as writers:
                    for i, sid in enumerate(sids):
                        writers.start_soon(_writer, store, sid, f"w{i}", until, acked[sid], failures,
                                           True, seed + i)  # fmt: skip
                    for i in range(4):
                        writers.start_soon(_writer, store, "shared", f"x{i}", until, acked["shared"], failures,
                                           False, seed + 100 + i)  # fmt: skip
                stop.set()
        assert kills[0] > 10, "the kill loop did not kill anything: the test tested nothing"
        assert failures[0] > 0, "no append ever failed: the faults never hit an append"
        for sid, got in acked.items():
            entries = await _read_after_faults(store, sid)
            _check_exactly_once(entries, got)
            assert await assert_storage_consistent(check, store, sid) == len(entries)
    finally:
        await store.aclose()
        await check.aclose()


async def test_client_kill_loop_idempotent_retries_land_exactly_once(private_server: ServerProcess) -> None:
    await _kill_loop_scenario(private_server.url, CI_SECONDS, seed=1)


@pytest.mark.slow
async def test_client_kill_loop_soak(private_server: ServerProcess) -> None:
    await _kill_loop_scenario(private_server.url, SLOW_SECONDS, seed=2)


async def _cluster_kill_scenario(local_cluster: Any, prefix: str, seconds: float) -> list[BaseException]:
    """CLIENT KILL of this test's own (named) connections on every master of the shared cluster,
    while writers append with idempotency keys. Returns the errors that were not SessionErrors."""
    name = f"victim-{prefix}"
    store = RedisSessionStore.from_url(
        local_cluster.url, prefix=prefix, cluster=True, client_options={"client_name": name}
    )
    untyped: list[BaseException] = []
    try:
        sids = [f"c{i}" for i in range(4)]
        for sid in sids:
            await store.create(SessionHeader(id=sid))
        acked: dict[str, list[list[Entry]]] = {sid: [] for sid in sids}
        failures = [0]
        kills = [0]
        stop = anyio.Event()
        until = time.monotonic() + seconds
        with anyio.fail_after(seconds + 90):
            async with anyio.create_task_group() as tg:
                for node in local_cluster.masters:
                    tg.start_soon(_killer, node.url, name, stop, kills, node.port)
                async with anyio.create_task_group() as writers:
                    for i, sid in enumerate(sids):
                        writers.start_soon(_writer, store, sid, f"w{i}", until, acked[sid], failures,
                                           True, i, untyped)  # fmt: skip
                stop.set()
        assert kills[0] > 0
        for sid, got in acked.items():
            entries = await _read_after_faults(store, sid)
            _check_exactly_once(entries, got)
            node = local_cluster.master_of_slot(RedisCluster.keyslot(store.client, store.keys.hdr(sid)))
            raw = aioredis.Redis.from_url(node.url)
            try:
                assert await assert_storage_consistent(raw, store, sid) == len(entries)
            finally:
                await raw.aclose()
        return untyped
    finally:
        await store.aclose()
        await _drop_cluster_prefix(local_cluster, prefix)


async def test_client_kill_loop_on_cluster_exactly_once(local_cluster: Any, prefix: str) -> None:
    """Exactly-once with retries on the cluster (whatever error type a failed attempt raised)."""
    untyped = await _cluster_kill_scenario(local_cluster, prefix, CI_SECONDS)
    print("untyped errors on the cluster:", sorted({type(e).__name__ for e in untyped}))


async def test_client_kill_loop_on_cluster_errors_are_typed(local_cluster: Any, prefix: str) -> None:
    untyped = await _cluster_kill_scenario(local_cluster, prefix, CI_SECONDS)
    assert not untyped, f"untyped errors escaped the store: {sorted({repr(e)[:80] for e in untyped})}"


async def _drop_cluster_prefix(cluster: Any, prefix: str) -> None:
    for node in cluster.masters:
        r = aioredis.Redis.from_url(node.url)
        try:
            async for k in r.scan_iter(match=f"{prefix}:*", count=1000):
                await r.delete(k)
        finally:
            await r.aclose()


async def test_read_after_idle_connections_were_killed(private_server: ServerProcess) -> None:
    store = RedisSessionStore.from_url(private_server.url, client_options={"client_name": "idle"})
    admin = aioredis.Redis.from_url(private_server.url, decode_responses=True)
    try:
        await store.create(SessionHeader(id="s"), [mark("a")])
        async with anyio.create_task_group() as tg:  # a few pooled connections
            for _ in range(4):
                tg.start_soon(store.read, "s")
        for c in await admin.client_list():
            if c.get("name") == "idle":
                await admin.execute_command("CLIENT", "KILL", "ID", c["id"])
        await anyio.sleep(0.1)
        for _ in range(4):
            assert [e.n for e in await store.read("s")] == [0]
            assert (await store.head("s")).n == 1
    finally:
        await store.aclose()
        await admin.aclose()


# --------------------------------------------------------------------------- SIGKILL + restart


async def _restart_scenario(tmp_path: Path, seconds: float, crashes: int) -> None:
    data_dir = tmp_path / "aof"
    srv = start_server(data_dir, appendonly=True, appendfsync="always")
    port = srv.port
    holder = [srv]
    store = RedisSessionStore.from_url(
        srv.url,
        prefix="rs",
        client_options={"socket_timeout": 5, "socket_connect_timeout": 2, "max_connections": 1_000_000},
    )
    sids = [f"s{i}" for i in range(4)]
    try:
        for sid in [*sids, "shared"]:
            await store.create(SessionHeader(id=sid))
        acked: dict[str, list[list[Entry]]] = {sid: [] for sid in [*sids, "shared"]}
        failures = [0]
        until = time.monotonic() + seconds

        async def crasher() -> None:
            rng = random.Random(7)
            gap = seconds / (crashes + 1)
            for _ in range(crashes):
                await anyio.sleep(gap * rng.uniform(0.6, 1.0))
                holder[0].kill()  # SIGKILL: no shutdown, no final fsync
                await anyio.sleep(0.2)
                holder[0] = await anyio.to_thread.run_sync(
                    lambda: start_server(data_dir, port=port, appendonly=True, appendfsync="always")
                )

        with anyio.fail_after(seconds + 120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(crasher)
                for i, sid in enumerate(sids):
                    tg.start_soon(_writer, store, sid, f"w{i}", until, acked[sid], failures,
                                  True, i)  # fmt: skip
                for i in range(3):
                    tg.start_soon(_writer, store, "shared", f"x{i}", until, acked["shared"], failures,
                                  False, 50 + i)  # fmt: skip
        assert failures[0] > 0, "no append saw the crash: the test tested nothing"
        # One more crash after the last acknowledgement: whatever was acknowledged is on disk.
        holder[0].kill()
        holder[0] = start_server(data_dir, port=port, appendonly=True, appendfsync="always")
        check = aioredis.Redis.from_url(holder[0].url)
        try:
            for sid, got in acked.items():
                with anyio.fail_after(30):
                    while True:
                        try:
                            entries = await store.read(sid)
                            break
                        except StoreUnavailableError:
                            await anyio.sleep(0.05)
                assert got, f"{sid}: nothing acknowledged"
                _check_exactly_once(entries, got)
                assert await assert_storage_consistent(check, store, sid) == len(entries)
        finally:
            await check.aclose()
    finally:
        await store.aclose()
        holder[0].stop()


async def test_sigkill_restart_loses_nothing_acknowledged(tmp_path: Path) -> None:
    await _restart_scenario(tmp_path, seconds=3.0, crashes=2)


@pytest.mark.slow
async def test_sigkill_restart_soak(tmp_path: Path) -> None:
    await _restart_scenario(tmp_path, seconds=SLOW_SECONDS, crashes=10)


# --------------------------------------------------------------------------- unreachable


async def _every_call(store: RedisSessionStore) -> list[tuple[str, Any]]:
    async def tail_one() -> None:
        async for _ in store.tail("s"):
            break

    return [
        ("head", lambda: store.head("s")),
        ("read", lambda: store.read("s")),
        ("put", lambda: store.put("s", None, [mark("k")], idempotency_key="k")),
        ("create", lambda: store.create(SessionHeader(id="new"))),
        ("list", lambda: store.list()),
        ("delete", lambda: store.delete("s")),
        ("tail", tail_one),
    ]


async def _assert_all_unavailable(store: RedisSessionStore, within: float) -> None:
    for what, call in await _every_call(store):
        t0 = time.monotonic()
        with anyio.fail_after(within + 5):
            with pytest.raises(StoreUnavailableError):
                await call()
        took = time.monotonic() - t0
        assert took < within, f"{what} took {took:.1f}s to fail"


async def test_nothing_listening_fails_fast() -> None:
    store = RedisSessionStore.from_url(
        f"redis://127.0.0.1:{free_port()}/0", client_options={"socket_connect_timeout": 2}
    )
    try:
        await _assert_all_unavailable(store, within=3.0)
    finally:
        await store.aclose()


async def test_partition_fails_within_socket_timeout(private_server: ServerProcess) -> None:
    """A server that accepts but never answers (a partition): every call, tail included, raises
    StoreUnavailableError after the socket timeout, no hang."""
    with FaultProxy(private_server.port) as proxy:
        store = RedisSessionStore.from_url(
            proxy.url,
            block_ms=500,
            client_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
        )
        try:
            await store.create(SessionHeader(id="s"))
            proxy.blackhole = True
            proxy.cut_all()
            await _assert_all_unavailable(store, within=3.0)
        finally:
            await store.aclose()


async def test_partition_of_an_open_tail(private_server: ServerProcess) -> None:
    """A tail blocked in XREAD when the network goes silent raises; it does not wait forever."""
    with FaultProxy(private_server.port) as proxy:
        store = RedisSessionStore.from_url(
            proxy.url, block_ms=500, client_options={"socket_timeout": 1.5, "socket_connect_timeout": 1.5}
        )
        try:
            await store.create(SessionHeader(id="s"), [mark("a")])
            got: list[int] = []
            t0 = 0.0
            with anyio.fail_after(15), pytest.raises(StoreUnavailableError):
                async for e in store.tail("s"):
                    got.append(e.n)
                    proxy.blackhole = True
                    t0 = time.monotonic()
            assert got == [0]
            assert time.monotonic() - t0 < 5
        finally:
            await store.aclose()


async def test_server_death_ends_a_blocked_tail_with_an_error(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "d", appendonly=False)
    store = RedisSessionStore.from_url(
        srv.url, block_ms=300, client_options={"socket_timeout": 2, "client_name": "blocked-tail"}
    )
    try:
        await store.create(SessionHeader(id="s"))

        async def kill_soon() -> None:
            await wait_blocked_in_xread(srv.url, "blocked-tail")  # the tail is in its XREAD
            srv.kill()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_soon)
                with pytest.raises(StoreUnavailableError):
                    async for _ in store.tail("s"):
                        pass
    finally:
        await store.aclose()
        srv.stop()


async def test_idle_tail_survives_socket_timeout_shorter_than_block(private_server: ServerProcess) -> None:
    """An idle tail on a healthy server must not fail just because nothing was appended for longer
    than the socket timeout: its XREAD BLOCK has to fit inside that timeout."""
    store = RedisSessionStore.from_url(private_server.url, client_options={"socket_timeout": 1.0})
    try:
        await store.create(SessionHeader(id="s"))

        async def append_later() -> None:
            await anyio.sleep(2.5)
            await store.put("s", 0, [mark("late")])

        got: list[int] = []
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(append_later)
                async for e in store.tail("s"):
                    got.append(e.n)
                    break
        assert got == [0]
    finally:
        await store.aclose()


def test_default_socket_timeout_bounds_a_hang() -> None:
    """With the defaults of `from_url`, a partitioned server holds a call for `socket_timeout`
    seconds: that bound must be "a few seconds", not half a minute."""
    store = RedisSessionStore.from_url("redis://127.0.0.1:1/0")
    kwargs = store.client.connection_pool.connection_kwargs
    assert kwargs["socket_connect_timeout"] <= 5
    assert kwargs["socket_timeout"] <= 10, (
        f"socket_timeout={kwargs['socket_timeout']}s: a partition hangs calls that long"
    )


# --------------------------------------------------------------------------- the chaos proxy


async def _proxy_scenario(server: ServerProcess, seconds: float, seed: int) -> dict[str, Any]:
    with FaultProxy(server.port, seed=seed) as proxy:
        store = RedisSessionStore.from_url(
            proxy.url,
            block_ms=300,
            # pool leaks have their own test; this one is about exactly-once and whole batches
            client_options={"socket_timeout": 2, "socket_connect_timeout": 2, "max_connections": 1_000_000},
        )
        direct = RedisSessionStore.from_url(server.url)
        check = aioredis.Redis.from_url(server.url)
        sids = ["a", "b", "c"]
        stats: Counter[str] = Counter()
        try:
            for sid in [*sids, "shared"]:
                await direct.create(SessionHeader(id=sid))
            proxy.delay, proxy.jitter, proxy.cut_rate = 0.0005, 0.002, 0.04
            acked: dict[str, list[list[Entry]]] = {sid: [] for sid in [*sids, "shared"]}
            failures = [0]
            until = time.monotonic() + seconds
            tailed: list[int] = []

            async def reader(sid: str) -> None:
                rng = random.Random(seed)
                while time.monotonic() < until:
                    try:
                        if rng.random() < 0.5:
                            got = await store.read(sid)
                            assert [e.n for e in got] == list(range(len(got)))
                            assert_batches_whole(got)  # a whole-log read ends on a batch boundary
                            stats["full_reads"] += 1
                        else:
                            lo = rng.randrange(0, 40)
                            hi = lo + rng.randrange(0, 20)
                            got = await store.read(sid, lo, hi)
                            assert [e.n for e in got] == list(range(lo, lo + len(got)))
                            assert len(got) <= hi - lo
                            stats["range_reads"] += 1
                        for e in got:  # every entry read is one that was written, whole
                            assert set(e.data) == {"k", "i", "of"} and e.type == "test/mark"
                    except StoreUnavailableError:
                        stats["read_errors"] += 1
                    except SessionNotFoundError:  # pragma: no cover - never deleted here
                        raise

            async def tailer(sid: str) -> None:
                nxt = 0
                while True:
                    try:
                        async for e in store.tail(sid, nxt):
                            assert e.n == nxt, f"tail skipped or repeated: got {e.n}, wanted {nxt}"
                            tailed.append(e.n)
                            nxt += 1
                            if time.monotonic() > until + 5:
                                return
                    except StoreUnavailableError:
                        stats["tail_resumes"] += 1
                        await anyio.sleep(0.01)
                    if time.monotonic() > until + 5:
                        return

            with anyio.fail_after(seconds + 90):
                async with anyio.create_task_group() as tg:
                    tail_scope = anyio.CancelScope()

                    async def run_tailer() -> None:
                        with tail_scope:
                            await tailer("a")

                    tg.start_soon(run_tailer)
                    async with anyio.create_task_group() as work:
                        for i, sid in enumerate(sids):
                            work.start_soon(_writer, store, sid, f"w{i}", until, acked[sid], failures,
                                            True, seed + i)  # fmt: skip
                            work.start_soon(reader, sid)
                        for i in range(3):
                            work.start_soon(_writer, store, "shared", f"x{i}", until, acked["shared"], failures,
                                            False, seed + 10 + i)  # fmt: skip
                    proxy.heal()
                    final_a = (await direct.head("a")).n
                    with anyio.fail_after(30):
                        while len(tailed) < final_a:  # noqa: ASYNC110 - polling a list the tailer fills
                            await anyio.sleep(0.02)
                    tail_scope.cancel()
            assert proxy.stats.cuts > 5, "the proxy cut nothing: the test tested nothing"
            assert failures[0] > 0
            assert tailed == list(range(final_a)), "the resumed tail lost or repeated entries"
            for sid, got in acked.items():
                entries = await direct.read(sid)
                _check_exactly_once(entries, got)
                assert await assert_storage_consistent(check, direct, sid) == len(entries)
            stats["cuts"] = proxy.stats.cuts
            stats["cuts_mid_reply"] = proxy.stats.cuts_mid_reply
            stats["append_failures"] = failures[0]
            return dict(stats)
        finally:
            await store.aclose()
            await direct.aclose()
            await check.aclose()


async def test_proxy_drops_and_delays_exactly_once(private_server: ServerProcess) -> None:
    stats = await _proxy_scenario(private_server, CI_SECONDS, seed=3)
    print("proxy chaos:", stats)


@pytest.mark.slow
async def test_proxy_soak(private_server: ServerProcess) -> None:
    stats = await _proxy_scenario(private_server, SLOW_SECONDS, seed=4)
    print("proxy chaos soak:", stats)


# --------------------------------------------------------------------------- retries the client does itself


async def _no_key_appends(store: RedisSessionStore, proxy: FaultProxy, count: int) -> tuple[int, int, Counter[str]]:
    """`count` appends without an idempotency key while replies get lost; returns (ok, failed,
    occurrences of each append in the log)."""
    await store.create(SessionHeader(id="s"))
    proxy.cut_up, proxy.cut_down, proxy.cut_rate = False, True, 0.2
    ok = failed = 0
    for i in range(count):
        try:
            await store.put("s", None, [mark(f"p{i}")])
            ok += 1
        except StoreUnavailableError:
            failed += 1
    proxy.heal()
    occ = Counter(e.data["k"] for e in await store.read("s"))
    return ok, failed, occ


async def test_reply_lost_without_key_never_duplicates_from_url(private_server: ServerProcess) -> None:
    """A reply that never arrives makes an append ambiguous: it raises, and it landed at most once
    (`from_url` clients do not resend commands)."""
    with FaultProxy(private_server.port, seed=5) as proxy:
        store = RedisSessionStore.from_url(proxy.url, client_options={"socket_timeout": 2})
        try:
            ok, failed, occ = await _no_key_appends(store, proxy, 200)
        finally:
            await store.aclose()
    assert failed > 0
    assert max(occ.values()) == 1, f"duplicated appends: {[k for k, c in occ.items() if c > 1][:10]}"
    assert ok <= len(occ) <= ok + failed


async def test_reply_lost_without_key_never_duplicates_user_client(private_server: ServerProcess) -> None:
    with FaultProxy(private_server.port, seed=6) as proxy:
        client = aioredis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=2)  # redis-py defaults
        store = RedisSessionStore(client)
        try:
            ok, _failed, occ = await _no_key_appends(store, proxy, 200)
        finally:
            await client.aclose()
    assert max(occ.values()) == 1, f"{sum(c - 1 for c in occ.values())} duplicate entries from {ok} successful appends"


async def test_reply_lost_with_expected_n_no_false_conflict_user_client(private_server: ServerProcess) -> None:
    from redis_session import SessionConflictError

    with FaultProxy(private_server.port, seed=8) as proxy:
        client = aioredis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=2)
        store = RedisSessionStore(client)
        try:
            await store.create(SessionHeader(id="s"))
            proxy.cut_up, proxy.cut_down, proxy.cut_rate = False, True, 0.2
            n = 0
            false_conflicts = 0
            for i in range(100):
                try:
                    got = await store.put("s", n, [mark(f"p{i}")])
                    n = got[-1].n + 1
                except SessionConflictError as e:
                    # a single writer: any conflict is its own landed write coming back
                    false_conflicts += 1
                    n = e.actual_n
                except StoreUnavailableError:
                    proxy.heal()
                    n = (await store.head("s")).n
                    proxy.cut_rate = 0.2
        finally:
            await client.aclose()
    assert false_conflicts == 0, f"{false_conflicts} appends that landed were reported as conflicts"


async def test_reply_lost_without_key_never_duplicates_on_cluster(local_cluster: Any, prefix: str) -> None:
    """Regression (redis-py's RedisCluster re-sent append.lua after a lost reply: duplicates).

    Proxies in front of every master (redis-py's `address_remap` sends the cluster client
    through them), dropping replies."""
    proxies = [FaultProxy(node.port, seed=i).start() for i, node in enumerate(local_cluster.masters)]
    by_port = {node.port: p for node, p in zip(local_cluster.masters, proxies, strict=True)}

    def remap(address: tuple[str, int]) -> tuple[str, int]:
        host, port = address
        p = by_port.get(port)
        return ("127.0.0.1", p.port) if p is not None else (host, port)

    client = RedisCluster(
        startup_nodes=[ClusterNode("127.0.0.1", local_cluster.masters[0].port)],
        address_remap=remap,
        socket_timeout=2,
    )
    store = RedisSessionStore(client, prefix=prefix)
    try:
        await store.create(SessionHeader(id="s"))
        ok = failed = 0
        occ: Counter[str] = Counter()
        for round_ in range(6):  # until a duplicate shows (or 600 appends found none)
            for p in proxies:
                p.cut_up, p.cut_down, p.cut_rate = False, True, 0.1
            for i in range(100):
                try:
                    await store.put("s", None, [mark(f"p{round_}-{i}")])
                    ok += 1
                except Exception:  # StoreUnavailableError, and the untyped ones (see the test above)
                    failed += 1
            for p in proxies:
                p.heal()
            with anyio.fail_after(30):
                while True:
                    try:
                        occ = Counter(e.data["k"] for e in await store.read("s"))
                        break
                    except Exception:
                        await anyio.sleep(0.05)
            if max(occ.values()) > 1:
                break
    finally:
        await client.aclose()
        for p in proxies:
            p.stop()
        await _drop_cluster_prefix(local_cluster, prefix)
    assert max(occ.values()) == 1, f"{sum(c - 1 for c in occ.values())} duplicate entries ({ok} ok, {failed} failed)"


# --------------------------------------------------------------------------- cancellation


async def test_cancelled_calls_never_desync_the_connection(private_server: ServerProcess) -> None:
    """Calls cancelled mid-flight (a caller's timeout) must not leave a reply unread on a pooled
    connection, or the next caller would read the previous caller's reply."""
    with FaultProxy(private_server.port, seed=9) as proxy:
        store = RedisSessionStore.from_url(proxy.url, client_options={"socket_timeout": 5})
        try:
            for sid in ("a", "b"):
                await store.create(SessionHeader(id=sid), [mark(f"{sid}{i}") for i in range(5)])
            proxy.jitter = 0.02
            rng = random.Random(9)
            landed: list[str] = []
            for i in range(60):
                key = f"c{i}"
                with anyio.move_on_after(rng.uniform(0.0, 0.03)):
                    if i % 3 == 0:
                        await store.put("a", None, [mark(key)], idempotency_key=key)
                        landed.append(key)
                    elif i % 3 == 1:
                        await store.read("b")
                    else:
                        await store.head("a")
                # right after a cancellation, every answer must be the right one
                got_b = await store.read("b")
                assert [e.data["k"] for e in got_b] == [f"b{j}" for j in range(5)]
                head = await store.head("b")
                assert head is not None and head.id == "b" and head.n == 5
            proxy.heal()
            # every cancelled put, retried with its key, lands exactly once
            for i in range(0, 60, 3):
                await store.put("a", None, [mark(f"c{i}")], idempotency_key=f"c{i}")
            occ = Counter(e.data["k"] for e in await store.read("a"))
            assert all(occ[f"c{i}"] == 1 for i in range(0, 60, 3)), occ
            assert max(occ.values()) == 1
        finally:
            await store.aclose()


async def test_failed_writes_do_not_leak_pool_connections(private_server: ServerProcess) -> None:
    """Every write that fails on a killed connection must give its pool slot back; a leak makes
    the store unusable for good ("Too many connections") once the pool's limit is reached."""
    store = RedisSessionStore.from_url(
        private_server.url, client_options={"client_name": "leak", "max_connections": 10}
    )
    try:
        await store.create(SessionHeader(id="s"))
        stop = anyio.Event()
        kills = [0]
        failures = [0]

        async def writer() -> None:
            # until enough writes failed on a killed connection (a connection killed while at
            # rest is connected again before use, so most kills cost no write: not a fixed time)
            end = time.monotonic() + 20.0
            while failures[0] < 20 and time.monotonic() < end:
                try:
                    await store.put("s", None, [mark("x")])
                except StoreUnavailableError:
                    failures[0] += 1
                    await anyio.sleep(0.001)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_killer, private_server.url, "leak", stop, kills)
                async with anyio.create_task_group() as writers:
                    for _ in range(4):
                        writers.start_soon(writer)
                stop.set()
        assert failures[0] >= 20
        pool = store.client.connection_pool
        in_use = len(held(pool))  # in use, less the one kept for the next call
        assert in_use == 0, f"{in_use} connections still checked out after {failures[0]} failed writes"
        assert (await _read_after_faults(store, "s"))[-1].n == (await store.head("s")).n - 1
    finally:
        await store.aclose()
