"""Bad input: a fuzz-style corpus against put, create, read and head on the memory
store, a Redis server and the Redis Cluster.

The policy this asserts (what the package does, checked to be consistent across backends):

- bad entries, batches, expected_n, idempotency keys, headers  -> `InvalidEntryError`
  (a `SessionError` and a `ValueError`);
- bad session ids (type, length, braces, whitespace, control characters) -> `InvalidSessionIdError`;
- bad read ranges -> `ValueError`; an entries argument that is not iterable at all -> `TypeError`;
- anything else is a clean success that reads back exactly what was written.

Never a crash of another kind, a hang, a partial write (a rejected call changes nothing), or a
key outside its session's slot (cluster: every key of a session hashes to CLUSTER KEYSLOT of its
hash tag).
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from redis_session import (
    InvalidEntryError,
    InvalidSessionIdError,
    MemorySessionStore,
    NewEntry,
    RedisSessionStore,
    SessionHeader,
    SessionNotFoundError,
)

pytestmark = pytest.mark.anyio

rng = random.Random(8)
RANDOM_BYTES = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(12)]
RANDOM_TEXT = [b.decode("latin-1") for b in RANDOM_BYTES]

LUA_LOOKING = [
    "]] redis.call('FLUSHALL') --",
    "'); redis.call('FLUSHALL'); --",
    "%d%s%n%x%%",
    "\0",
    "a\0b",
    "\\",
    '"',
    "\r\n*1\r\n$8\r\nFLUSHALL\r\n",
]
UNICODE = [
    "\u202eevil\u202c",  # RTL override
    "zero\u200bwidth\u200d",
    "line\u2028sep\u2029",
    "e\u0301\u0301\u0301",  # combining marks
    "🎨" * 50,
    "\U0010ffff",
    "\ufeffbom",
]
SURROGATES = ["\ud800", "a\udfffb", "\udc80\udc80"]


def deep(levels: int) -> Any:
    d: Any = "bottom"
    for _ in range(levels):
        d = {"a": d}
    return d


def deep_list(levels: int) -> Any:
    d: Any = 0
    for _ in range(levels):
        d = [d]
    return d


async def snapshot(store: Any, sid: str) -> Any:
    head = await store.head(sid)
    return head, (await store.read(sid) if head is not None else None)


async def attempt(call: Any) -> tuple[str, Any]:
    """("ok", value) or ("err", the exception); a hang fails the test."""
    try:
        with anyio.fail_after(60):
            return "ok", await call()
    except (InvalidEntryError, InvalidSessionIdError, SessionNotFoundError, ValueError, TypeError) as e:
        return "err", e


def expect(outcome: tuple[str, Any], wanted: type[BaseException] | None, what: str) -> None:
    kind, value = outcome
    if wanted is None:
        assert kind == "ok", f"{what}: expected success, got {value!r}"[:400]
    else:
        assert kind == "err", f"{what}: expected {wanted.__name__}, got success {value!r}"[:400]
        assert isinstance(value, wanted), f"{what}: expected {wanted.__name__}, got {type(value).__name__}: {value}"


# --------------------------------------------------------------------------- the corpus

# (name, data) that must be rejected as entry data
BAD_DATA: list[tuple[str, Any]] = [
    *[(f"bytes{i}", b) for i, b in enumerate(RANDOM_BYTES[:4])],
    *[(f"bytes-in-dict{i}", {"x": b}) for i, b in enumerate(RANDOM_BYTES[:4])],
    *[(f"surrogate{i}", {"content": s}) for i, s in enumerate(SURROGATES)],
    ("surrogate-key", {"\ud800": 1}),
    ("deep-10000", deep(10_000)),
    ("deep-list-10000", {"x": deep_list(10_000)}),
    ("huge", {"content": "x" * (1 << 20)}),
    ("int-key", {1: 2}),
    ("nan", {"x": float("nan")}),
    ("str", "just a string"),
    ("list", [1, 2]),
    ("none", None),
    ("int", 5),
]

# (name, data) that must be stored and read back verbatim
GOOD_DATA: list[tuple[str, Any]] = [
    *[(f"text{i}", {"s": t}) for i, t in enumerate(RANDOM_TEXT)],
    *[(f"lua{i}", {"s": t, t: t}) for i, t in enumerate(LUA_LOOKING)],
    *[(f"unicode{i}", {"s": t, t: [t]}) for i, t in enumerate(UNICODE)],
    ("deep-100", deep(100)),
    ("big", {"content": "y" * 900_000}),
    ("empty", {}),
    ("int64", {"x": (1 << 63) - 1, "y": -(1 << 63)}),
    ("floats", {"x": 1e308, "y": -0.0, "z": 5e-324}),
    ("bigint", {"x": 1 << 70, "y": -(1 << 100)}),  # JSON has no integer limit; msgspec keeps them exact
]

BAD_TYPES: list[Any] = [
    *RANDOM_BYTES[:3],
    *RANDOM_TEXT[:3],
    *LUA_LOOKING,
    *UNICODE[:3],
    *SURROGATES,
    "",
    "x" * 129,
    None,
    5,
    ["user/message"],
]

BAD_IDS: list[Any] = [
    *RANDOM_BYTES[:3],
    *[t for t in RANDOM_TEXT if any(c in t for c in "{} \t\n\r\x00\x7f") or not t][:3],
    LUA_LOOKING[0],
    LUA_LOOKING[1],
    "\0",
    "a\0b",
    "line\u2028sep",
    "nb\u00a0sp",
    "{tag}",
    "",
    "x" * 257,
    None,
    5,
    ["a"],
]

GOOD_IDS: list[str] = [
    "%d%s%n%x%%",
    "\\",
    '"quoted"',
    "e\u0301",
    "🎨" * 10,
    "\U0010ffff",
    "x" * 256,
    "a:b:c/d",
    "--",
    "'); redis.call('FLUSHALL'); --".replace(" ", ""),
]

BAD_EXPECTED_N: list[Any] = ["0", 0.0, True, False, -1, [0], {"n": 0}, 1.5]
BAD_ENTRIES_VALUE: list[Any] = [
    {"type": "user/message", "data": {"content": "x"}},  # a mapping, not a sequence of entries
    "user/message",
    b"bytes",
    [["user/message", {"content": "x"}]],  # a list is not an entry tuple
    [("user/message",)],
    [("user/message", {"content": "x"}, None, None, None, "extra")],
    [{"type": "user/message"}],
    [{"tipe": "user/message", "data": {}}],
    [None],
    [5],
    [NewEntry("user/message", {"content": "x"}, meta="not a dict")],
    [NewEntry("user/message", {"content": "x"}, meta=[1])],
    [NewEntry("user/message", {"content": "x"}, time=-1)],
    [NewEntry("user/message", {"content": "x"}, time=1.5)],  # type: ignore[arg-type]
    [NewEntry("user/message", {"content": "x"}, time=True)],  # type: ignore[arg-type]
    [NewEntry("user/message", {"content": "x"}, time=1 << 60)],
    [NewEntry("user/message", {"content": "x"}, surface="append")],
]
NOT_ITERABLE_ENTRIES: list[Any] = [None, 5, 1.5]
BAD_IDEM_KEYS: list[Any] = ["", "k" * 257, 5, b"key", ["k"]]
BAD_RANGES: list[tuple[Any, Any]] = [
    (-1, None),
    ("0", None),
    (0, "5"),
    (1.5, None),
    (0, -1),
    (None, None),
    (True, None),
]


# --------------------------------------------------------------------------- put


async def test_put_bad_data_rejected_nothing_written(store: Any) -> None:
    await store.create(SessionHeader(id="s"), [NewEntry("user/message", {"content": "seed"})])
    before = await snapshot(store, "s")
    for name, data in BAD_DATA:
        for entry_type in ("custom/mark", "user/message"):
            outcome = await attempt(
                lambda d=data, t=entry_type: store.put(
                    "s", 1, [NewEntry("user/message", {"content": "ok"}), NewEntry(t, d)]
                )
            )
            expect(outcome, InvalidEntryError, f"put data {name} as {entry_type}")
            assert await snapshot(store, "s") == before, f"{name}: partial write"


async def test_put_good_data_round_trips(store: Any) -> None:
    await store.create(SessionHeader(id="s"))
    n = 0
    for name, data in GOOD_DATA:
        outcome = await attempt(lambda d=data, n=n: store.put("s", n, [NewEntry("custom/mark", d)]))
        expect(outcome, None, f"put data {name}")
        [stored] = outcome[1]
        assert stored.data == data, name
        [read] = await store.read("s", n, n + 1)
        assert read.data == data and read.n == n, f"{name}: read back differs"
        n += 1
    assert (await store.head("s")).n == n


async def test_bad_types_rejected(store: Any) -> None:
    await store.create(SessionHeader(id="s"))
    for t in BAD_TYPES:
        expect(await attempt(lambda t=t: store.put("s", 0, [NewEntry(t, {})])), InvalidEntryError, f"type {t!r}")
        expect(
            await attempt(lambda t=t: store.create(SessionHeader(id="c"), [NewEntry(t, {})])),
            InvalidEntryError,
            f"create type {t!r}",
        )
    assert (await store.head("s")).n == 0
    assert await store.head("c") is None


async def test_wrong_argument_types(store: Any) -> None:
    await store.create(SessionHeader(id="s"), [NewEntry("user/message", {"content": "seed"})])
    before = await snapshot(store, "s")
    ok_entry = [NewEntry("user/message", {"content": "x"})]
    for bad in BAD_EXPECTED_N:
        expect(await attempt(lambda b=bad: store.put("s", b, ok_entry)), InvalidEntryError, f"expected_n={bad!r}")
    for bad in BAD_ENTRIES_VALUE:
        expect(await attempt(lambda b=bad: store.put("s", 1, b)), InvalidEntryError, f"entries={bad!r}")
        expect(
            await attempt(lambda b=bad: store.create(SessionHeader(id="c"), b)),
            InvalidEntryError,
            f"create entries={bad!r}",
        )
    for bad in NOT_ITERABLE_ENTRIES:
        expect(await attempt(lambda b=bad: store.put("s", 1, b)), InvalidEntryError, f"entries={bad!r}")
    for bad in BAD_IDEM_KEYS:
        expect(
            await attempt(lambda b=bad: store.put("s", 1, ok_entry, idempotency_key=b)),
            InvalidEntryError,
            f"idempotency_key={bad!r}",
        )
    for start, stop in BAD_RANGES:
        expect(await attempt(lambda a=start, b=stop: store.read("s", a, b)), ValueError, f"read({start!r}, {stop!r})")
    assert await snapshot(store, "s") == before
    assert await store.head("c") is None


async def test_batch_limit(store: Any) -> None:
    await store.create(SessionHeader(id="s"))
    limit = store.max_batch
    too_many = (NewEntry("custom/mark", {}) for _ in range(limit + 1))  # a generator: never materialised whole
    expect(await attempt(lambda: store.put("s", 0, too_many)), InvalidEntryError, "batch over max_batch")
    assert (await store.head("s")).n == 0


# --------------------------------------------------------------------------- ids


async def test_hostile_ids_rejected(store: Any) -> None:
    await store.create(SessionHeader(id="ok"))
    for sid in BAD_IDS:
        what = f"id {sid!r}"[:60]
        expect(await attempt(lambda s=sid: store.head(s)), InvalidSessionIdError, f"head {what}")
        expect(await attempt(lambda s=sid: store.read(s)), InvalidSessionIdError, f"read {what}")
        expect(await attempt(lambda s=sid: store.put(s, 0, [NewEntry("m", {})])), InvalidSessionIdError, f"put {what}")
        expect(await attempt(lambda s=sid: store.create(SessionHeader(id=s))), InvalidSessionIdError, f"create {what}")
        if sid is not None:  # parent=None is no branch at all
            expect(
                await attempt(lambda s=sid: store.create(SessionHeader(id="kid", parent=s, at=0))),
                InvalidSessionIdError,
                f"branch of {what}",
            )
    assert [h.id for h in (await store.list()).items] == ["ok"]


async def test_odd_but_legal_ids_work_and_stay_in_their_slot(
    store: Any, prefix: str, request: pytest.FixtureRequest
) -> None:
    for i, sid in enumerate(GOOD_IDS):
        await store.create(SessionHeader(id=sid, created_at=1000 + i), [NewEntry("user/message", {"content": sid})])
        await store.put(sid, 1, [NewEntry("custom/mark", {"id": sid})], idempotency_key=sid[:256])
        assert [e.data for e in await store.read(sid)] == [{"content": sid}, {"id": sid}]
        head = await store.head(sid)
        assert head is not None and head.id == sid and head.n == 2
    listed = []
    cursor = None
    while True:
        page = await store.list(limit=5, cursor=cursor)
        listed += [h.id for h in page.items]
        cursor = page.cursor
        if cursor is None:
            break
    assert listed == list(reversed(GOOD_IDS))
    if isinstance(store, RedisSessionStore) and store.cluster:
        await assert_keys_in_their_slot(request.getfixturevalue("local_cluster"), prefix, GOOD_IDS)


FORMAT_IDS = ["\u202eevil\u202c", "zero\u200bwidth", "\ufeffbom", "a\u2066b\u2069"]  # Unicode Cf: look like others


async def test_new_ids_with_format_characters_are_refused_and_nothing_is_written(store: Any) -> None:
    for sid in FORMAT_IDS:
        expect(await attempt(lambda s=sid: store.create(SessionHeader(id=s))), InvalidSessionIdError, f"create {sid!r}")
        assert await store.head(sid) is None  # reading such an id is fine: an old session may hold it
    assert (await store.list()).items == []


async def test_surrogate_ids_rejected_consistently(store: Any) -> None:
    for sid in SURROGATES:
        expect(await attempt(lambda s=sid: store.create(SessionHeader(id=s))), InvalidSessionIdError, f"create {sid!r}")
        expect(await attempt(lambda s=sid: store.head(s)), InvalidSessionIdError, f"head {sid!r}")


# --------------------------------------------------------------------------- headers


BAD_HEADERS: list[dict[str, Any]] = [
    {"parent": "p"},  # parent without at
    {"at": 0},  # at without parent
    {"parent": "p", "at": -1},
    {"parent": "p", "at": "0"},
    {"parent": "p", "at": 1.0},
    {"parent": "p", "at": 99},  # beyond the parent's n
    {"title": 5},
    {"title": b"bytes"},
    {"origin": float("nan")},
    {"origin": {1: 2}},
    {"origin": b"x"},
    {"delegation_depth": -1},
    {"delegation_depth": "1"},
]

BAD_CREATED_AT: list[dict[str, Any]] = [
    {"created_at": "x"},
    {"created_at": 1.5},
    {"created_at": -5},
    {"created_at": 1 << 70},
    {"format_version": "one"},
]


async def test_bad_headers_rejected(store: Any) -> None:
    await store.create(SessionHeader(id="p"), [NewEntry("user/message", {"content": "x"})])
    for fields in BAD_HEADERS:
        outcome = await attempt(lambda f=fields: store.create(SessionHeader(id="c", **f)))
        expect(outcome, InvalidEntryError, f"header {fields}")
        assert await store.head("c") is None
    assert (await store.list(parent="p")).items == []


async def test_bad_created_at_rejected(store: Any) -> None:
    for fields in BAD_CREATED_AT:
        outcome = await attempt(lambda f=fields: store.create(SessionHeader(id="c", **f)))
        expect(outcome, InvalidEntryError, f"header {fields}")
        assert await store.head("c") is None
        await store.list()


# --------------------------------------------------------------------------- limits


async def test_limits_one_request_cannot_exceed(store: Any) -> None:
    """Entry size, batch size and read range are bounded per request."""
    from redis_session.store import MAX_READ_RANGE

    await store.create(SessionHeader(id="s"))
    limit = store.max_entry_bytes
    # the size counts the encoded entry: just under the limit passes, just over fails
    expect(
        await attempt(lambda: store.put("s", 0, [NewEntry("m", {"c": "x" * (limit - 100)})])),
        None,
        "entry under the limit",
    )
    expect(
        await attempt(lambda: store.put("s", 1, [NewEntry("m", {"c": "x" * limit})])),
        InvalidEntryError,
        "entry over the limit",
    )
    expect(
        await attempt(lambda: store.put("s", 1, [NewEntry("m", {"c": "x"}, {"m": "y" * limit})])),
        InvalidEntryError,
        "meta over the limit",
    )
    # many entries each under the limit, a batch over the batch limit
    expect(
        await attempt(lambda: store.put("s", 1, [NewEntry("m", {})] * (store.max_batch + 1))),
        InvalidEntryError,
        "batch over the limit",
    )
    assert (await store.head("s")).n == 1
    # a read range over MAX_READ_RANGE is refused up front (an open-ended read is paged instead)
    outcome = await attempt(lambda: store.read("s", 0, MAX_READ_RANGE + 1))
    expect(outcome, ValueError, "read range over MAX_READ_RANGE")


async def test_memory_store_enforces_the_same_limits() -> None:
    from redis_session.store import MAX_READ_RANGE

    store = MemorySessionStore(max_entry_bytes=1000)
    await store.create(SessionHeader(id="s"))
    expect(await attempt(lambda: store.read("s", 0, MAX_READ_RANGE + 1)), ValueError, "read range")
    expect(await attempt(lambda: store.set_draft("s", {"c": "x" * 1000})), InvalidEntryError, "draft")


async def test_small_limits_are_configurable(redis_url: str, prefix: str) -> None:
    mem = MemorySessionStore(max_entry_bytes=1000, max_batch=3)
    red = RedisSessionStore.from_url(redis_url, prefix=prefix, max_entry_bytes=1000, max_batch=3)
    try:
        for store in (mem, red):
            await store.create(SessionHeader(id="s"))
            expect(
                await attempt(lambda s=store: s.put("s", 0, [NewEntry("m", {"c": "x" * 1000})])),
                InvalidEntryError,
                "entry",
            )
            expect(await attempt(lambda s=store: s.put("s", 0, [NewEntry("m", {})] * 4)), InvalidEntryError, "batch")
            expect(await attempt(lambda s=store: s.put("s", 0, [NewEntry("m", {})] * 3)), None, "batch at the limit")
        expect(await attempt(lambda: red.set_draft("s", {"c": "x" * 1000})), InvalidEntryError, "draft")
    finally:
        await red.aclose()
        from support import cleanup_prefix

        await cleanup_prefix(redis_url, prefix)


# --------------------------------------------------------------------------- cluster slots


async def assert_keys_in_their_slot(cluster: Any, prefix: str, sids: list[str]) -> None:
    """Every key under `prefix` on every master hashes to the slot of its session's hash tag."""
    first = aioredis.Redis.from_url(cluster.masters[0].url)
    try:
        wanted = {}
        for sid in sids:
            wanted[sid] = await first.execute_command("CLUSTER", "KEYSLOT", f"{{{sid}}}")
        seen = 0
        for node in cluster.masters:
            r = aioredis.Redis.from_url(node.url)
            try:
                async for key in r.scan_iter(match=f"{prefix}:*", count=1000):
                    k = key.decode()
                    slot = await r.execute_command("CLUSTER", "KEYSLOT", key)
                    if k.startswith(f"{prefix}:{{") and k.count("}") == 1 and not k.startswith(f"{prefix}:feed:"):
                        sid = k[len(prefix) + 2 : k.rindex("}")]
                        assert sid in wanted, f"a key of an unknown session: {k!r}"
                        assert slot == wanted[sid], f"{k!r} is in slot {slot}, its session in {wanted[sid]}"
                        seen += 1
            finally:
                await r.aclose()
        assert seen >= 2 * len(sids)
    finally:
        await first.aclose()


async def test_cluster_writes_of_a_corpus_stay_in_slot(cluster_url: str, local_cluster: Any, prefix: str) -> None:
    store = RedisSessionStore.from_url(cluster_url, prefix=prefix, cluster=True)
    sids = []
    try:
        for i, sid in enumerate(
            [
                *GOOD_IDS[:6],
                *[t for t in RANDOM_TEXT if not any(c in t for c in "{} \t\n\r\x00\x7f\x85\xa0") and t.isprintable()][
                    :4
                ],
            ]
        ):
            try:
                await store.create(SessionHeader(id=sid, created_at=1 + i))
            except InvalidSessionIdError:
                continue
            sids.append(sid)
            await store.put(sid, 0, [NewEntry("custom/mark", {"s": t}) for t in LUA_LOOKING])
            await store.create(SessionHeader(id=f"{sid}:b", parent=sid, at=2))
            sids.append(f"{sid}:b")
            await store.set_draft(sid, {"t": "draft"})
            await store.acquire_lease(sid, "tok", 5_000)
        await assert_keys_in_their_slot(local_cluster, prefix, sids)
    finally:
        await store.aclose()
        for node in local_cluster.masters:
            r = aioredis.Redis.from_url(node.url)
            try:
                async for k in r.scan_iter(match=f"{prefix}:*", count=1000):
                    await r.delete(k)
            finally:
                await r.aclose()


# --------------------------------------------------------------------------- import and gateway


def _import_corpus(d: Any) -> list[Any]:
    """Files an importer must refuse cleanly (or accept whole)."""
    import json

    files = []

    def w(name: str, content: bytes) -> None:
        p = d / name
        p.write_bytes(content)
        files.append(p)

    for i, b in enumerate(RANDOM_BYTES[:6]):
        w(f"bytes{i}.jsonl", b)
    w("empty.jsonl", b"")
    w("blank-lines.jsonl", b"\n\n\n")
    w("not-json.jsonl", b"{not json}\n")
    w("array.jsonl", b"[1,2,3]\n")
    w("huge-line.jsonl", json.dumps({"type": "user/message", "data": {"content": "x" * (2 << 20)}}).encode() + b"\n")
    w("nan.jsonl", b'{"role": "user", "content": NaN}\n')
    w("surrogate.jsonl", b'{"role": "user", "content": "\\ud800"}\n')
    w("lua.jsonl", json.dumps({"role": "user", "content": LUA_LOOKING[0]}).encode() + b"\n")
    w("wrong-types.jsonl", b'{"role": 5, "content": {"a": 1}}\n{"role": "user", "content": null}\n')
    w("hostile-id.jsonl", json.dumps({"id": "a{b}", "format_version": 1}).encode() + b"\n")
    w("bom.jsonl", "\ufeff".encode() + b'{"role": "user", "content": "hi"}\n')
    w("crlf.jsonl", b'{"role": "user", "content": "hi"}\r\n{"role": "assistant", "content": "yo"}\r\n')
    return files


async def test_import_corpus_refused_cleanly_or_imported_whole(store: Any, tmp_path: Any) -> None:
    importers = pytest.importorskip("redis_session.importers")
    for i, path in enumerate(_import_corpus(tmp_path)):
        sid = f"imp{i}"
        before = [h.id for h in (await store.list()).items]
        try:
            with anyio.fail_after(60):
                results = await importers.import_path(store, path, session_id=sid)
        except (importers.ImportFormatError, InvalidEntryError, InvalidSessionIdError) as e:
            assert await store.head(sid) is None, f"{path.name}: refused ({e}) but a session was left behind"
            assert [h.id for h in (await store.list()).items] == before, f"{path.name}: partial import"
            continue
        for r in results:  # accepted: the whole file, readable back
            head = await store.head(r.session_id) if hasattr(r, "session_id") else await store.head(sid)
            assert head is not None, f"{path.name}: imported but not there"
            assert len(await store.read(head.id)) == head.n


async def test_import_deeply_nested_line_is_a_format_error(tmp_path: Any) -> None:
    importers = pytest.importorskip("redis_session.importers")
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 10_000 + "]" * 10_000 + "\n")
    store = MemorySessionStore()
    with pytest.raises(importers.ImportFormatError):
        await importers.import_path(store, path, session_id="deep")
    assert await store.head("deep") is None


async def test_gateway_hostile_requests_are_client_errors(redis_store: RedisSessionStore) -> None:
    gateway = pytest.importorskip("redis_session.gateway")
    httpx = pytest.importorskip("httpx")
    await redis_store.create(SessionHeader(id="ok"), [NewEntry("user/message", {"content": "x"})])
    app = gateway.create_app(redis_store)
    paths = [
        "/sessions/%7Bx%7D",
        "/sessions/%00",
        "/sessions/a%20b",
        "/sessions/%ED%A0%80",  # a UTF-8-encoded surrogate
        "/sessions/%FF%FE",
        "/sessions/" + "x" * 5000,
        "/sessions/ok/entries?start=-1",
        "/sessions/ok/entries?start=abc",
        "/sessions/ok/entries?start=1e9",
        "/sessions/ok/entries?start=99999999999999999999999",
        "/sessions/ok/entries?stop=-5",
        "/sessions/ok/entries?limit=0",
        "/sessions/ok/entries?limit=100000000",
        "/sessions/ok/nope",
        "/sessions/ok/entries/extra",
        "/sessions?limit=-1",
        "/sessions?limit=abc",
        "/sessions?cursor=" + "%7B" * 500,
        "/sessions/ghost",
        "/sessions/ghost/entries",
        "/sessions/%5D%5D%20redis.call('FLUSHALL')%20--",
    ]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        for path in paths:
            with anyio.fail_after(60):
                r = await client.get(path)
            assert 400 <= r.status_code < 500, f"GET {path[:80]} -> {r.status_code}: {r.text[:200]}"
        r = await client.get("/sessions/ok/entries")
        assert r.status_code == 200
    assert (await redis_store.head("ok")).n == 1
