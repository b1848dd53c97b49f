"""The LangGraph checkpointer against LangGraph's SQLite one: put, get and list throughput.

    python bench/langgraph_saver.py [--url URL] [--seconds N]

(Not named ``langgraph.py``: run as a script, that name would shadow the langgraph package.)

Sides: `RedisEventSaver` on a private valkey-server (AOF off; or --url), and
``AsyncSqliteSaver`` (langgraph-checkpoint-sqlite) on a temporary file, each through its async API,
in interleaved rounds so load drift hits both alike. The checkpoints are LangGraph-shaped: a
``messages`` channel that grows by a message per step (a new blob each time), two small channels,
metadata with source/step/parents.

- put: `aput` of the next checkpoint of a thread (parent = the previous one) plus `aput_writes`
  of two pending writes, as a graph step does;
- get: `aget_tuple` of a 50-checkpoint thread's latest checkpoint (a warm saver: the one that
  wrote it);
- get cold: the same from a new saver each time (ours then reads and folds the whole log);
- list: `alist(thread, limit=10)`.
Needs the ``langgraph`` and ``langgraph-test`` extras. A bench prints numbers; it asserts nothing.
"""

from __future__ import annotations

import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from _common import Timer, bench_args, drop_prefix, interleave, print_table, server, settle_gc, unique_prefix
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from redis_session import RedisSessionStore
from redis_session.adapters.langgraph import RedisEventSaver

TEXT = "The quick brown fox jumps over the lazy dog; " * 3


class Thread:
    """One thread's checkpoint chain on one saver, stepped like a graph run."""

    def __init__(self, saver: Any, thread_id: str) -> None:
        self.saver = saver
        self.config: Any = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
        self.messages: list[Any] = []
        self.versions: dict[str, Any] = {}
        self.step = 0

    async def put(self) -> None:
        self.step += 1
        role = HumanMessage if self.step % 2 else AIMessage
        self.messages = [*self.messages[-20:], role(f"{self.step} {TEXT}", id=str(uuid.uuid4()))]
        cp = empty_checkpoint()
        new = {}
        for ch in ("messages", "branch:to:agent") if self.step > 1 else ("messages", "branch:to:agent", "counter"):
            new[ch] = self.saver.get_next_version(self.versions.get(ch), None)
        self.versions.update(new)
        cp["channel_versions"] = dict(self.versions)
        cp["channel_values"] = {"messages": list(self.messages), "branch:to:agent": None, "counter": self.step}
        cp["versions_seen"] = {"agent": {"branch:to:agent": self.versions["branch:to:agent"]}}
        metadata: Any = {"source": "loop", "step": self.step, "parents": {}}
        self.config = await self.saver.aput(self.config, cp, metadata, new)
        await self.saver.aput_writes(self.config, [("messages", self.messages[-1:]), ("branch:to:agent", None)], "t1")


async def main(url: str, seconds: float) -> None:
    prefix = unique_prefix()
    store = RedisSessionStore.from_url(url, prefix=prefix)
    with tempfile.TemporaryDirectory(prefix="lg-bench-") as d:
        try:
            async with AsyncSqliteSaver.from_conn_string(str(Path(d) / "cp.sqlite")) as sqlite:
                ours = RedisEventSaver(store)
                sides = {"redis-session": ours, "sqlite": sqlite}
                # a 50-checkpoint thread on each side for get and list
                fixed: dict[str, Thread] = {}
                for name, saver in sides.items():
                    t = fixed[name] = Thread(saver, "fixed")
                    for _ in range(50):
                        await t.put()
                writers = {name: Thread(saver, "writer") for name, saver in sides.items()}
                settle_gc()
                rows = []
                share = seconds / 4

                def timers(op: str) -> dict[str, Timer]:
                    return {name: Timer(f"{op} {name}") for name in sides}

                scenarios: dict[str, dict[str, Any]] = {
                    "put (+2 writes)": {name: writers[name].put for name in sides},
                    "get latest": {
                        name: (lambda s=s, t=fixed[name]: s.aget_tuple(t.config)) for name, s in sides.items()
                    },
                    "get latest, cold saver": {
                        "redis-session": lambda: RedisEventSaver(store).aget_tuple(fixed["redis-session"].config),
                        "sqlite": lambda: sqlite.aget_tuple(fixed["sqlite"].config),
                    },
                    "list limit=10": {
                        name: (
                            lambda s=s, t=fixed[name]: _collect(
                                s.alist({"configurable": t.config["configurable"]}, limit=10)
                            )
                        )
                        for name, s in sides.items()
                    },
                }
                for label, ops in scenarios.items():
                    ts = timers(label)
                    await interleave([(ts[name], ops[name]) for name in sides], share)
                    ours_t, base_t = ts["redis-session"], ts["sqlite"]
                    rows.append(
                        (
                            label,
                            ours_t.ops_per_s,
                            base_t.ops_per_s,
                            ours_t.ops_per_s / base_t.ops_per_s,
                            ours_t.median_ms,
                            base_t.median_ms,
                        )
                    )
                print_table(["op", "ours ops/s", "sqlite ops/s", "ratio", "ours p50 ms", "sqlite p50 ms"], rows)
        finally:
            await store.aclose()
            await drop_prefix(url, prefix)


async def _collect(it: Any) -> list[Any]:
    return [x async for x in it]


if __name__ == "__main__":
    args = bench_args("LangGraph checkpointer: RedisEventSaver vs AsyncSqliteSaver", seconds=8.0).parse_args()
    with server(args.url) as url:
        anyio.run(main, url, args.seconds)
