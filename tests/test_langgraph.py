"""`RedisEventSaver`, the LangGraph checkpointer: LangGraph's official conformance suite, then a real
`StateGraph` (a tool loop, an interrupt, time travel and a fork) on the memory store and a server.

Needs the ``langgraph`` extra (and ``langgraph-test`` for the conformance suite); CI installs both,
so these tests run there rather than skip.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import anyio
import msgspec
import pytest

from redis_session import MemorySessionStore, RedisSessionStore
from redis_session.errors import SessionAlreadyExistsError, SessionError

from support import require_extra

require_extra("langgraph.checkpoint.base", "langgraph")

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.graph.message import add_messages  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402
from langgraph.types import Command, interrupt  # noqa: E402

from redis_session.adapters.langgraph import CHECKPOINT, DROP, PART, WRITE, RedisEventSaver  # noqa: E402

from support import SkewClock, let_pass, wait_for  # noqa: E402

pytestmark = pytest.mark.anyio


async def _cleanup(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
        for i in range(0, len(keys), 500):
            await r.delete(*keys[i : i + 500])
    finally:
        await r.aclose()


@pytest.fixture(params=["memory", "redis"])
async def lg_store(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemorySessionStore(clock=SkewClock())
        return
    url = request.getfixturevalue("redis_url")
    store = RedisSessionStore.from_url(url, prefix=prefix)
    try:
        yield store
    finally:
        await store.aclose()
        await _cleanup(url, prefix)


# =========================================================================== conformance


async def test_official_conformance_suite(lg_store: Any) -> None:
    # not importorskip: with the langgraph extra installed, a missing langgraph-test extra fails
    import langgraph.checkpoint.conformance as conformance
    from langgraph.checkpoint.conformance.report import ProgressCallbacks

    @conformance.checkpointer_test(name="RedisEventSaver")
    async def factory() -> AsyncIterator[RedisEventSaver]:
        yield RedisEventSaver(lg_store)

    report = await conformance.validate(factory, progress=ProgressCallbacks.quiet())
    report.print_report()
    assert report.passed_all_base()
    failed = {name: r.failures for name, r in report.results.items() if r.failures}
    assert not failed, failed
    for capability in ["copy_thread", "prune", "delete_for_runs"]:  # the extended ones we implement ran
        assert report.results[capability].passed is True, capability
        assert report.results[capability].tests_passed > 0, capability


# =========================================================================== a real graph


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    approvals: Annotated[list[str], operator.add]


def _agent(state: State) -> dict[str, Any]:
    """A scripted model: asks for the tool once per user question, then answers with its result."""
    last = state["messages"][-1]
    if isinstance(last, HumanMessage):
        a, b = (int(x) for x in str(last.content).split("x"))
        call = {"name": "multiply", "args": {"a": a, "b": b}, "id": f"call-{a}-{b}", "type": "tool_call"}
        return {"messages": [AIMessage("", tool_calls=[call])]}
    assert isinstance(last, ToolMessage)
    return {"messages": [AIMessage(f"the answer is {last.content}")]}


def _approve(state: State) -> dict[str, Any]:
    answer = interrupt({"question": "send this answer?", "answer": state["messages"][-1].content})
    return {"approvals": [str(answer)]}


def _graph(saver: RedisEventSaver) -> Any:
    builder = StateGraph(State)
    builder.add_node("agent", _agent)
    builder.add_node("tools", ToolNode([multiply]))
    builder.add_node("approve", _approve)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: "approve"})
    builder.add_edge("tools", "agent")
    builder.add_edge("approve", END)
    return builder.compile(checkpointer=saver)


def _texts(state: Any) -> list[str]:
    return [str(m.content) for m in state.values["messages"]]


async def test_state_graph_tool_loop_interrupt_time_travel_and_fork(lg_store: Any) -> None:
    saver = RedisEventSaver(lg_store)
    graph = _graph(saver)
    cfg: Any = {"configurable": {"thread_id": "calc-1"}}

    # a tool loop that stops at the interrupt
    out = await graph.ainvoke({"messages": [HumanMessage("6x7")], "approvals": []}, cfg)
    assert "__interrupt__" in out
    state = await graph.aget_state(cfg)
    assert state.next == ("approve",)
    assert _texts(state)[-1] == "the answer is 42"
    assert state.tasks[0].interrupts[0].value["answer"] == "the answer is 42"

    # a second saver on the same store (another pod) resumes it
    graph2 = _graph(RedisEventSaver(lg_store))
    out = await graph2.ainvoke(Command(resume="yes"), cfg)
    assert out["approvals"] == ["yes"]
    assert (await graph.aget_state(cfg)).next == ()

    # the log: checkpoints and pending writes as entries of one session
    log = await lg_store.read(saver.session_id("calc-1"))
    types = {e.type for e in log}
    assert CHECKPOINT in types and WRITE in types

    # time travel: go back to the checkpoint before the tool ran and ask something else
    history = [s async for s in graph.aget_state_history(cfg)]
    assert [s.created_at for s in history] == sorted((s.created_at for s in history), reverse=True)
    before_tools = next(s for s in history if s.next == ("tools",))
    n_before = len(history)
    past = await graph.aupdate_state(
        before_tools.config,
        {"messages": [AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 3, "b": 5}, "id": "c2"}])]},
        as_node="agent",
    )
    await graph.ainvoke(None, past)
    await graph.ainvoke(Command(resume="ok"), cfg)
    state = await graph.aget_state(cfg)
    assert "the answer is 15" in _texts(state) and "the answer is 42" not in _texts(state)
    assert state.values["approvals"] == ["ok"]
    # the old branch is still in the history
    assert len([s async for s in graph.aget_state_history(cfg)]) > n_before
    old = await graph.aget_state(history[0].config)
    assert old.values["approvals"] == ["yes"] and "the answer is 42" in _texts(old)

    # a fork into a new thread from the first interrupt: an O(1) branch of the session
    first_interrupt = next(s for s in history if s.next == ("approve",))
    forked = await saver.afork(first_interrupt.config, "calc-fork")
    head = await lg_store.head(saver.session_id("calc-fork"))
    assert head is not None and head.header.parent == saver.session_id("calc-1")
    fstate = await graph.aget_state({"configurable": {"thread_id": "calc-fork"}})
    assert fstate.next == ("approve",) and _texts(fstate)[-1] == "the answer is 42"
    assert fstate.config["configurable"]["checkpoint_id"] == forked["configurable"]["checkpoint_id"]
    out = await graph.ainvoke(Command(resume="no"), {"configurable": {"thread_id": "calc-fork"}})
    assert out["approvals"] == ["no"]
    assert (await graph.aget_state(cfg)).values["approvals"] == ["ok"]  # the source is untouched

    # delete_thread follows the store's delete: the fork keeps what it shares
    await saver.adelete_thread("calc-1")
    assert await graph.aget_state(cfg) is not None
    assert (await graph.aget_state(cfg)).values == {}
    assert (await graph.aget_state({"configurable": {"thread_id": "calc-fork"}})).values["approvals"] == ["no"]


def test_sync_graph_then_asyncio_run_twice(redis_url: str, prefix: str) -> None:
    """`graph.invoke` (the sync methods, on the private loop), then `asyncio.run` twice on one
    saver: each loop gets its own client."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    saver = RedisEventSaver(store)
    graph = _graph(saver)
    cfg: Any = {"configurable": {"thread_id": "sync-1"}}
    try:
        graph.invoke({"messages": [HumanMessage("2x3")], "approvals": []}, cfg)
        assert graph.get_state(cfg).next == ("approve",)
        assert len(list(saver.list(cfg, limit=2))) == 2

        async def resume() -> Any:
            return await graph.ainvoke(Command(resume="y"), cfg)

        assert asyncio.run(resume())["approvals"] == ["y"]

        async def look() -> Any:
            return (await graph.aget_state(cfg)).values["approvals"]

        assert asyncio.run(look()) == ["y"]
        assert graph.get_state(cfg).values["approvals"] == ["y"]
    finally:
        # the store's own pool belongs to the first asyncio.run's loop (closed now): nothing to close
        asyncio.run(_cleanup(redis_url, prefix))


# =========================================================================== details


async def test_large_values_are_split_into_parts(lg_store: Any) -> None:
    small = MemorySessionStore(max_entry_bytes=4096) if isinstance(lg_store, MemorySessionStore) else lg_store
    saver = RedisEventSaver(small)
    saver._max_bytes = 4096  # the Redis store's limit is 1 MiB: split as if it were 4 KiB
    from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_config, generate_metadata

    big = "x" * 20_000
    cp = generate_checkpoint(channel_values={"big": big, "small": 1}, channel_versions={"big": 1, "small": 1})
    stored = await saver.aput(generate_config("big"), cp, generate_metadata(), {"big": 1, "small": 1})
    await saver.aput_writes(stored, [("w", big)], "task-1")
    log = await small.read(saver.session_id("big"))
    assert PART in {e.type for e in log}
    fresh = RedisEventSaver(small)
    tup = await fresh.aget_tuple(stored)
    assert tup is not None
    assert tup.checkpoint["channel_values"] == {"big": big, "small": 1}
    assert tup.pending_writes == [("task-1", "w", big)]


async def test_thread_ids_that_are_not_session_ids_and_list_all(lg_store: Any) -> None:
    from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_config, generate_metadata

    saver = RedisEventSaver(lg_store)
    odd = "a thread {with} spaces"
    await saver.aput(generate_config(odd), generate_checkpoint(), generate_metadata(), {})
    await saver.aput(generate_config("plain"), generate_checkpoint(), generate_metadata(), {})
    assert saver.session_id(odd).startswith("langgraph:~")
    tup = await saver.aget_tuple(generate_config(odd))
    assert tup is not None and tup.config["configurable"]["thread_id"] == odd
    assert {t.config["configurable"]["thread_id"] async for t in saver.alist(None)} == {odd, "plain"}


async def test_ttl_makes_threads_ephemeral(lg_store: Any) -> None:
    from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_config, generate_metadata

    saver = RedisEventSaver(lg_store, ttl_ms=1500)  # long enough to be looked at on a slow machine
    await saver.aput(generate_config("eph"), generate_checkpoint(), generate_metadata(), {})
    assert await lg_store.head(saver.session_id("eph")) is not None
    await let_pass(lg_store, 1.7)
    assert await lg_store.head(saver.session_id("eph")) is None
    assert await RedisEventSaver(lg_store).aget_tuple(generate_config("eph")) is None


async def test_concurrent_puts_on_one_thread_never_conflict(lg_store: Any) -> None:
    """Checkpoints append at the end (expected n "any"): parallel writers all land, none retries."""
    from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_config, generate_metadata

    savers = [RedisEventSaver(lg_store) for _ in range(4)]
    await savers[0].aput(generate_config("par"), generate_checkpoint(), generate_metadata(), {})

    async def writer(s: RedisEventSaver) -> None:
        for _ in range(10):
            await s.aput(generate_config("par"), generate_checkpoint(), generate_metadata(), {})

    async with asyncio.TaskGroup() as tg:
        for s in savers:
            tg.create_task(writer(s))
    assert len([t async for t in RedisEventSaver(lg_store).alist(generate_config("par"))]) == 41


async def test_from_conn_string_async_and_sync(redis_url: str, prefix: str) -> None:
    """``from_conn_string(url)`` as every LangGraph saver has it, as an async and a sync
    context manager (the sync one from a worker thread: its calls run on the private loop)."""
    from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_config, generate_metadata

    try:
        async with RedisEventSaver.from_conn_string(redis_url, prefix=prefix) as saver:
            stored = await saver.aput(generate_config("cs"), generate_checkpoint(), generate_metadata(), {})
            assert (await saver.aget_tuple(stored)) is not None

        def sync_side() -> str:
            with RedisEventSaver.from_conn_string(redis_url, prefix=prefix) as saver:
                tup = saver.get_tuple(generate_config("cs"))
                assert tup is not None
                return str(tup.config["configurable"]["checkpoint_id"])

        assert await anyio.to_thread.run_sync(sync_side) == stored["configurable"]["checkpoint_id"]
    finally:
        await _cleanup(redis_url, prefix)


async def test_prune_and_delete_for_runs_are_one_entry_each(lg_store: Any) -> None:
    """keep_latest and delete_for_runs append one ``langgraph/drop`` entry (atomic for readers,
    no rewrite); a saver that never saw the thread (another pod) folds the same result, and a
    checkpoint written after the prune stays."""
    from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_config, generate_metadata

    saver = RedisEventSaver(lg_store)
    parent: Any = None
    for i in range(4):
        cfg = generate_config("p")
        if parent:
            cfg["configurable"]["checkpoint_id"] = parent["configurable"]["checkpoint_id"]
        parent = await saver.aput(cfg, generate_checkpoint(), generate_metadata(step=i, run_id=f"run-{i % 2}"), {})
    sid = saver.session_id("p")
    before = len(await lg_store.read(sid))
    await saver.adelete_for_runs(["run-0"])
    await saver.aprune(["p"], strategy="keep_latest")
    log = await lg_store.read(sid)
    assert [e.type for e in log[before:]] == [DROP, DROP]
    other_pod = RedisEventSaver(lg_store)
    for s in (saver, other_pod):
        got = [t.config["configurable"]["checkpoint_id"] async for t in s.alist(generate_config("p"))]
        assert got == [parent["configurable"]["checkpoint_id"]]
    later = await saver.aput(generate_config("p"), generate_checkpoint(), generate_metadata(run_id="run-0"), {})
    assert (await other_pod.aget_tuple(later)) is not None
    saver.prune(["p"], strategy="delete")
    assert await lg_store.head(sid) is None
    with pytest.raises(ValueError, match="strategy"):
        await saver.aprune(["p"], strategy="sometimes")


async def test_conformance_control_langgraphs_own_saver() -> None:
    """The control: the same suite, same run, on LangGraph's own InMemorySaver."""
    import langgraph.checkpoint.conformance as conformance
    from langgraph.checkpoint.conformance.report import ProgressCallbacks
    from langgraph.checkpoint.memory import InMemorySaver

    @conformance.checkpointer_test(name="InMemorySaver")
    async def factory() -> AsyncIterator[InMemorySaver]:
        yield InMemorySaver()

    report = await conformance.validate(factory, progress=ProgressCallbacks.quiet())
    assert report.passed_all_base()
    assert not {name: r.failures for name, r in report.results.items() if r.failures}


async def _chain(saver: RedisEventSaver, thread: str, steps: int, tag: str) -> list[str]:
    from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_config, generate_metadata

    parent: Any = None
    ids = []
    for i in range(steps):
        cfg = generate_config(thread)
        if parent:
            cfg["configurable"]["checkpoint_id"] = parent["configurable"]["checkpoint_id"]
        parent = await saver.aput(cfg, generate_checkpoint(), generate_metadata(step=i, tag=tag), {})
        await saver.aput_writes(parent, [("ch", f"{tag}-{i}")], f"task-{tag}-{i}")
        ids.append(parent["configurable"]["checkpoint_id"])
    return ids


async def test_a_saver_never_mixes_two_lives_of_a_thread(lg_store: Any) -> None:
    """Pod A has folded a thread; pod B deletes it and writes it again, longer. A's reads see the
    new thread only (they folded the new entries onto the old fold: the new log's entry n=k
    followed A's n=k), and A's own next write is folded into the right life."""
    from langgraph.checkpoint.conformance.test_utils import generate_config

    pod_a, pod_b = RedisEventSaver(lg_store), RedisEventSaver(lg_store)
    await _chain(pod_a, "t", 2, "old")
    assert len([t async for t in pod_a.alist(generate_config("t"))]) == 2
    await pod_b.adelete_thread("t")
    new_ids = await _chain(pod_b, "t", 3, "new")
    got = [t async for t in pod_a.alist(generate_config("t"))]
    assert [t.config["configurable"]["checkpoint_id"] for t in got] == new_ids[::-1]
    assert {t.metadata["tag"] for t in got} == {"new"}
    assert [w[2] for t in got for w in t.pending_writes or []] == ["new-2", "new-1", "new-0"]
    more = await _chain(pod_a, "t", 1, "a-again")
    seen_by_b = [t.config["configurable"]["checkpoint_id"] async for t in pod_b.alist(generate_config("t"))]
    assert seen_by_b[0] == more[0]
    assert len([t async for t in pod_a.alist(generate_config("t"))]) == 4


async def test_prune_computed_on_one_life_never_lands_in_another(lg_store: Any) -> None:
    """A prune's drop names the checkpoints of the life it was computed on; pod A folded the
    thread, pod B re-created it longer: A's prune keeps the new life's latest checkpoint (a drop
    computed on the old fold would name the old latest and wipe the new life)."""
    from langgraph.checkpoint.conformance.test_utils import generate_config

    pod_a, pod_b = RedisEventSaver(lg_store), RedisEventSaver(lg_store)
    await _chain(pod_a, "p", 3, "old")
    await pod_b.adelete_thread("p")
    new_ids = await _chain(pod_b, "p", 4, "new")
    await pod_a.aprune(["p"], strategy="keep_latest")
    got = [t.config["configurable"]["checkpoint_id"] async for t in pod_b.alist(generate_config("p"))]
    assert got == [new_ids[-1]]


# =========================================================================== edges: big metadata, deleted and
# expiring branched threads, connections from_conn_string opens, a lost reply


def _cp(tag: str, step: int = 0) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint

    cp = create_checkpoint(empty_checkpoint(), None, step)
    cp["channel_values"] = {"x": tag}
    cp["channel_versions"] = {"x": step + 1}
    return cp, {"tag": tag, "step": step}, {"x": step + 1}


def _at(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


async def test_metadata_over_the_entry_limit_is_split_into_parts(lg_store: Any) -> None:
    """Metadata (and a checkpoint body) larger than one entry may be goes in parts like channel
    values: a graph invoked with a big configurable value works, as on InMemorySaver."""
    small = MemorySessionStore(max_entry_bytes=8192) if isinstance(lg_store, MemorySessionStore) else lg_store
    saver = RedisEventSaver(small)
    saver._max_bytes = 8192  # the Redis store's limit is 1 MiB: split as if it were 8 KiB
    cp, md, versions = _cp("v")
    note = "m" * 30_000 + " ü ✓"
    stored = await saver.aput(_at("big-md"), cp, {**md, "note": note}, versions)
    log = await small.read(saver.session_id("big-md"))
    assert PART in {e.type for e in log} and all(len(msgspec.json.encode(e.data)) < 8192 for e in log)
    for reader in (saver, RedisEventSaver(small)):
        tup = await reader.aget_tuple(stored)
        assert tup is not None and tup.metadata["note"] == note and tup.checkpoint["channel_values"] == {"x": "v"}
        assert [t.metadata["note"] async for t in reader.alist(_at("big-md"), filter={"tag": "v"})] == [note]
    # a real graph, with the real limit: LangGraph copies configurable str values into metadata
    graph = StateGraph(State)
    graph.add_node("n", lambda state: {"messages": [AIMessage(content="done")]})
    graph.add_edge(START, "n")
    app = graph.compile(checkpointer=RedisEventSaver(lg_store))
    big = "x" * 1_200_000
    config: Any = {"configurable": {"thread_id": "g", "user_context": big}}
    out = await app.ainvoke({"messages": [HumanMessage(content="hi")]}, config)
    assert out["messages"][-1].content == "done"
    tup = await RedisEventSaver(lg_store).aget_tuple({"configurable": {"thread_id": "g"}})
    assert tup is not None and tup.metadata["user_context"] == big


@pytest.mark.parametrize("how", ["copy_thread", "fork"])
async def test_a_thread_deleted_while_branched_starts_again_under_its_id(lg_store: Any, how: str) -> None:
    """After copy_thread/fork then delete_thread(src), the next put on src starts a new thread
    (InMemorySaver's behaviour) and the branch keeps its copy; every reader sees the new life."""
    saver = RedisEventSaver(lg_store)
    first = await saver.aput(_at("src"), *_cp("old1"))
    await saver.aput(first, *_cp("old2", 1))
    if how == "copy_thread":
        await saver.acopy_thread("src", "dst")
    else:
        await saver.afork(first, "dst")
    await saver.adelete_thread("src")
    assert await saver.aget_tuple(_at("src")) is None
    for life in ("new", "newer"):
        await saver.aput(_at("src"), *_cp(life))
        for reader in (saver, RedisEventSaver(lg_store)):
            tup = await reader.aget_tuple(_at("src"))
            assert tup is not None and tup.metadata["tag"] == life
            assert [t.metadata["tag"] async for t in reader.alist(_at("src"))] == [life]
        dst = [t.metadata["tag"] async for t in saver.alist(_at("dst"))]
        assert dst == (["old2", "old1"] if how == "copy_thread" else ["old1"])
        # the new life is branched and deleted again: the next one follows
        await saver.acopy_thread("src", f"keep-{life}")
        await saver.adelete_thread("src")
        assert await RedisEventSaver(lg_store).aget_tuple(_at("src")) is None
    listed = {t.config["configurable"]["thread_id"] async for t in saver.alist(None)}
    assert listed == {"dst", "keep-new", "keep-newer"}
    # once every branch is gone, the thread's next life is found the same way
    for t in ("dst", "keep-new", "keep-newer"):
        await saver.adelete_thread(t)
    await saver.aput(_at("src"), *_cp("last"))
    tup = await RedisEventSaver(lg_store).aget_tuple(_at("src"))
    assert tup is not None and tup.metadata["tag"] == "last"
    assert {t.config["configurable"]["thread_id"] async for t in saver.alist(None)} == {"src"}
    await saver.aput(_at("other"), *_cp("o"))
    with pytest.raises(SessionAlreadyExistsError):
        await saver.acopy_thread("src", "other")  # a target that exists


async def test_branched_ephemeral_threads_expire_once_their_branches_have(lg_store: Any) -> None:
    """`ttl_ms`: a thread kept while a copy of it lives (the copy reads its entries) expires
    again once the copy has expired: on its next write its clock restarts."""
    saver = RedisEventSaver(lg_store, ttl_ms=1500)  # each step below has that much room
    reader = RedisEventSaver(lg_store)
    await saver.aput(_at("src"), *_cp("a"))
    await saver.acopy_thread("src", "cp")
    await let_pass(lg_store, 1.7)  # the copy expires; the source, kept for it, does not
    assert await reader.aget_tuple(_at("cp")) is None
    assert await reader.aget_tuple(_at("src")) is not None
    await saver.aput(_at("src"), *_cp("b", 1))
    assert (await reader.aget_tuple(_at("src"))) is not None
    await let_pass(lg_store, 1.7)
    assert await reader.aget_tuple(_at("src")) is None
    assert [t async for t in reader.alist(None)] == []
    assert await lg_store.head(saver.session_id("src")) is None


def test_sync_from_conn_string_closes_its_connections(redis_url: str, prefix: str) -> None:
    import time

    import redis as sync_redis

    r = sync_redis.Redis.from_url(redis_url)
    try:
        name = f"lg-{prefix}"

        def ours() -> int:
            return sum(1 for c in r.client_list() if c.get("name") == name)

        url = redis_url + ("&" if "?" in redis_url else "?") + f"client_name={name}"
        for _ in range(5):
            with RedisEventSaver.from_conn_string(url, prefix=prefix) as saver:
                saver.put(_at("t"), *_cp("v"))
                assert saver.get_tuple(_at("t")) is not None
                assert ours() > 0
        deadline = time.monotonic() + 60  # closing is asynchronous on the server's side
        while ours() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ours() == 0
        with pytest.raises(SessionError, match="closed"):
            saver.get_tuple(_at("t"))
        with pytest.raises(SessionError, match="closed"):
            saver.put(_at("t"), *_cp("w"))
    finally:
        r.close()
        asyncio.run(_cleanup(redis_url, prefix))


async def test_async_from_conn_string_closes_its_connections(redis_url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    name = f"lga-{prefix}"

    async def ours() -> int:
        return sum(1 for c in await r.client_list() if c.get("name") == name)

    url = redis_url + ("&" if "?" in redis_url else "?") + f"client_name={name}"
    try:
        for _ in range(3):
            async with RedisEventSaver.from_conn_string(url, prefix=prefix) as saver:
                await saver.aput(_at("t"), *_cp("v"))
                await anyio.to_thread.run_sync(lambda: saver.get_tuple(_at("t")))  # the sync loop too

        async def closed() -> bool:
            return await ours() == 0

        await wait_for(closed)
        with pytest.raises(SessionError, match="closed"):
            await saver.aget_tuple(_at("t"))
    finally:
        await r.aclose()
        await _cleanup(redis_url, prefix)


async def test_a_put_or_put_writes_whose_reply_was_lost_lands_once_on_retry(redis_url: str, prefix: str) -> None:
    """The script ran but its reply never came back (a proxy cuts every reply); the caller's
    retry of the same put / put_writes lands nothing twice (an idempotency key from the write)."""
    import urllib.parse

    from reliability._proxy import FaultProxy

    from redis_session.errors import StoreUnavailableError

    parts = urllib.parse.urlsplit(redis_url)
    with FaultProxy(parts.port or 6379) as proxy:
        url = proxy.url.rsplit("/", 1)[0] + (parts.path or "/0")
        store = RedisSessionStore.from_url(url, prefix=prefix, client_options={"socket_timeout": 0.5})
        try:
            saver = RedisEventSaver(store)
            for thread in ("t", "fresh"):  # an existing thread, and a thread's very first write
                if thread == "t":
                    c1 = await saver.aput(_at(thread), *_cp("a"))
                    await saver.aput_writes(c1, [("a", 1)], "task")
                else:
                    c1 = {"configurable": {**_at(thread)["configurable"], "checkpoint_id": "x"}}
                calls = [
                    lambda c1=c1: saver.aput(c1, *_cp("b", 1)),
                    lambda c1=c1: saver.aput_writes(c1, [("b", 2), ("c", 3)], "task2"),
                ]
                for call in calls:
                    proxy.cut_up, proxy.cut_rate = False, 1.0  # commands reach the server, replies do not
                    with pytest.raises(StoreUnavailableError):
                        await call()
                    proxy.cut_rate = 0.0
                    await call()  # the retry
                kinds = [e.type for e in await store.read(saver.session_id(thread))]
                assert kinds.count(CHECKPOINT) == (2 if thread == "t" else 1), (thread, kinds)
                assert kinds.count(WRITE) == (3 if thread == "t" else 2), (thread, kinds)
            # the same write again later (not a retry) is still one write: readers see it once
            await saver.aput_writes(c1, [("b", 2), ("c", 3)], "task2")
            tup = await RedisEventSaver(store).aget_tuple(_at("t"))
            assert tup is not None
        finally:
            await store.aclose()
            await _cleanup(redis_url, prefix)
