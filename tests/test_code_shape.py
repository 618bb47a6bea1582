"""The library's shape, as the design promises it: small functions a newcomer reads top to
bottom, a `decompose` that shows the whole run on one screen, and no front-end imports."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "pdecomp"
FRONT_ENDS = ("hydra", "omegaconf", "submitit", "wandb", "launcher")


def _functions() -> dict[str, int]:
    """`module.function` (nested ones included, methods as module.Class.method) -> lines."""
    out = {}
    for path in sorted(LIBRARY.glob("*.py")):
        tree = ast.parse(path.read_text())

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    name = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        out[name] = child.end_lineno - child.lineno + 1
                    visit(child, name)

        visit(tree, path.stem)
    return out


def test_no_function_is_over_100_lines_and_decompose_fits_a_screen():
    functions = _functions()
    assert "run.decompose" in functions and "train.step" in functions
    long = {name: n for name, n in functions.items() if n > 100}
    assert not long, long
    assert functions["run.decompose"] < 60, functions["run.decompose"]


def test_the_library_imports_no_front_end():
    for path in sorted(LIBRARY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in FRONT_ENDS, f"{path.name} imports {name}"


ROOT = LIBRARY.parent


def _import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in it (a function-level import
    counts: a lazy import is still a dependency), over `pdecomp/` and `launcher/`."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for pkg in ("pdecomp", "launcher") for p in sorted((ROOT / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = (deps & modules.keys()) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_and_the_schema_at_the_bottom():
    graph = _import_graph()
    assert {"pdecomp.config", "pdecomp.train", "launcher.app"} <= graph.keys()
    assert _cycles(graph) == []
    assert graph["pdecomp.config"] == set(), graph["pdecomp.config"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
