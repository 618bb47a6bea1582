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
    """`module.function` (nested ones included, methods as module.Class.method; a module by
    its dotted path under `package`, e.g. `spd.step`) -> its node."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(package).with_suffix("").parts)

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    name = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        out[name] = child
                    visit(child, name)

        visit(tree, module)
    return out


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_function_is_over_60_lines_and_decompose_fits_a_screen():
    functions = {**_functions(), **{f"launcher.{k}": v for k, v in _functions(LAUNCHER).items()}}
    assert {"run.decompose.decompose", "spd.step.step", "launcher.job.run_job"} <= functions.keys()
    long = {name: _lines(f) for name, f in functions.items() if _lines(f) > MAX_LINES}
    assert not long, long
    assert _lines(functions["run.decompose.decompose"]) < 60


# The modules that turn a composed config into a run: below them nothing takes it.
RESOLVERS = ("core.config", "plan.validation", "plan.resolve")
ENTRY_POINTS = {"run.decompose.prepare", "run.decompose.decompose"}


def _takes_run_config(f: ast.FunctionDef) -> bool:
    args = [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]
    return any(a.annotation is not None and "RunConfig" in ast.unparse(a.annotation)
               for a in args)


def test_below_the_front_end_only_the_entry_points_take_a_run_config():
    takers = {name for name, f in _functions().items()
              if not name.startswith(RESOLVERS) and _takes_run_config(f)}
    assert takers == ENTRY_POINTS, takers


def test_the_library_imports_no_front_end_and_parses_no_command_line():
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in FRONT_ENDS, f"{path} imports {name}"
                assert name != "argparse", f"{path} parses a command line: launcher/commands/"


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
    assert {"pdecomp.core.config", "pdecomp.spd.step", "launcher.app"} <= graph.keys()
    assert _cycles(graph) == []
    assert graph["pdecomp.core.config"] == set(), graph["pdecomp.core.config"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# The floors, bottom up: each module imports only from its own floor and those below it.
FLOORS = ("core", "spd", "targets", "kinds", "plan", "gate", "run", "analysis")
# Within them: a frozen target does not know it is decomposed (of the method, only the
# components' matmul); the step knows no metrics, the metrics every kind shares no step.
RULES = (("targets.llama", "spd.", {"spd.components"}, "a target imports"),
         ("targets.toy_models", "spd.", {"spd.components"}, "a target imports"),
         ("spd.metrics", "spd.step", set(), "the shared metrics import"),
         ("spd.step", "spd.metrics", set(), "the step imports"))


def _library_imports() -> dict[str, set[str]]:
    """pdecomp module -> the pdecomp modules it imports, without the `pdecomp.` prefix."""
    return {m.removeprefix("pdecomp."): {d.removeprefix("pdecomp.") for d in deps
                                         if d.startswith("pdecomp.")}
            for m, deps in _import_graph().items() if m.startswith("pdecomp.")}


def _floor(module: str) -> int:
    head = module.split(".")[0]
    return FLOORS.index(head) if head in FLOORS else -1


def _breaches(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for m, deps in sorted(graph.items()):
        if m.count(".") == 0 and m not in FLOORS and m != "kinds":
            out.append(f"{m} is a module at pdecomp's top level, in no floor")
        up = sorted(d for d in deps if _floor(d) > _floor(m))
        if up:
            out.append(f"{m} imports upward: {up}")
        for module, prefix, allowed, what in RULES:
            bad = sorted(d for d in deps if d.startswith(prefix) and d not in allowed)
            if m == module and bad:
                out.append(f"{what} {m} -> {bad}")
    return out


def test_the_library_is_floors_importing_downward_only():
    graph = _library_imports()
    assert {"spd.step", "spd.metrics", "targets.llama", "run.decompose"} <= graph.keys()
    top = sorted(p.name for p in LIBRARY.glob("*.py"))
    assert len(top) <= 6, top
    assert sorted(p.name for p in LIBRARY.iterdir() if p.is_dir() and
                  (p / "__init__.py").is_file()) == sorted(FLOORS)
    assert _breaches(graph) == []


def test_the_floor_check_sees_a_breach():
    before = {"spd.metrics": {"spd.step", "targets.toy_models"}, "spd.ci_global": {"targets.llama"},
              "targets.llama": {"spd.masks"}, "gating": set()}
    assert _breaches(before) == [
        "gating is a module at pdecomp's top level, in no floor",
        "spd.ci_global imports upward: ['targets.llama']",
        "spd.metrics imports upward: ['targets.toy_models']",
        "the shared metrics import spd.metrics -> ['spd.step']",
        "a target imports targets.llama -> ['spd.masks']"]
