"""Architecture rules that import-linter cannot express (docs/design.md §0).

- redis-py internals in one place: only ``redis/wire.py`` (the standalone path) and
  ``redis/cluster.py`` (cluster routing) name redis-py's members below its command API.
"""

from __future__ import annotations

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
