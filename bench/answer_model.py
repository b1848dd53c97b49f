"""The answer protocol's model-based check, long: many seeds and steps against a real server.

    python bench/answer_model.py [--url URL] [--seeds 200] [--steps 200]

Each seed drives random batches, retries, concurrent copies, reorders and holes, lost replies,
reader drops and resumes, second answers and delete + re-create against one session
(`redis_session.testing.answer_model.run_model`), then checks that every reader saw exactly the
sent text (or an explicit gap) and that the log replays every answer. Prints the totals.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anyio
from _common import drop_prefix, server, unique_prefix

from redis_session import RedisSessionStore
from redis_session.testing.answer_model import ModelStats, run_model


async def main_async(url: str, seeds: int, steps: int) -> None:
    prefix = unique_prefix()
    store = RedisSessionStore.from_url(url, prefix=prefix)
    total = ModelStats()
    t0 = time.perf_counter()
    try:
        for seed in range(seeds):
            st = await run_model(store, seed, steps, sid=f"model-{seed}")
            for k, v in vars(st).items():
                setattr(total, k, getattr(total, k) + v)
    finally:
        await store.aclose()
        await drop_prefix(url, prefix)
    print(f"{seeds} seeds x {steps} steps in {time.perf_counter() - t0:.1f} s: every check held")
    print("  " + ", ".join(f"{k} {v}" for k, v in vars(total).items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None)
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    with server(args.url) as url:
        anyio.run(main_async, url, args.seeds, args.steps)


if __name__ == "__main__":
    main()
