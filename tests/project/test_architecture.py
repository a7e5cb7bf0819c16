"""The package's shape (docs/development.md, "Repository layout"): no import cycle among esamp's modules at
import time, no module that imports from a package above it (its own package's ``__init__``
or an ancestor's), in ``esamp`` and in ``esamp_tui``, and no import, lazy or not, that points up a
layer (``LAYERS``). Read from the source, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file sits in tests/project/)
# The layers, top first: a module imports from its own layer and the ones below it, never from one
# above (the engines know nothing of the server, the commands or the dashboard).
LAYERS = (("esamp_tui", "esamp.commands"), ("esamp.serving", "esamp.eval"), ("esamp.engines",),
          ("esamp.core", "esamp.platform"), ("esamp.errors", "esamp.events"))


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph(package: str) -> dict[str, set[str]]:
    """Module → the package's modules it imports at its top level (imports inside functions are
    lazy: they form no import-time cycle)."""
    modules = _modules(package)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    stem = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(stem + ([base] if base else []))
                names = [f"{base}.{a.name}" if known(f"{base}.{a.name}") == f"{base}.{a.name}" else base
                         for a in node.names]
            else:
                continue
            graph[module] |= {t for t in map(known, names) if t and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, the package above it that it imports)."""
    return sorted((m, t) for m, targets in graph.items() for t in targets if m.startswith(t + "."))


@pytest.mark.parametrize("package", ["esamp", "esamp_tui"])
def test_no_import_cycle(package):
    assert _cycles(_graph(package)) == []


@pytest.mark.parametrize("package", ["esamp", "esamp_tui"])
def test_no_module_imports_from_a_package_above_it(package):
    assert _upward(_graph(package)) == []


def test_the_checks_see_a_cycle_and_an_arrow_back_up():
    """The canary: a made-up graph with both faults is caught."""
    graph = {"p": set(), "p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p"}}
    assert _cycles(graph) == [["p.a", "p.b"]]
    assert _upward(graph) == [("p.c", "p")]


def _layer(module: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS) if any(module == n or module.startswith(n + ".")
                                                            for n in names)), None)


def _up_a_layer(imports: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, what it imports from a layer above its own)."""
    return sorted((m, t) for m, targets in imports.items() for t in targets
                  if _layer(m) is not None and _layer(t) is not None and _layer(t) < _layer(m))


def _every_import(package: str) -> dict[str, set[str]]:
    """Module → every module it names in an absolute import, inside functions too."""
    out = {}
    for module, path in _modules(package).items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module)
        out[module] = names
    return out


@pytest.mark.parametrize("package", ["esamp", "esamp_tui"])
def test_no_import_points_up_a_layer(package):
    assert _up_a_layer(_every_import(package)) == []


def test_the_layer_check_sees_an_arrow_up():
    """The canary: an engine that imports the server's package, and a lazy import found."""
    graph = {"esamp.engines.vllm.x": {"esamp.serving.channel", "esamp.core.config"},
             "esamp.serving.y": {"esamp.engines.vllm.hooks"}}
    assert _up_a_layer(graph) == [("esamp.engines.vllm.x", "esamp.serving.channel")]
    assert "esamp.engines.vllm" in _every_import("esamp")["esamp.engines.vllm.engine"]  # plugin, in a function
