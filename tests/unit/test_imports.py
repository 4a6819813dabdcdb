"""The import graph of dtrain/: every module imports, there is no cycle, and the layers of
docs/ARCHITECTURE.md ("Layers and packages") hold.

The graph is read from the source (AST), so it covers imports inside functions too:
``import dtrain.x``, ``from dtrain.x import y`` (an edge to ``dtrain.x.y`` when that is a
module, else to ``dtrain.x``) and relative imports. An edge from a module to one of its
own parent packages is left out (``dtrain.status.http`` may import ``dtrain.status``,
whose ``__init__`` imports ``dtrain.status.model``): that is not a cycle of concerns.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "dtrain"
LAB_DIR = REPO / "experiments"  # the lab: a package over dtrain, checked for cycles and sys.path edits

# The layers, lowest first (docs/ARCHITECTURE.md, "Layers and packages"). A module may
# import modules of its own unit and of units in strictly lower layers, never of its own
# layer's other units or of a higher one. A new top-level module or package must be
# placed here and in ARCHITECTURE.md's table (the test fails for one it does not know).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "protocol", "_proto", "native"),  # vocabulary of the wire and of failures; the C build
    ("codecs", "options"),  # codecs; the config-tree generator (standard library only)
    ("configs",),  # the torch-free component configs (nested into one tree by dtrain.app.config)
    ("buckets", "aggregation", "checkpoint", "tasks", "status", "metrics"),  # leaves: no I/O between sites
    (
        "transports",
        "probe",
    ),  # moving bytes between sites: the Transport interface and its implementations; the path probe
    ("state",),  # θ, outer optimizer, residuals; whole-state transfer for joiners
    ("rounds", "rendezvous"),  # one round's protocol; membership and quorum
    ("membership", "streaming", "sitegroup"),  # rendezvous client and heartbeats; fragment rounds; K ranks' pieces
    ("site",),  # one site's (one rank's) side of the round protocol, for K >= 1 ranks
    ("diloco",),  # the library wrapper, for a site of K >= 1 ranks
    ("sim",),  # the in-process cluster
    ("app",),  # CLI, launcher, worker process, report
    ("__main__",),  # `python -m dtrain`
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}

# Narrower rules inside the layers, as (importing prefix, allowed dtrain prefixes).
NARROW_RULES: list[tuple[str, tuple[str, ...]]] = [
    # the quorum core is pure: no gRPC, no transport
    ("dtrain.rendezvous.core", ("dtrain.errors", "dtrain.protocol", "dtrain.rendezvous")),
    # the round engine talks to the Transport interface, never to one implementation
    (
        "dtrain.rounds",
        (
            "dtrain.rounds",
            "dtrain.transports.base",
            "dtrain.transports.pacing",  # the pure send pacer (fragment rounds' budget)
            "dtrain.errors",
            "dtrain.protocol",
            "dtrain.codecs",
            "dtrain.buckets",
            "dtrain.aggregation",
            "dtrain.state",
            "dtrain.configs",
        ),
    ),
    # the status model is a leaf: it parses and aggregates round reports only
    ("dtrain.status.model", ("dtrain.errors",)),
    # the metrics schema is a leaf: dataclasses and their one reader
    ("dtrain.metrics", ()),
]

# KNOWN CYCLES: none (dtrain.app.cli and dtrain.app.launch imported each other until the
# config tree of issue 12). Do not add entries here.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(root.rglob("*.py")) if "out" not in p.relative_to(root).parts}


MODULES = _all_modules()
LAB_MODULES = _all_modules(LAB_DIR)


def _resolve(name: str, modules: dict[str, Path] = MODULES) -> str | None:
    """The module an import of ``name`` loads (the longest prefix that is a module)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path`` parsed once per test process: the graphs below and the tests read the same trees."""
    return ast.parse(path.read_text(), str(path))


def _imports_of(module: str, path: Path, top: str = "dtrain", modules: dict[str, Path] = MODULES) -> set[str]:
    """Modules of package ``top`` (in ``modules``) that ``module`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
        else:
            continue
        for name in names:
            if name == top or name.startswith(top + "."):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    targets.add(target)
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    return targets - ancestors


GRAPH = {m: _imports_of(m, p) for m, p in MODULES.items()}
LAB_GRAPH = {m: _imports_of(m, p, "experiments", LAB_MODULES) for m, p in LAB_MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the root package dtrain/__init__.py


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "dtrain.__main__"))
def test_every_module_imports(module):
    """Importing each module alone works (``dtrain.__main__`` runs the CLI, so it is only parsed)."""
    assert importlib.import_module(module).__name__ == module


@pytest.mark.timeout(10)
def test_graph_sees_function_level_and_relative_imports():
    """The reader follows imports inside functions (the root package imports diloco lazily)."""
    assert "dtrain.diloco" in GRAPH["dtrain"]
    assert "dtrain.app.cli" in GRAPH["dtrain.__main__"]
    assert {"dtrain.status.model"} <= GRAPH["dtrain.status"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


@pytest.mark.timeout(10)
def test_no_import_cycles():
    cycles = set(_cycles(GRAPH))
    new = sorted(sorted(c) for c in cycles - KNOWN_CYCLES)
    assert new == [], f"import cycles: {new}"
    gone = sorted(sorted(c) for c in KNOWN_CYCLES - cycles)
    assert gone == [], f"no longer a cycle, remove it from KNOWN_CYCLES: {gone}"


@pytest.mark.timeout(10)
def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES} - {None}
    unknown = sorted(units - set(LAYER_OF))
    assert unknown == [], (
        f"dtrain/{unknown} not in a layer: add it to LAYERS here and to docs/ARCHITECTURE.md, 'Layers and packages'"
    )


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        unit = _unit(module)
        if unit is None or unit not in LAYER_OF:
            continue
        for target in sorted(targets):
            other = _unit(target)
            if other is None or other == unit or other not in LAYER_OF:
                continue
            if LAYER_OF[other] >= LAYER_OF[unit]:
                bad.append(f"{module} -> {target} (layer {LAYER_OF[unit]} may not import layer {LAYER_OF[other]})")
    return bad


def _narrow_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for prefix, allowed in NARROW_RULES:
        for module, targets in sorted(graph.items()):
            if module != prefix and not module.startswith(prefix + "."):
                continue
            for target in sorted(targets):
                if not any(target == a or target.startswith(a + ".") for a in allowed):
                    bad.append(f"{module} -> {target} (allowed: {', '.join(allowed) or 'nothing in dtrain'})")
    return bad


@pytest.mark.timeout(10)
def test_imports_go_down_the_layers():
    bad = _layer_violations(GRAPH)
    assert bad == [], "\n".join(bad)


@pytest.mark.timeout(10)
def test_narrow_rules():
    bad = _narrow_violations(GRAPH)
    assert bad == [], "\n".join(bad)


@pytest.mark.timeout(10)
def test_the_checks_find_violations_in_a_made_up_graph():
    graph = {
        "dtrain.rounds.engine": {"dtrain.status.model", "dtrain.rendezvous.core", "dtrain.transports.grpc"},
        "dtrain.rendezvous.core": {"dtrain.status.model", "dtrain.app.cli"},
        "dtrain.status.model": {"dtrain.protocol"},
        "dtrain.protocol": set(),
    }
    assert _layer_violations(graph) == [
        "dtrain.rendezvous.core -> dtrain.app.cli (layer 6 may not import layer 11)",
        "dtrain.rounds.engine -> dtrain.rendezvous.core (layer 6 may not import layer 6)",
    ]
    narrow = _narrow_violations(graph)
    assert [line.split(" (")[0] for line in narrow] == [
        "dtrain.rendezvous.core -> dtrain.app.cli",
        "dtrain.rendezvous.core -> dtrain.status.model",
        "dtrain.rounds.engine -> dtrain.rendezvous.core",
        "dtrain.rounds.engine -> dtrain.status.model",
        "dtrain.rounds.engine -> dtrain.transports.grpc",
        "dtrain.status.model -> dtrain.protocol",
    ]


@pytest.mark.timeout(10)
def test_the_lab_has_no_import_cycles():
    """experiments/ is a package whose modules import each other without a cycle (imports
    under ``TYPE_CHECKING`` and inside functions count: they are cycles of concerns too)."""
    assert "experiments.common" in LAB_GRAPH["experiments.convergence"]
    cycles = sorted(sorted(c) for c in _cycles(LAB_GRAPH))
    assert cycles == [], f"import cycles in experiments/: {cycles}"


@pytest.mark.timeout(10)
def test_the_lab_does_not_edit_sys_path_and_dtrain_does_not_import_it():
    """Experiments run as ``python -m experiments...`` from the repository root: no module edits
    ``sys.path`` to find its neighbours, and the library never imports the lab."""
    edits = [
        f"{m}:{node.lineno}"
        for m, p in sorted(LAB_MODULES.items())
        for node in ast.walk(_tree(p))
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys"
    ]
    assert edits == [], f"sys.path used in: {edits}"
    lab_users = sorted(m for m, p in MODULES.items() if _imports_of(m, p, "experiments", LAB_MODULES))
    assert lab_users == [], lab_users


# Issue 31: no function of experiments/ spans more than MAX_FUNCTION_LINES (split it into named steps).
MAX_FUNCTION_LINES = 100


def _long_functions(tree: ast.Module, module: str, limit: int) -> set[str]:
    """``module:name`` of every function (methods and nested ones too) spanning more than ``limit``
    lines, its decorators and docstring included."""
    return {
        f"{module}:{node.name}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    }


@pytest.mark.timeout(10)
def test_no_function_in_the_lab_is_longer_than_100_lines():
    assert _long_functions(ast.parse("def f():\n" + "    x = 1\n" * 100), "m", MAX_FUNCTION_LINES) == {"m:f"}
    assert _long_functions(ast.parse("def f():\n" + "    x = 1\n" * 99), "m", MAX_FUNCTION_LINES) == set()
    long = set().union(*(_long_functions(_tree(p), m, MAX_FUNCTION_LINES) for m, p in LAB_MODULES.items()))
    assert long == set(), f"split these (at most {MAX_FUNCTION_LINES} lines): {sorted(long)}"


@pytest.mark.timeout(10)
def test_every_micro_benchmark_uses_the_one_parser_and_output_writer():
    """Issue 31: the bench_* scripts share experiments.bench's parser and writer (``--json`` in one
    stamped form), none builds its own ArgumentParser or writes its own JSON."""
    benches = sorted(p for p in LAB_DIR.glob("bench_*.py"))
    assert len(benches) >= 10
    for p in benches:
        src = p.read_text()
        assert "bench.parser(" in src and "bench.write(" in src, p.name
        assert "argparse.ArgumentParser(" not in src and "json.dumps(" not in src.split("def main", 1)[-1], p.name
