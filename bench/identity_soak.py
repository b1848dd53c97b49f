"""The cross-surface identity soak: many long seeded programs of `tests/reliability/identity_model.py`
(handle, OpenAI Agents, LangChain, HTTP and lossy-store writers; follow, SSE and resuming SSE
readers; cancellations, lost replies; delete + re-create with as many entries), and what held.

    python bench/identity_soak.py [--url URL] [--programs N] [--steps N]

Prints per run the operations, the faults injected and the violations found (goal: none).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from _common import drop_prefix, server
from reliability._proxy import FaultProxy
from reliability.identity_model import Run, http_client

from redis_session import RedisSessionStore

from support import running_gateway


async def one(url: str, seed: int, steps: int) -> Run:
    prefix = f"soak{uuid.uuid4().hex[:8]}"
    parts = urlsplit(url)
    store = RedisSessionStore.from_url(url, prefix=prefix)
    try:
        with FaultProxy(parts.port or 6379, seed=seed) as proxy:
            db = parts.path.lstrip("/") or "0"
            lossy = RedisSessionStore.from_url(f"redis://127.0.0.1:{proxy.port}/{db}", prefix=prefix)
            try:
                async with running_gateway(store) as base, http_client(base) as http:
                    run = Run(store, lossy, proxy, http, seed)
                    await run.go(steps)
            finally:
                await lossy.aclose()
    finally:
        await store.aclose()
        await drop_prefix(url, prefix)
    return run


async def main(url: str, programs: int, steps: int) -> int:
    total: Counter[str] = Counter()
    violations = 0
    t0 = time.perf_counter()
    for seed in range(programs):
        run = await one(url, 1000 + seed, steps)
        problems = run.check()
        violations += len(problems)
        s = run.stats
        total.update(
            steps=s.steps, recreations=s.recreations, lost_replies=s.lost_replies,
            cancellations=s.cancellations, readers=s.readers, entries_read=s.entries_read,
            **{f"writes_{k}": v for k, v in s.writes.items()},
            **{f"by_{k}": v for k, v in s.by_surface.items()},
        )  # fmt: skip
        for p in problems[:5]:
            print(f"  seed {1000 + seed}: {p}")
    dt = time.perf_counter() - t0
    print(f"{programs} programs x {steps} steps in {dt:.0f}s")
    for k in sorted(total):
        print(f"  {k:28} {total[k]:>8}")
    print(f"  {'violations':28} {violations:>8}")
    return 1 if violations else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", default=None)
    p.add_argument("--programs", type=int, default=20)
    p.add_argument("--steps", type=int, default=400)
    a = p.parse_args()
    with server(a.url) as u:
        sys.exit(anyio.run(main, u, a.programs, a.steps))
