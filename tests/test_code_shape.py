"""The code's shape, as the design promises it: small functions a newcomer reads top to
bottom, a `decompose` that shows the whole run on one screen, a run resolved once (nothing
below the front end takes the raw config), no front-end imports, and layers whose imports
point down."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "pdecomp"
LAUNCHER = LIBRARY.parent / "launcher"
FRONT_ENDS = ("hydra", "omegaconf", "submitit", "wandb", "launcher")
MAX_LINES = 60


def _functions(package: Path = LIBRARY) -> dict[str, ast.FunctionDef]:
    """`module.function` (nested ones included, methods as module.Class.method) -> its node."""
    out = {}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    name = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        out[name] = child
                    visit(child, name)

        visit(tree, path.stem)
    return out


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_function_is_over_60_lines_and_decompose_fits_a_screen():
    functions = {**_functions(), **{f"launcher.{k}": v for k, v in _functions(LAUNCHER).items()}}
    assert {"run.decompose", "train.step", "launcher.job.run_job"} <= functions.keys()
    long = {name: _lines(f) for name, f in functions.items() if _lines(f) > MAX_LINES}
    assert not long, long
    assert _lines(functions["run.decompose"]) < 60


# The modules that turn a composed config into a run: below them nothing takes it.
RESOLVERS = ("config", "validation", "resolve")
ENTRY_POINTS = {"run.prepare", "run.decompose"}


def _takes_run_config(f: ast.FunctionDef) -> bool:
    args = [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]
    return any(a.annotation is not None and "RunConfig" in ast.unparse(a.annotation)
               for a in args)


def test_below_the_front_end_only_the_entry_points_take_a_run_config():
    takers = {name for name, f in _functions().items()
              if name.split(".")[0] not in RESOLVERS and _takes_run_config(f)}
    assert takers == ENTRY_POINTS, takers


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


# Layers, bottom up. A frozen target does not know it is decomposed; the CI function does
# not know the target; the step knows neither the kinds nor the metrics; the metrics every
# kind shares know no kind and no training; nothing under the run's phases imports them.
TARGETS = {"toy_models", "llama"}
TARGET_MAY_IMPORT = {"components", "config", "threefry", "blocks", "units"}
STEP = {"adversary", "blocks", "ci", "ci_global", "components", "losses", "masks", "metrics",
        "sharding", "train", "threefry", *TARGETS}
RUN_PHASES = {"resolve", "shapes", "gating", "training", "evaluation", "resume", "rundir",
              "run", "runs", "analyze"}
KINDS = {"kinds", "toys", "lm", "targets"}


def _library_imports() -> dict[str, set[str]]:
    """pdecomp module -> the pdecomp modules it imports (by short name)."""
    return {m.removeprefix("pdecomp."): {d.removeprefix("pdecomp.") for d in deps
                                         if d.startswith("pdecomp.")}
            for m, deps in _import_graph().items() if m.startswith("pdecomp.")}


def _boundary_breaches(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for m, deps in sorted(graph.items()):
        rules = [(m in TARGETS, deps - TARGET_MAY_IMPORT, "a target imports"),
                 (m in STEP, deps & (RUN_PHASES | KINDS), "the step's layer imports"),
                 (m in {"ci", "ci_global"}, deps & TARGETS, "the CI function imports"),
                 (m == "metrics", deps & {"train", *TARGETS}, "the shared metrics import"),
                 (m == "train", deps & {"metrics"}, "the step imports")]
        out += [f"{what} {m} -> {sorted(bad)}" for applies, bad, what in rules if applies and bad]
    return out


def test_the_layers_import_downward_only():
    graph = _library_imports()
    assert {"train", "metrics", "llama", "ci_global", "run"} <= graph.keys()
    assert _boundary_breaches(graph) == []


def test_the_boundary_check_sees_a_breach():
    # the shape before the run was resolved once: metrics on train and the toy models, the
    # global CI transformer on the Llama
    before = {"metrics": {"train", "toy_models"}, "ci_global": {"llama"}, "llama": {"masks"}}
    assert _boundary_breaches(before) == [
        "the CI function imports ci_global -> ['llama']",
        "a target imports llama -> ['masks']",
        "the shared metrics import metrics -> ['toy_models', 'train']"]
