"""Projection fold speed: a full fold of a 100k-entry log (90% ``assistant/chunk``) against the
incremental paths a reader or the projector takes (a state copy or a cached snapshot, plus the last
few entries). Pure CPU, no server.

    python bench/projection.py [--entries 100000] [--tail 10] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis_session.model import ENTRY_ENCODER, ENTRY_LIST_DECODER, Entry
from redis_session.projection import ProjectionState, project

# One dsh turn: 11 structural/message events and 99 chunks, so chunks are 90% of the log.
CHUNKS_PER_STEP = (49, 50)


def build_log(size: int) -> list[Entry]:
    entries: list[Entry] = []

    def add(type: str, data: dict[str, Any]) -> None:
        entries.append(Entry(n=len(entries), time=1_700_000_000_000 + len(entries), type=type, data=data))

    turn = 0
    while len(entries) < size:
        turn += 1
        add("turn/start", {"turn": turn, "trigger": {"kind": "message", "source": {"kind": "cli"}}})
        add("user/message", {"content": [{"type": "text", "text": f"question {turn}"}], "source": {"kind": "cli"}})
        for step, chunks in enumerate(CHUNKS_PER_STEP, start=1):
            add("step/start", {"turn": turn, "step": step})
            for i in range(chunks):
                add("assistant/chunk", {"turn": turn, "step": step, "chunk": {"type": "text-delta", "text": f"t{i} "}})
            if step == 1:
                call = {"type": "tool-call", "id": f"c{turn}", "name": "bash", "arguments": '{"cmd": "ls"}'}
                add("assistant/message", {"turn": turn, "step": step, "content": [call]})
                add("tool/call", {"turn": turn, "step": step, "callId": f"c{turn}", "name": "bash", "arguments": "{}"})
                add(
                    "tool/result",
                    {"turn": turn, "step": step, "callId": f"c{turn}", "content": "a\nb\nc", "isError": False},
                )
            else:
                text = {"type": "text", "text": f"answer {turn} " * 20}
                add("assistant/message", {"turn": turn, "step": step, "content": [text]})
            add("step/end", {"turn": turn, "step": step})
        add("turn/end", {"turn": turn, "reason": {"kind": "completed"}})
    return entries[:size]


def best(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` runs, in seconds (GC off while timing, as timeit does)."""
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        gc.enable()
    return min(times)


def per_call(fn: Callable[[], object], budget: float = 0.5) -> float:
    """The fastest of many calls of `fn` within `budget` seconds (GC off while timing, as in `best`)."""
    fn()
    samples: list[float] = []
    gc.collect()
    gc.disable()
    try:
        deadline = time.perf_counter() + budget
        while time.perf_counter() < deadline or len(samples) < 20:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return min(samples)


def fmt_time(s: float) -> str:
    return f"{s * 1e3:9.3f} ms" if s >= 1e-3 else f"{s * 1e6:9.1f} µs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--entries", type=int, default=100_000)
    p.add_argument("--tail", type=int, default=10, help="entries folded on top of a state or snapshot")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()

    log = build_log(args.entries)
    n, k = len(log), args.tail
    chunks = sum(e.type == "assistant/chunk" for e in log)
    messages = project(log)
    print(f"log: {n} entries, {chunks / n:.0%} assistant/chunk, {len(messages)} messages in the projection")

    full = best(lambda: project(log), args.repeat)

    def one_by_one() -> None:
        s = ProjectionState()
        for e in log:
            s.apply(e)

    applied = best(one_by_one, args.repeat)

    base = ProjectionState()
    base.extend(log[: n - k])
    blob = base.to_bytes()
    tail = log[n - k :]

    def from_copy() -> list[Any]:
        s = base.copy()
        s.extend(tail)
        return s.messages()

    def from_snapshot() -> list[Any]:
        s = ProjectionState.from_bytes(blob)
        s.extend(tail)
        return s.messages()

    assert from_copy() == from_snapshot() == messages
    raw_log = ENTRY_ENCODER.encode(log)
    cold = best(lambda: project(ENTRY_LIST_DECODER.decode(raw_log)), max(1, args.repeat // 2))
    inc_copy = per_call(from_copy)
    inc_snap = per_call(from_snapshot)
    dump = per_call(base.to_bytes)

    rows = [
        ("full fold: project(100k)", fmt_time(full), f"{n / full / 1e6:6.2f} M entries/s"),
        ("full fold: apply() one by one", fmt_time(applied), f"{n / applied / 1e6:6.2f} M entries/s"),
        (f"copy() + extend(last {k}) + messages()", fmt_time(inc_copy), f"{full / inc_copy:8.0f}x faster than full"),
        (
            f"from_bytes() + extend(last {k}) + messages()",
            fmt_time(inc_snap),
            f"{full / inc_snap:8.0f}x faster than full",
        ),
        (f"to_bytes() ({len(blob) / 1024:.0f} KiB)", fmt_time(dump), f"{len(blob) / dump / 2**20:6.0f} MiB/s"),
        (
            f"no snapshot: decode the log ({len(raw_log) / 2**20:.0f} MiB JSON) + project()",
            fmt_time(cold),
            f"{cold / inc_snap:8.0f}x slower than the snapshot",
        ),
    ]
    w0 = max(len(r[0]) for r in rows)
    print(f"{'scenario':<{w0}}  {'time':>12}  rate")
    print("-" * (w0 + 40))
    for name, t, rate in rows:
        print(f"{name:<{w0}}  {t:>12}  {rate}")


if __name__ == "__main__":
    main()
