"""The serving commands: `gateway` (HTTP/SSE, one or more worker processes), `up` (server,
projector and gateway for local development), `demo`."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import anyio
import typer

from .common import PORT_RANGE, CliError, PrefixOpt, TokensOpt, UrlOpt, announce, app, err, out, run
from .supervised import supervised

T = TypeVar("T")


@app.command("gateway")
def gateway_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(**PORT_RANGE, help="Port (0: any free one).")] = 8765,
    token: Annotated[
        str | None, typer.Option(help="Bearer token with every scope (default: $REDIS_SESSION_TOKEN).")
    ] = None,
    tokens: TokensOpt = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            help="A Host name the gateway answers (repeat; '.example.com' for a domain, '*' for any; "
            "default: the --host address, localhost, 127.0.0.1, ::1; $REDIS_SESSION_ALLOWED_HOSTS)."
        ),
    ] = None,
    allowed_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="An origin (scheme://host:port) whose pages may call the gateway: CORS (repeat; "
            "none by default; $REDIS_SESSION_ALLOWED_ORIGINS)."
        ),
    ] = None,
    insecure_no_auth: Annotated[
        bool, typer.Option(help="Serve a non-loopback --host without any token (anyone may read and write).")
    ] = False,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes sharing the port.")] = 1,
    http: Annotated[str, typer.Option(help="HTTP parser: auto (httptools if installed), httptools, h11.")] = "auto",
    loop: Annotated[str, typer.Option(help="Event loop: auto (uvloop if installed), uvloop, asyncio.")] = "auto",
) -> None:
    """Serve the HTTP/SSE gateway (reads, live tails, writes) and the web viewer."""
    from ..gateway.app import check_exposure, listen, run_workers
    from ..gateway.auth import load_tokens
    from ..gateway.routes import WebPolicy, split_list

    # read here, not through typer's envvar: click takes an empty value for "unset", and an
    # empty token would silently open the gateway
    if token is None and "REDIS_SESSION_TOKEN" in os.environ:
        token = os.environ["REDIS_SESSION_TOKEN"]
        if not token.strip():
            raise CliError("REDIS_SESSION_TOKEN is set but empty: set a token, or unset the variable")
    if token is not None and not token.strip():
        raise CliError("--token is empty")
    if http not in ("auto", "httptools", "h11") or loop not in ("auto", "uvloop", "asyncio"):
        raise CliError("--http is auto, httptools or h11; --loop is auto, uvloop or asyncio")
    hosts = allowed_host or split_list(os.environ.get("REDIS_SESSION_ALLOWED_HOSTS")) or None
    origins = allowed_origin or split_list(os.environ.get("REDIS_SESSION_ALLOWED_ORIGINS"))
    try:
        scoped = load_tokens(tokens)
        check_exposure(host, has_token=token is not None or bool(scoped), insecure_no_auth=insecure_no_auth)
        WebPolicy.make(hosts, origins, bound=host)
    except ValueError as e:
        raise CliError(str(e)) from None

    def serve_on(sockets: Any) -> None:
        async def main() -> None:
            from ..gateway.app import serve

            async def body(store: Any) -> None:
                await serve(
                    store,
                    host=host,
                    port=port,
                    token=token,
                    tokens=scoped,
                    allowed_hosts=hosts,
                    allowed_origins=origins,
                    insecure_no_auth=insecure_no_auth,
                    http=http,
                    sockets=sockets,
                )

            await supervised(url, prefix, body)

        _run_fast(main, loop)

    shown = f"[{host}]" if ":" in host else host
    if workers == 1:
        err.print(f"gateway on http://{shown}:{port}/", highlight=False)
        serve_on(None)
        return
    if not url:  # the workers share one embedded server: start it (or find it) once, here
        from ..redis.connect import resolve_url

        url = resolve_url(None, announce=announce)
    sock = listen(host, port)
    err.print(f"gateway on http://{shown}:{port}/ ({workers} worker processes)", highlight=False)
    code = run_workers(workers, lambda: serve_on([sock]))
    if code:
        raise typer.Exit(code)


def _run_fast(fn: Callable[[], Awaitable[T]], loop: str = "auto") -> T:
    """`run` on uvloop when it is installed (`loop` auto) or asked for, else asyncio's."""
    import importlib.util

    fast = loop == "uvloop" or (loop == "auto" and importlib.util.find_spec("uvloop") is not None)
    return anyio.run(fn, backend_options={"use_uvloop": True} if fast else {})


@app.command("up")
def up_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(**PORT_RANGE, help="Port (0: any free one).")] = 8765,
    tokens: TokensOpt = None,
) -> None:
    """Server + projector + gateway in the foreground, for local development."""

    async def main() -> None:
        from ..gateway.app import serve
        from ..gateway.auth import load_tokens
        from ..projector import Projector

        scoped = load_tokens(tokens)

        async def body(store: Any) -> None:
            out.print(
                f"[bold]redis-session up[/bold]: viewer on http://{host}:{port}/  (Ctrl-C to stop)", highlight=False
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(Projector(store).run)
                await serve(store, host=host, port=port, tokens=scoped)
                tg.cancel_scope.cancel()

        await supervised(url, prefix, body)

    try:
        run(main)
    except KeyboardInterrupt:
        pass


@app.command("demo")
def demo_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "demo",
    duration: Annotated[float, typer.Option(min=1.0, help="Seconds of simulated traffic.")] = 20.0,
    pods: Annotated[int, typer.Option(min=1, max=64, help="Simulated agent pods.")] = 4,
    port: Annotated[int, typer.Option(**PORT_RANGE, help="Gateway port (0: no gateway).")] = 8765,
    quiet: Annotated[bool, typer.Option("--quiet", help="No live tail, summary only.")] = False,
) -> None:
    """The main job: pods writing concurrent sessions, a projector, the gateway, a live tail."""

    async def main() -> int:
        from .demo import run_demo

        return await run_demo(url=url, prefix=prefix, duration=duration, pods=pods, port=port, quiet=quiet, console=out)

    if run(main):
        raise typer.Exit(1)
