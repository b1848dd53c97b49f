"""The worker commands: `projector`, `compactor`, `archive` (one session, a policy pass, its
worker, its sweep), `restore`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..checks import MAX_N
from .common import CliError, JsonOpt, MetricsPortOpt, PrefixOpt, UrlOpt, app, emit_json, err, opened, out, run
from .supervised import supervised

# a feed read's COUNT and the sessions handled at once: far above any useful value, far below
# what would make a worker's first read fail (or its memory explode) instead of its command line
MAX_BATCH = 100_000
MAX_CONCURRENCY = 10_000


@app.command("projector")
def projector_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    status: Annotated[bool, typer.Option("--status", help="Print lag and counters as JSON, then exit.")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="REDIS_SESSION_METRICS_PORT",
            min=1,
            max=65535,
            help="Serve Prometheus metrics on this port (1-65535).",
        ),
    ] = None,
    metrics_addr: Annotated[str, typer.Option(help="Address of the metrics server.")] = "0.0.0.0",
    consumer: Annotated[str | None, typer.Option(help="Consumer name (default: <host>-<pid>-<random>).")] = None,
    group: Annotated[str, typer.Option(help="Consumer group.")] = "projector",
    batch: Annotated[int, typer.Option(min=1, max=MAX_BATCH, help="Feed entries per shard per read.")] = 200,
    claim_idle_ms: Annotated[
        int, typer.Option(min=0, max=MAX_N, help="Reclaim idle feed entries after (ms).")
    ] = 30_000,
    lock_ms: Annotated[int, typer.Option(min=0, max=MAX_N, help="Per-session fold lock expiry (0: no lock).")] = 10_000,
    concurrency: Annotated[int, typer.Option(min=1, max=MAX_CONCURRENCY, help="Sessions folded at once.")] = 8,
    feed_shards: Annotated[int, typer.Option(min=1, max=1024, help="Change-feed shards (as the writers use).")] = 4,
) -> None:
    """Run a projector worker (keeps each session's derived messages cached), or show --status."""

    async def main() -> None:
        import logging

        from .. import projector as proj

        if status:
            async with opened(url, prefix, feed_shards=feed_shards) as store:
                emit_json(await proj.status(store, group=group))
                return

        async def body(store: Any) -> None:
            logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            worker = proj.Projector(
                store,
                consumer=consumer,
                group=group,
                batch=batch,
                claim_idle_ms=claim_idle_ms,
                lock_ms=lock_ms,
                concurrency=concurrency,
                metrics_port=metrics_port,
                metrics_addr=metrics_addr,
            )
            err.print(f"projector {worker.consumer} running (Ctrl-C or SIGTERM to stop)")
            await worker.run_forever()

        await supervised(url, prefix, body, feed_shards=feed_shards)

    run(main)


@app.command("compactor")
def compactor_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    status: Annotated[bool, typer.Option("--status", help="Print lag and counters as JSON, then exit.")] = False,
    budget: Annotated[int, typer.Option(min=1, max=MAX_N, help="Token budget of a projection.")] = 32_000,
    keep_recent: Annotated[int, typer.Option(min=1, max=MAX_N, help="Keep at most this many recent messages.")] = 20,
    keep_tokens: Annotated[int | None, typer.Option(min=1, max=MAX_N, help="Tokens kept (default: budget/4).")] = None,
    summarizer_url: Annotated[
        str | None, typer.Option(envvar="REDIS_SESSION_SUMMARIZER_URL", help="OpenAI-compatible chat-completions URL.")
    ] = None,
    model: Annotated[str | None, typer.Option(envvar="REDIS_SESSION_SUMMARIZER_MODEL", help="Model.")] = None,
    api_key_env: Annotated[str, typer.Option(help="Environment variable holding the API key.")] = "OPENAI_API_KEY",
    summarizer: Annotated[str | None, typer.Option(help="Python summarizer: module:function.")] = None,
    timeout: Annotated[float, typer.Option(min=1, max=86_400, help="Seconds one summary may take.")] = 120.0,
    consumer: Annotated[str | None, typer.Option(help="Consumer name (default: <host>-<pid>-<random>).")] = None,
    group: Annotated[str, typer.Option(help="Consumer group.")] = "compactor",
    claim_idle_ms: Annotated[int, typer.Option(min=1, max=MAX_N, help="Retry failed/idle entries after.")] = 30_000,
    concurrency: Annotated[int, typer.Option(min=1, max=MAX_CONCURRENCY, help="Sessions checked at once.")] = 4,
    feed_shards: Annotated[int, typer.Option(min=1, max=1024, help="Change-feed shards (as the writers use).")] = 4,
    metrics_port: MetricsPortOpt = None,
    from_start: Annotated[
        bool,
        typer.Option(
            "--from-start",
            help="A new group starts at the feed's first entry: check every retained session now "
            "(default: the feed's end, only sessions written from now on).",
        ),
    ] = False,
) -> None:
    """Run a compactor worker (summarises sessions over a token budget into a cut), or show --status."""

    async def main() -> None:
        import logging

        from .. import compactor as comp

        if status:
            async with opened(url, prefix, feed_shards=feed_shards) as store:
                emit_json(await comp.status(store, group=group))
                return
        if (summarizer is None) == (summarizer_url is None):
            raise CliError("give exactly one of --summarizer-url URL (with --model) or --summarizer module:function")
        if summarizer is not None:
            summarize: Any = comp.load_summarizer(summarizer)
        elif not model:
            raise CliError("--summarizer-url needs --model")
        else:
            summarize = comp.chat_completions(summarizer_url or "", model, api_key_env=api_key_env, timeout=timeout)

        async def body(store: Any) -> None:
            logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            worker = comp.Compactor(
                store, summarize=summarize, budget_tokens=budget, keep_recent=keep_recent, keep_tokens=keep_tokens,
                timeout=timeout, consumer=consumer, group=group, claim_idle_ms=claim_idle_ms,
                concurrency=concurrency, metrics_port=metrics_port, from_start=from_start,
            )  # fmt: skip
            err.print(f"compactor {worker.consumer} running, budget {budget} tokens (Ctrl-C or SIGTERM to stop)")
            await worker.run_forever()

        await supervised(url, prefix, body, feed_shards=feed_shards)

    run(main)


_DURATION_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(text: str) -> int:
    """``7d``, ``12h``, ``30m``, ``45s``, ``500ms`` or plain seconds, as ms."""
    t = text.strip().lower()
    for unit in ("ms", "s", "m", "h", "d"):
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * _DURATION_UNITS[unit])
    if t.replace(".", "", 1).isdigit():
        return int(float(t) * 1000)
    raise CliError(f"not a duration: {text!r} (e.g. 7d, 12h, 30m, 45s)")


async def _cold_tier(store: Any, to: str | None) -> Any:
    """The prefix's cold tier: `to` (recorded for every store of the prefix), else the one
    recorded, else a local folder of this store's own in the user data dir (recorded): two
    servers (or databases) never share one by default."""
    from ..archiver import set_cold_url, store_id

    if to is None and await store.cold_tier() is not None:
        return store.cold
    if to is None:
        from ..redis.embedded import default_data_dir

        to = str(default_data_dir() / "cold" / await store_id(store))
    return await set_cold_url(store, to)


async def _existing(store: Any, session_id: str) -> None:
    """Refuse an id that names no session (`SessionNotFoundError`, as `show` and `export` do)."""
    from ..errors import SessionNotFoundError

    state = await store.cold_state(session_id)
    if state is None or state.deleted:
        raise SessionNotFoundError(session_id)


@app.command("archive")
def archive_cmd(
    session_id: Annotated[str | None, typer.Argument(help="One session (else every one the policy selects).")] = None,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            envvar="REDIS_SESSION_COLD",
            help="Object store URL (file:///path or a path, s3://, gs://, az://); recorded for the prefix. "
            "Default: the one recorded, else <data dir>/cold/<store id>.",
        ),
    ] = None,
    idle: Annotated[
        str | None, typer.Option(help="Only sessions idle this long (7d, 12h, 30m); alone: whole logs.")
    ] = None,
    before_last_cut: Annotated[bool, typer.Option("--before-last-cut", help="Up to the last cut's 'before'.")] = False,
    keep: Annotated[int | None, typer.Option(min=0, max=MAX_N, help="Keep at most this many entries hot.")] = None,
    min_entries: Annotated[int, typer.Option(min=1, max=MAX_N, help="Leave shorter ranges hot.")] = 1,
    worker: Annotated[
        bool, typer.Option("--worker", help="Run as a change-feed worker (beside the projector).")
    ] = False,
    sweep: Annotated[
        bool, typer.Option("--sweep", help="Delete objects no header names (older than --grace).")
    ] = False,
    grace: Annotated[str, typer.Option(help="Age before an unnamed object is swept.")] = "1h",
    status: Annotated[
        bool, typer.Option("--status", help="Print the tier and the archiver counters, then exit.")
    ] = False,
    group: Annotated[
        str, typer.Option(help="Consumer group (--worker) and the counters every run adds to (--status).")
    ] = "archiver",
    consumer: Annotated[str | None, typer.Option(help="Consumer name (default: <host>-<pid>-<random>).")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Serve Prometheus metrics on this port (--worker).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Move old entries into the cold tier (object storage): one session, a policy pass, --worker, or --sweep."""

    async def main() -> None:
        import logging

        from ..archiver import Archiver, ArchiveWorker, Policy

        grace_ms = _duration_ms(grace)
        policy = None
        if idle is not None or before_last_cut or keep is not None:
            policy = Policy(
                idle_ms=None if idle is None else _duration_ms(idle), before_last_cut=before_last_cut,
                keep=keep, min_entries=min_entries,
            )  # fmt: skip
        elif session_id is not None and min_entries > 1:
            # one session, its whole log, unless it is shorter than --min-entries
            policy = Policy(keep=0, min_entries=min_entries)
        if policy is None and session_id is None and not (sweep or status):
            raise CliError("give a SESSION_ID, a policy (--idle, --before-last-cut, --keep), --sweep or --status")
        if worker and policy is None:
            raise CliError("--worker needs a policy (--idle, --before-last-cut or --keep)")

        if worker:
            assert policy is not None

            async def body(store: Any) -> None:
                logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
                tier = await _cold_tier(store, to)
                w = ArchiveWorker(
                    store, policy, tier=tier, group=group, consumer=consumer, grace_ms=grace_ms,
                    metrics_port=metrics_port,
                )  # fmt: skip
                err.print(f"archiver {w.consumer} running into {tier.url} (Ctrl-C or SIGTERM to stop)")
                await w.run_forever()

            await supervised(url, prefix, body)
            return
        async with opened(url, prefix) as store:
            if session_id is not None:
                await _existing(store, session_id)  # before the tier is recorded: a refusal writes nothing
            tier = await _cold_tier(store, to)
            if status:
                from ..archiver import status as archive_status

                emit_json(await archive_status(store, group=group))
                return
            archiver = Archiver(store, tier, grace_ms=grace_ms, group=group)  # one-pass runs count there too
            if sweep:
                removed = await archiver.sweep()
                emit_json({"swept": len(removed), "keys": removed}) if as_json else out.print(
                    f"swept {len(removed)} objects", highlight=False
                )
                return
            results = (
                [await archiver.archive(session_id, policy=policy)]
                if session_id is not None
                else await archiver.run_policy(policy)  # type: ignore[arg-type]
            )
            for r in results:
                if r.status == "absent" and session_id is not None:  # deleted since `_existing`
                    raise CliError(f"session {session_id!r} not found")
                if as_json:
                    emit_json(r._asdict())
                else:
                    out.print(f"{r.session}: {r.status} [{r.lo}, {r.hi}) {r.bytes} B", highlight=False, markup=False)

    run(main)


@app.command("restore")
def restore_cmd(
    session_id: Annotated[str, typer.Argument(help="The session to bring back hot.")],
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    as_json: JsonOpt = False,
) -> None:
    """Bring a session's archived entries back into Redis (and delete its segment objects)."""

    async def main() -> None:
        from ..archiver import Archiver

        async with opened(url, prefix) as store:
            # the tier recorded for the prefix, if any: archived entries can only be there, and a
            # restore never records one (an unknown session, or one with nothing archived, needs none)
            r = await Archiver(store).restore(session_id)
            if r.status == "absent":
                raise CliError(f"session {session_id!r} not found")
            if as_json:
                emit_json(r._asdict())
            else:
                out.print(f"{r.session}: {r.status} [{r.lo}, {r.hi})", highlight=False, markup=False)

    run(main)
