"""The package's layering, checked from the source: the model-building layers never reach up
into the engine or the front ends, the engine never into the front ends, and no two modules
import each other at module level (directly or round a longer loop)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gemel"

# package -> the packages it must never import (anywhere in its modules, lazily or not)
FORBIDDEN = {
    "layers": ("engine", "api", "gateway", "observability"),
    "models": ("engine", "api", "gateway", "observability"),
    "loader": ("engine", "api", "gateway", "observability"),
    "engine": ("api", "gateway"),
    "scale": ("api", "gateway"),  # engine replicas sit below the front end, like the engine
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module_level_only: bool) -> set[str]:
    """gemel modules named by import statements (module level only: not inside functions or
    `if TYPE_CHECKING:` blocks, which do not run at import time)."""
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not module_level_only:
                    visit(child, False)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                if not module_level_only:
                    visit(child, top)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("gemel"))
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("gemel"):
                found.add(child.module)
                found.update(f"{child.module}.{a.name}" for a in child.names)  # `from gemel.layers import fused`
            visit(child, top)

    visit(tree, True)
    return found


def _sources() -> dict[str, ast.AST]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def test_lower_layers_never_import_upper_ones():
    sources = _sources()
    assert len(sources) > 50
    broken = []
    for module, tree in sources.items():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in FORBIDDEN:
            continue
        for name in _imports(tree, module_level_only=False):
            target = name.split(".")
            if len(target) > 1 and target[1] in FORBIDDEN[parts[1]]:
                broken.append(f"{module} imports {name}")
    assert not broken, broken


def test_no_import_cycles_at_module_level():
    sources = _sources()
    graph = {m: {n for n in _imports(t, module_level_only=True) if n in sources and n != m} for m, t in sources.items()}
    # a package's own __init__ is not an edge back into the package's modules
    graph = {m: {n for n in edges if not m.startswith(n + ".")} for m, edges in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not cycles, cycles


def test_the_checker_sees_a_forbidden_import():
    """The rules above can fail: a lazy import inside a function is found too."""
    tree = ast.parse("def f():\n    from gemel.engine.core import EngineCore\n")
    assert "gemel.engine.core" in _imports(tree, module_level_only=False)
    assert "gemel.engine.core" not in _imports(tree, module_level_only=True)
