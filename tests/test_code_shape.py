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
