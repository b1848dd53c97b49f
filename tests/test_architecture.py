"""Architecture rules that import-linter cannot express (docs/design.md §0).

- redis-py internals in one place: only ``redis/wire.py`` (the standalone path) and
  ``redis/cluster.py`` (cluster routing) name redis-py's members below its command API.
- no import cycle inside any package, counting imports in function bodies and a package's
  ``__init__`` as a module of its own (import-linter's ``acyclic_siblings`` contract sees the
  imports between sibling modules, not a cycle that runs through their package's ``__init__``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import redis_session

PACKAGE = Path(redis_session.__file__).resolve().parent

# redis-py members below its public command API: connections, pools, reply parsing, topology.
INTERNALS = (
    "send_packed_command",
    "read_response",
    "response_callbacks",
    "nodes_manager",
    "acquire_connection",
    "get_connection",
    "connection_kwargs",
    "connection_pool",
    "NEVER_DECODE",
)
WIRE = {"redis/wire.py", "redis/cluster.py"}


def test_only_the_wire_and_cluster_modules_touch_redis_py_internals() -> None:
    pattern = re.compile(r"\b(" + "|".join(INTERNALS) + r")\b")
    offenders: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in WIRE:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "redis-py internals outside redis/wire.py and redis/cluster.py:\n" + "\n".join(offenders)


def test_the_gateway_package_init_loads_no_module_of_its_own_eagerly() -> None:
    """Importing one gateway module first (``gateway.routes``, as a worker or a test does) must not
    run ``gateway.app`` — which imports every route module — half-way through, as the package's
    ``__init__`` once did (a cycle through ``__init__`` import-linter cannot see; its acyclic
    contract covers the imports between sibling modules)."""
    import subprocess
    import sys

    code = "import sys, redis_session.gateway.routes; print('redis_session.gateway.app' in sys.modules)"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stdout + probe.stderr


# --------------------------------------------------------------------------- import cycles


def _module_names() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The package's modules an import statement of `module` loads: ``from . import x`` names the
    module ``x`` when there is one, else the package whose names it takes."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    root = PACKAGE.name
    if isinstance(node, ast.Import):
        return [m for a in node.names if a.name.split(".")[0] == root and (m := known(a.name))]
    if node.level:
        base = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    if target.split(".")[0] != root:
        return []
    out = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        found = sub if sub in modules else known(target)
        if found:
            out.append(found)
    return out


def import_graph() -> dict[str, set[str]]:
    """Every module of the package to the modules it imports: at the top, in function bodies,
    under ``if TYPE_CHECKING:`` — every import statement in the file."""
    modules = _module_names()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(t for t in _imported(module, node, modules) if t != module)
    return graph


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """For each package, its ``__init__`` and its direct children (a subpackage stands for all of
    its modules) as nodes, an edge where one imports the other: the cycles among them."""
    packages = [m for m in graph if any(x.startswith(m + ".") for x in graph)]
    cycles: list[list[str]] = []
    for pkg in packages:

        def node(m: str, pkg: str = pkg) -> str | None:
            if m == pkg:
                return pkg
            if not m.startswith(pkg + "."):
                return None
            return pkg + "." + m[len(pkg) + 1 :].split(".")[0]

        edges: dict[str, set[str]] = {}
        for a, targets in graph.items():
            if (na := node(a)) is None:
                continue
            for t in targets:
                if (nt := node(t)) is not None and nt != na:
                    edges.setdefault(na, set()).add(nt)
        state: dict[str, int] = {}  # 1: on the path, 2: done

        def walk(u: str, path: list[str], edges: dict[str, set[str]] = edges, state: dict[str, int] = state) -> None:
            state[u] = 1
            path.append(u)
            for v in sorted(edges.get(u, ())):
                if state.get(v) == 1:
                    cycles.append([*path[path.index(v) :], v])
                elif v not in state:
                    walk(v, path)
            path.pop()
            state[u] = 2

        for u in sorted(edges):
            if u not in state:
                walk(u, [])
    return cycles


def test_no_package_has_an_import_cycle_function_level_imports_included() -> None:
    cycles = package_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_imports_in_functions_and_through_a_package_init() -> None:
    """The check itself: the two cycles docs/design.md §0 forbids, written the ways a cycle hides
    (an import in a function body; a module importing its package's ``__init__``, which loads it
    back lazily), are found."""
    hidden = {k: set(v) for k, v in import_graph().items()}
    hidden["redis_session.redis.doctor"].add("redis_session.redis.store")  # `def f(): from .store import …`
    hidden["redis_session.gateway.routes"].add("redis_session.gateway")  # `from ..gateway import serve`
    found = [set(c) for c in package_cycles(hidden)]
    assert {"redis_session.redis.doctor", "redis_session.redis.store"} in found, found
    assert {"redis_session.gateway", "redis_session.gateway.app", "redis_session.gateway.routes"} in found, found
    source = ast.parse("def f() -> None:\n    from .store import RedisSessionStore\n")
    [stmt] = [n for n in ast.walk(source) if isinstance(n, ast.ImportFrom)]
    assert _imported("redis_session.redis.doctor", stmt, _module_names()) == ["redis_session.redis.store"]
