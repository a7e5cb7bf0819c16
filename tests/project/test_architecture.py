"""The package's shape (docs/development.md, "Layers").

import-linter holds the contracts written in ``pyproject.toml``: the layers, no import cycle between
the modules or subpackages of one package, no dashboard in ``esamp``, vLLM imported only at the edge.
CI runs them with ``lint-imports``; ``test_the_import_contracts_hold`` runs them with the tests too.

What import-linter cannot say is checked here, from the source, nothing imported:

- every folder of ``esamp`` and ``esamp_tui`` that holds modules is a package with an ``__init__.py``:
  import-linter sees only those, so a folder without one falls out of every contract;
- no module imports, at import time, a package above it (its own package's ``__init__`` or an
  ancestor's). import-linter's cycle contract compares the modules of one package with each other,
  never with the package's ``__init__``; with this rule beside it, no import-time cycle is left;
- the layers drawn in docs/development.md are the layers of the contract.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file sits in tests/project/)
PACKAGES = ["esamp", "esamp_tui"]


def _modules(package: str, root: Path) -> dict[str, Path]:
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _import_time_nodes(tree: ast.Module):
    """The import statements that run when the module is imported: the module's own statements and
    those inside its ``if``, ``try``, ``with`` and class bodies, not those inside functions."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
            for field in ("handlers", "cases"):  # except and match clauses hold statements one level down
                for clause in getattr(node, field, None) or []:
                    todo.extend(clause.body)


def _graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the package's modules it imports at import time."""
    modules = _modules(package, root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _import_time_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    stem = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(stem + ([base] if base else []))
                names = [
                    f"{base}.{a.name}" if known(f"{base}.{a.name}") == f"{base}.{a.name}" else base for a in node.names
                ]
            graph[module] |= {t for t in map(known, names) if t and t != module}
    return graph


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, the package above it that it imports)."""
    return sorted((m, t) for m, targets in graph.items() for t in targets if m.startswith(t + "."))


def test_the_import_contracts_hold():
    run = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    done = subprocess.run(
        [sys.executable, "-c", run, "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("package", PACKAGES)
def test_every_folder_of_modules_is_a_package(package):
    folders = {path.parent for path in (ROOT / package).rglob("*.py")}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_from_a_package_above_it(package):
    assert _upward(_graph(package)) == []


def test_the_check_sees_an_arrow_back_up(tmp_path):
    """The canary: an import of the package's ``__init__``, inside a ``try`` at module level, is
    caught; the same import inside a function is not (it runs after the package is loaded)."""
    package = tmp_path / "p"
    package.mkdir()
    (package / "__init__.py").write_text("from p import a\n")
    (package / "a.py").write_text("try:\n    import p\nexcept ImportError:\n    pass\n")
    (package / "b.py").write_text("def f():\n    from p import a\n    import p\n")
    assert _upward(_graph("p", tmp_path)) == [("p.a", "p")]


def test_the_layers_drawn_in_the_docs_are_the_contracts():
    """docs/development.md draws the layers from the top; each line of the drawing that names modules
    starts with one layer exactly as the contract writes it."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    layers = next(c["layers"] for c in contracts["contracts"] if c["type"] == "layers")
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1]
    drawing = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    drawn = [re.split(r"\s{2,}", line.strip())[0] for line in drawing.splitlines() if line.startswith("esamp")]
    assert drawn == layers
