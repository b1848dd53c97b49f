"""nanobot 0.3.5's sessions on our store against nanobot's own JSONL store: save a turn, load.

    python bench/nanobot_store.py [--url URL] [--seconds N]

Sides: `RedisNanobotStore` on a private valkey-server (AOF off; or --url) and nanobot's
``JsonlSessionStore`` on a temporary folder, both through nanobot's ``SessionStore`` calls, in
interleaved rounds so load drift hits both alike, for a session of 100 and of 2 000 messages:

- save: a turn (a user and an assistant message) added to the session, then ``save`` (nanobot's
  file store rewrites the whole file; ours appends the two messages and a state mark);
- load warm: ``load`` by the store that wrote the session (ours folds only what is new);
- load cold: ``load`` by a store that has read nothing yet (ours reads and folds the whole log; its
  connections warm).

Needs the ``nanobot`` extra. A bench prints numbers; it asserts nothing.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from _common import Timer, bench_args, drop_prefix, interleave, print_table, server, settle_gc, unique_prefix
from nanobot.session.manager import JsonlSessionStore, Session

from redis_session import RedisSessionStore
from redis_session.adapters.nanobot_store import RedisNanobotStore

TEXT = "The quick brown fox jumps over the lazy dog; " * 4


def forget(store: RedisNanobotStore) -> RedisNanobotStore:
    """The store with nothing folded yet (as in a new process; its connections stay warm)."""
    store._folds.clear()
    return store


def seeded(key: str, n: int) -> Session:
    s = Session(key=key)
    for i in range(n // 2):
        s.add_message("user", f"{i} {TEXT}")
        s.add_message("assistant", f"{i} {TEXT}", latency_ms=12)
    return s


async def main() -> None:
    args = bench_args(__doc__ or "").parse_args()
    with server(args.url) as url, tempfile.TemporaryDirectory(prefix="nb-bench-") as tmp:
        prefix = unique_prefix()
        jsonl = JsonlSessionStore(Path(tmp) / "ws", sessions_root=Path(tmp) / "sessions")
        ours = RedisNanobotStore(RedisSessionStore.from_url(url, prefix=prefix))
        rows: list[list[Any]] = []
        try:
            for size in (100, 2000):
                mine, theirs = seeded(f"bench:{size}", size), seeded(f"bench:{size}", size)
                ours.save(mine)
                jsonl.save(theirs)
                settle_gc()

                def turn(store: Any, s: Session) -> Any:
                    async def op() -> None:
                        s.add_message("user", TEXT)
                        s.add_message("assistant", TEXT)
                        store.save(s)

                    return op

                def load(make: Any, key: str) -> Any:
                    async def op() -> None:
                        make().load(key)

                    return op

                scenarios = [
                    ("save", turn(jsonl, theirs), turn(ours, mine)),
                    ("load warm", load(lambda: jsonl, mine.key), load(lambda: ours, mine.key)),
                    (
                        "load cold",
                        load(
                            lambda: JsonlSessionStore(Path(tmp) / "ws", sessions_root=Path(tmp) / "sessions"), mine.key
                        ),
                        load(lambda: forget(ours), mine.key),
                    ),
                ]
                for name, theirs_op, ours_op in scenarios:
                    a, b = Timer("jsonl"), Timer("redis")
                    await interleave([(a, theirs_op), (b, ours_op)], args.seconds / 3, warmup_ops=5)
                    rows.append([f"{name} ({size} msgs)", a.median_ms, b.median_ms, a.median_ms / b.median_ms])
        finally:
            await drop_prefix(url, prefix)
        print_table(["scenario", "jsonl p50 ms", "redis p50 ms", "jsonl/redis"], rows)


if __name__ == "__main__":
    anyio.run(main)
