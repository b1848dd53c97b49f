"""A real Redis Cluster on loopback, from the embedded ``valkey-server`` binary.

For tests, benchmarks and local development: `start_cluster(masters=3, replicas_per_master=1)`
starts the processes, assigns slots (CLUSTER ADDSLOTSRANGE), joins the nodes (CLUSTER MEET),
attaches replicas (CLUSTER REPLICATE) and waits until every node reports ``cluster_state:ok``.
Only plain commands are used, so no ``redis-cli --cluster`` is needed.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from ..redis.embedded import EmbeddedServerError, ServerProcess, start_server
from ..redis.wire import RAW, plain_replies

SLOTS = 16384


def command(port: int, *args: str, timeout: float = 5.0) -> str:
    """Run one command on the node at `port` (a fresh connection, redis-py's parser) and return
    its reply as text; a CLUSTER or INFO reply is one string, ``OK`` for a status reply."""
    # the reply as the server sent it: INFO text, not a dict
    client = plain_replies(redis.Redis(port=port, socket_timeout=timeout, socket_connect_timeout=timeout))
    try:
        reply = client.execute_command(*args, **RAW)
    finally:
        client.close()
    if isinstance(reply, bytes):
        return reply.decode(errors="replace")
    return "OK" if reply is True else str(reply)


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; both must stay below 65536."""
    import random

    for _ in range(200):
        port = random.randint(20000, 45000)
        ok = True
        for p in (port, port + 10000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise EmbeddedServerError("no free port pair for a cluster node")


@dataclass
class LocalCluster:
    """A running local cluster. `url` is a seed node for ``RedisCluster.from_url``."""

    masters: list[ServerProcess]
    replicas: list[ServerProcess]
    base_dir: Path
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    node_args: list[str] = field(default_factory=list)
    appendonly: bool = False

    def restart(self, node: ServerProcess) -> ServerProcess:
        """Start a stopped or killed node again on its port and folder: it rejoins the cluster
        from its nodes.conf (a failed-over master comes back as a replica of its successor)."""
        new = start_server(node.data_dir, port=node.port, appendonly=self.appendonly, extra_args=self.node_args)
        for group in (self.masters, self.replicas):
            for i, n in enumerate(group):
                if n is node:
                    group[i] = new
        return new

    @property
    def nodes(self) -> list[ServerProcess]:
        return self.masters + self.replicas

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.masters[0].port}/0"

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop(timeout=5)
        if self._tmp is not None:
            self._tmp.cleanup()
        else:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def node_info(self, port: int) -> str:
        return command(port, "CLUSTER", "INFO")

    def wait_ok(self, timeout: float = 30.0, ports: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        ports = ports or [n.port for n in self.nodes]
        while True:
            try:
                if all("cluster_state:ok" in self.node_info(p) for p in ports):
                    return
            except (OSError, redis.RedisError):
                pass
            if time.monotonic() > deadline:
                raise EmbeddedServerError("local cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def wait_replicas_synced(self, timeout: float = 30.0) -> None:
        """Until every replica's link to its master is up (WAIT can count it)."""
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            while "master_link_status:up" not in command(r.port, "INFO", "replication"):
                if time.monotonic() > deadline:
                    raise EmbeddedServerError(f"replica on port {r.port} did not sync")
                time.sleep(0.05)

    def master_of_slot(self, slot: int) -> ServerProcess:
        """The node that serves `slot` now (after failovers too)."""
        for node in self.nodes:
            try:
                nodes = command(node.port, "CLUSTER", "NODES")
            except (OSError, redis.RedisError):
                continue
            for line in nodes.splitlines():
                parts = line.split()
                if len(parts) < 9 or "master" not in parts[2] or "fail" in parts[2]:
                    continue
                for rng in parts[8:]:
                    if rng.startswith("["):
                        continue
                    lo, _, hi = rng.partition("-")
                    if int(lo) <= slot <= int(hi or lo):
                        port = int(parts[1].split(":")[1].split("@")[0])
                        return next(n for n in self.nodes if n.port == port)
        raise EmbeddedServerError(f"no master serves slot {slot}")

    def node_id(self, node: ServerProcess) -> str:
        return command(node.port, "CLUSTER", "MYID").strip()

    def begin_migration(self, slot: int, to: ServerProcess) -> ServerProcess:
        """Open a live migration of `slot` to the master `to` (IMPORTING on the target, then
        MIGRATING on the source, as ``redis-cli --cluster reshard`` does); returns the source."""
        source = self.master_of_slot(slot)
        if source is to:
            raise EmbeddedServerError(f"slot {slot} is already served by port {to.port}")
        _expect_ok(command(to.port, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", self.node_id(source)))
        _expect_ok(command(source.port, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", self.node_id(to)))
        return source

    def move_keys(self, slot: int, source: ServerProcess, to: ServerProcess, keys: list[str] | None = None) -> int:
        """MIGRATE `keys` (default: every key the source holds in `slot`) to `to`; how many moved."""
        if keys is None:
            listed = command(source.port, "CLUSTER", "COUNTKEYSINSLOT", str(slot))
            keys = _key_list(source.port, slot, int(listed))
        if keys:
            command(source.port, "MIGRATE", "127.0.0.1", str(to.port), "", "0", "5000", "KEYS", *keys)
        return len(keys)

    def finish_migration(self, slot: int, to: ServerProcess) -> None:
        """Assign `slot` to `to` on every master (the target first, as the docs require)."""
        to_id = self.node_id(to)
        for node in [to, *(m for m in self.masters if m is not to)]:
            _expect_ok(command(node.port, "CLUSTER", "SETSLOT", str(slot), "NODE", to_id))

    def migrate_slot(self, slot: int, to: ServerProcess) -> ServerProcess:
        """A complete slot migration to the master `to`; returns the former owner."""
        source = self.begin_migration(slot, to)
        self.move_keys(slot, source, to)
        self.finish_migration(slot, to)
        return source


def start_cluster(
    masters: int = 3,
    replicas_per_master: int = 1,
    *,
    base_dir: Path | str | None = None,
    appendonly: bool = False,
    node_timeout_ms: int = 2000,
) -> LocalCluster:
    """Start `masters` masters (+ replicas) on free loopback ports and join them into a cluster."""
    tmp = None
    if base_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="rs-cluster-")
        base = Path(tmp.name)
    else:
        base = Path(base_dir)
    started: list[ServerProcess] = []
    node_args = [
        "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(node_timeout_ms),
        "--cluster-require-full-coverage", "no",
        "--cluster-allow-replica-migration", "no",
        "--repl-diskless-sync-delay", "0",  # a replica syncs at once, not after 5 s
    ]  # fmt: skip
    try:
        for i in range(masters * (1 + replicas_per_master)):
            started.append(
                start_server(
                    base / f"node{i}",
                    appendonly=appendonly,
                    port=cluster_port(),
                    extra_args=node_args,
                )
            )
        ms, rs = started[:masters], started[masters:]
        per = SLOTS // masters
        for i, node in enumerate(ms):
            lo = i * per
            hi = SLOTS - 1 if i == masters - 1 else (i + 1) * per - 1
            _expect_ok(command(node.port, "CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi)))
        for node in started[1:]:
            _expect_ok(command(node.port, "CLUSTER", "MEET", "127.0.0.1", str(ms[0].port)))
        cluster = LocalCluster(
            masters=ms, replicas=rs, base_dir=base, _tmp=tmp, node_args=node_args, appendonly=appendonly
        )
        _wait_known(started, ms[0].port)
        for j, replica in enumerate(rs):
            master = ms[j % masters]
            master_id = command(master.port, "CLUSTER", "MYID").strip()
            deadline = time.monotonic() + 15
            while True:
                try:
                    command(replica.port, "CLUSTER", "REPLICATE", master_id)
                    break
                except redis.ResponseError as e:  # the replica does not know the master yet
                    if time.monotonic() > deadline:
                        raise EmbeddedServerError(f"CLUSTER REPLICATE failed: {e}") from e
                time.sleep(0.1)
        cluster.wait_ok()
        cluster.wait_replicas_synced()
        return cluster
    except BaseException:
        for node in started:
            with contextlib.suppress(Exception):
                node.stop(timeout=3)
        if tmp is not None:
            tmp.cleanup()
        raise


def _wait_known(nodes: list[ServerProcess], seed: int, timeout: float = 15.0) -> None:
    """Until every node knows every other. A node whose handshake with the seed timed out (within
    the node timeout, on a loaded machine) forgets it and never retries: it is sent MEET again."""
    deadline = time.monotonic() + timeout
    want = len(nodes)
    next_meet = time.monotonic() + 2.0
    while True:
        counts = []
        for n in nodes:
            info = command(n.port, "CLUSTER", "INFO")
            for line in info.splitlines():
                if line.startswith("cluster_known_nodes:"):
                    counts.append(int(line.split(":")[1]))
        if counts and min(counts) >= want:
            return
        if time.monotonic() > deadline:
            raise EmbeddedServerError(f"cluster nodes did not meet: known={counts}")
        if time.monotonic() >= next_meet:
            next_meet = time.monotonic() + 2.0
            for n, known in zip(nodes, counts, strict=False):
                if known < want and n.port != seed:
                    command(n.port, "CLUSTER", "MEET", "127.0.0.1", str(seed))
        time.sleep(0.05)


def _key_list(port: int, slot: int, count: int) -> list[str]:
    client = redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=5)
    try:
        keys = client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, max(count, 1))  # type: ignore[no-untyped-call]
    finally:
        client.close()
    return [k.decode() if isinstance(k, bytes) else str(k) for k in keys]


def _expect_ok(reply: str) -> None:
    if reply != "OK":
        raise EmbeddedServerError(f"cluster setup command failed: {reply!r}")


def main() -> None:  # pragma: no cover - a manual helper
    """`python -m redis_session.testing.localcluster`: start a cluster and print its seed URL until Ctrl-C."""
    c = start_cluster()
    print(c.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        c.stop()


if __name__ == "__main__":  # pragma: no cover
    main()
