"""The import graph of ``src/rlpipe``, read from the code (imports inside functions included): the layers that
must not form a cycle.

A lazy import (inside a function) still couples two modules: it only moves the failure from import time to
call time. So the graph counts every ``import`` statement. Importing ``a.b.c`` also runs ``a.b``'s
``__init__``, so an import adds an edge to each enclosing package too (not to the importer's own packages,
which are already being initialised when it runs).

Run as a script to print every cycle of the package: ``python tests/test_import_graph.py``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Every module of these packages stays out of any cycle.
ACYCLIC = ("rlpipe.config", "rlpipe.envs", "rlpipe.yamlio", "rlpipe.registry",
           "rlpipe.rewards.base")


def module_names(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name → file, for every module of the ``rlpipe`` package."""
    out = {}
    for path in sorted((src / "rlpipe").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(node: ast.AST, here: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The ``rlpipe`` modules one import statement names (``from p import m`` names ``p.m`` where that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # a relative import: resolve it against this module's package
        package = here.split(".") if is_package else here.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module → the ``rlpipe`` modules it imports (and their enclosing packages, below ``rlpipe`` itself)."""
    known = module_names(src)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for here, path in known.items():
        own = {".".join(here.split(".")[:i]) for i in range(1, here.count(".") + 2)}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, here, path.name == "__init__.py", known):
                parts = name.split(".")
                for i in range(2, len(parts) + 1):  # the module and each package above it
                    target = ".".join(parts[:i])
                    if target in known and target not in own:
                        graph[here].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _in_acyclic_layer(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in ACYCLIC)


def test_the_graph_sees_lazy_imports(tmp_path):
    pkg = tmp_path / "rlpipe"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py"):
        (pkg / name).write_text("")
    (pkg / "a.py").write_text("def f():\n    from rlpipe.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    graph = import_graph(tmp_path)
    assert graph["rlpipe.a"] == {"rlpipe.sub", "rlpipe.sub.b"}
    assert cycles(graph) == [["rlpipe.a", "rlpipe.sub.b"]]


def test_config_envs_and_the_registries_are_in_no_import_cycle():
    bad = [c for c in cycles(import_graph()) if any(_in_acyclic_layer(m) for m in c)]
    assert not bad, f"import cycles through config/envs/registries: {bad}"


# The layers of rlpipe's packages and top-level modules, lowest first: a module imports only from its own
# package or from a lower layer. A new package or module takes its place here.
LAYERS = (
    ("yamlio", "registry", "jsonl", "net", "procs", "http_client", "tokens", "progress", "sandbox", "eta", "threads",
     "audit"),
    ("algorithms", "envs", "summary", "healing"),
    ("config", "rewards"),
    ("storage", "guards", "stack"),
    ("data", "history", "retention", "tracking", "lineage"),
    ("runs", "alerts"),
    ("resume", "rollback"),
    ("training",),
    ("rollout",),
    ("runtime", "services", "evaluation", "doctor", "stages", "rescore"),
    ("eval_suite", "cli"),
)


def _room(module: str) -> str:
    """``rlpipe.rollout.batch`` → ``rollout``; ``rlpipe.guards`` → ``guards``."""
    return module.split(".")[1] if module.count(".") else ""


def test_no_module_imports_from_a_higher_layer():
    layer = {room: k for k, rooms in enumerate(LAYERS) for room in rooms}
    graph = import_graph()
    rooms = {_room(m) for m in graph} - {""}
    assert not (unplaced := sorted(rooms - set(layer))), f"place these in LAYERS: {unplaced}"
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                if _room(a) and _room(b) and _room(a) != _room(b) and layer[_room(b)] >= layer[_room(a)])
    assert not up, "imports from the same or a higher layer:\n  " + "\n  ".join(up)


if __name__ == "__main__":
    for component in cycles(import_graph()):
        print(" <-> ".join(component))
