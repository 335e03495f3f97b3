"""The layering (docs/architecture.md): `planner/` is pure (no torch, no runtime, no composition root, no
dashboard), its packages import downwards only (`PLANNER_LAYERS`), `runtime/`'s files only down its
layers (`RUNTIME_LAYERS`), and neither `planner/`'s nor `runtime/`'s modules import each other in a
cycle. All read the source with `ast`, so an import inside a function counts as much as one at the
top of a module (the interpreter would only find it when the function runs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLANNER_FORBIDS = ("torch", "runtime", "tierwise", "app")
"""Top-level packages `planner/` must never import: torch and the runtime are heavy and optional
(the `runtime` extra), `tierwise` is the composition root above it and `app` the dashboard."""
PLANNER_LAYERS: tuple[str, ...] = (
    "planner.specs",  # the documents and their vocabularies
    "planner.cost",  # the analytic cost models, and whether they can price a plan
    "planner.sim",  # the discrete-event simulator
    "planner.search",  # the placement search
    "planner.validation",  # predictions against published runs
    "planner.calibration",  # predictions against our own runs
    "planner.output",  # tables, charts and other frameworks' configs
)
"""`planner/`'s packages, lowest first (docs/architecture.md, "The layers"): a module imports from its
own package and those listed before it, never from one listed after it."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, *, executed_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at module level or nested in a function, class or branch; with
    `executed_only`, not those under `if TYPE_CHECKING:` (annotations only: they never run)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif executed_only and _is_type_checking(node):
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return sorted(found, key=lambda n: n.lineno)


def _imports(path: Path, *, executed_only: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; `from . import x` is resolved
    against the file's package, and `from pkg import name` yields `pkg.name` too (it may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in _import_nodes(tree, executed_only=executed_only):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            anchor = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        found.append((node.lineno, base))
        found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def test_imports_are_resolved_from_the_source():
    # The parser the two tests below rely on: nested and relative imports are seen.
    source = ROOT / "runtime" / "nvme" / "__init__.py"
    names = {name for _, name in _imports(source)}
    assert any(name.startswith("runtime.nvme.") for name in names), names
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
                     "def f():\n    from .d import e\n")
    assert [n.lineno for n in _import_nodes(tree, executed_only=False)] == [1, 3, 5, 7]
    assert [n.lineno for n in _import_nodes(tree, executed_only=True)] == [1, 5, 7]


def test_planner_imports_no_torch_runtime_tierwise_or_app():
    offences = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        for line, name in _imports(path):
            if name.split(".")[0] in PLANNER_FORBIDS:
                offences.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not offences, "planner/ must stay pure:\n" + "\n".join(offences)


def _modules(package: str) -> dict[str, Path]:
    """Module name -> file, for every module of `package`."""
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _graph(package: str, *, executed_only: bool = True) -> dict[str, set[str]]:
    """Module of `package` -> the modules of `package` it imports. An import inside a function
    counts: deferring an import is how a cycle is hidden from the interpreter, not how it is removed
    (the two modules still cannot be understood, tested or moved apart). With `executed_only`, the
    `if TYPE_CHECKING:` imports, which never run, are left out."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # `from pkg.x import y`: an edge to pkg.x.y only where that is a module.
        graph[name] = {imported for _, imported in _imports(path, executed_only=executed_only)
                       if imported in modules and imported != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_cycle_finder_names_every_module_of_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["planner", "runtime"])
def test_no_import_cycle(package):
    cycles = _cycles(_graph(package))
    assert not cycles, f"import cycles among {package}/ modules:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles)


def _layer(module: str) -> int | None:
    """Index in `PLANNER_LAYERS` of the package holding `module`; None outside them."""
    return next((i for i, package in enumerate(PLANNER_LAYERS)
                 if module == package or module.startswith(package + ".")), None)


def test_layer_finder_reads_packages_not_prefixes():
    assert _layer("planner.specs.plan") == 0 and _layer("planner.cost") == 1
    assert _layer("planner.output.report") == len(PLANNER_LAYERS) - 1
    assert _layer("planner.costly") is None and _layer("planner") is None


def test_every_planner_module_is_in_a_layer():
    # The package's own __init__ (its version) is the one module above the layers.
    outside = sorted(m for m in _graph("planner") if m != "planner" and _layer(m) is None)
    assert not outside, f"planner/ modules in no package of PLANNER_LAYERS: {outside}"


def test_planner_layers_import_downwards():
    # Annotation-only imports count too: a lower layer never names a higher one. (Modules outside
    # the layers are the test above's to report.)
    layered = {m: imports for m, imports in _graph("planner", executed_only=False).items() if _layer(m) is not None}
    upward = [f"{module} ({PLANNER_LAYERS[_layer(module)]}) imports {imported} ({PLANNER_LAYERS[_layer(imported)]})"
              for module, imports in sorted(layered.items())
              for imported in sorted(imports) if imported in layered and _layer(imported) > _layer(module)]
    assert not upward, "planner/ layers import downwards only (PLANNER_LAYERS):\n" + "\n".join(upward)


RUNTIME_LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime/ledger.py", "runtime/profiler.py", "runtime/faults.py"),
    ("runtime/nvme/",),
    ("runtime/plan_check.py", "runtime/plan_io.py"),
    ("runtime/transfer/",),
    ("runtime/units/",),
    ("runtime/optim/", "runtime/ckpt/"),
    ("runtime/__init__.py", "runtime/sharding.py", "runtime/optimizer.py", "runtime/launch.py",
     "runtime/probe.py", "runtime/precision_probe.py", "runtime/local_hardware.py", "runtime/memory_probe.py", "runtime/model_check.py", "runtime/gpt.py",
     "runtime/hf_model.py", "runtime/host_malloc.py", "runtime/process_exit.py"),
)
"""runtime/'s layers, lowest first (a folder stands for every file in it); a file imports only
files of its own layer or a lower one. From the bottom: the accounting every layer charges (ledger,
profiler) and fault points; the torch-free NVMe I/O library; the plan as the runtime reads it;
moving bytes between tiers and ranks (stores, copies, collectives); a unit's lifetime (build,
gather, prefetch, gradients, recompute); the optimizer engines and schedules, and training
checkpoints, which both work on units; and the public verbs (`shard`, `AdamW`), the rank's process
and the models it trains."""


def _layer_of_each_runtime_module() -> dict[str, list[int]]:
    """runtime module -> the index of every layer that names its file (exactly one when placed)."""
    found: dict[str, list[int]] = {}
    for name, path in _modules("runtime").items():
        rel = path.relative_to(ROOT).as_posix()
        found[name] = [index for index, layer in enumerate(RUNTIME_LAYERS) for entry in layer
                       if rel == entry or (entry.endswith("/") and rel.startswith(entry))]
    return found


def _upward_imports(graph: dict[str, set[str]], layer: dict[str, int]) -> list[str]:
    """Every import of a module from a higher layer than the importer's, as `importer -> imported`."""
    return [f"{importer} -> {imported}" for importer in sorted(graph) for imported in sorted(graph[importer])
            if layer[imported] > layer[importer]]


def test_layer_check_names_every_upward_import():
    graph = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert _upward_imports(graph, {"a": 2, "b": 1, "c": 0}) == []
    assert _upward_imports(graph, {"a": 1, "b": 1, "c": 0}) == []  # within a layer
    assert _upward_imports(graph, {"a": 0, "b": 1, "c": 1}) == ["a -> b", "a -> c"]


def test_every_runtime_module_is_in_one_layer():
    misplaced = [f"{name}: layers {layers}" for name, layers in _layer_of_each_runtime_module().items()
                 if len(layers) != 1]
    assert not misplaced, "place each runtime/ file in exactly one of RUNTIME_LAYERS:\n" + "\n".join(misplaced)


def test_runtime_imports_only_down_its_layers():
    # Annotation-only imports count here: a type a module names is still a layer it depends on. A
    # module's own packages do not (importing it runs their __init__ first, whoever imports it):
    # `from runtime import _aio_ext` in runtime/nvme/ depends on the extension, not on runtime/__init__.py.
    layer = {name: layers[0] for name, layers in _layer_of_each_runtime_module().items() if layers}
    graph = {name: {i for i in imported if i in layer and not name.startswith(f"{i}.")}
             for name, imported in _graph("runtime", executed_only=False).items() if name in layer}
    upward = _upward_imports(graph, layer)
    assert not upward, "runtime/ imports from a higher layer (RUNTIME_LAYERS):\n" + "\n".join(upward)


MAX_FUNCTION_LINES = 80


@pytest.mark.parametrize("package", ["planner", "runtime", "app", "tierwise"])
def test_no_function_over_80_lines(package):
    # Small functions (docs/conventions.md): a longer one is split where a name explains the part.
    long = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)


TIER_MODULES = ("planner/specs/tiers.py",)
"""Where tier names may be compared: the tier types and their registry ([Note: tiers as types])."""
TIER_DECIDING_PACKAGES = ("planner", "app", "tierwise")


def _names_a_tier(node: ast.AST, names: frozenset[str]) -> bool:
    """A string literal that is a tier's name, or a tuple, list or set literal holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_names_a_tier(e, names) for e in node.elts)


def _tier_name_decisions(tree: ast.AST, names: frozenset[str]) -> list[int]:
    """Lines that decide by a tier's name: a comparison or membership test with it (`tier == "gpu"`,
    `"nvme" in ...`), `startswith`/`endswith`/`get` with it, or a subscript by it (`peak["cpu"]`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found = any(_names_a_tier(operand, names) for operand in (node.left, *node.comparators))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            found = node.func.attr in ("startswith", "endswith", "get") and any(
                _names_a_tier(arg, names) for arg in node.args)
        elif isinstance(node, ast.Subscript):
            found = _names_a_tier(node.slice, names)
        else:
            found = False
        if found:
            lines.append(node.lineno)
    return sorted(set(lines))


def test_tier_name_finder_sees_comparisons_membership_and_lookups():
    names = frozenset({"gpu", "cpu", "nvme"})
    source = ('a == "gpu"\n"nvme" in b\nc in ("cpu", "x")\nd.startswith(("cpu",))\ne["nvme"]\nf.get("gpu")\n'
              'g = "gpu"\nh(params="cpu")\ni == "gpus"\nj.placement.params.on_device\n')
    assert _tier_name_decisions(ast.parse(source), names) == [1, 2, 3, 4, 5, 6]


def test_no_decision_by_tier_name_outside_the_tier_types():
    # A tier is an object that answers for itself (planner/specs/tiers.py [Note: tiers as types]):
    # code asks it (`tier.on_device`, `tier.staged`, `tier.capacity_bytes(node)`) or names it by its
    # constant (`GPU`, `HOST`, `NVME`), never by comparing its JSON name. A literal that names
    # something else (a torch device, the `--gpu` filter) is a named constant of its own vocabulary.
    from planner.specs.tiers import TIERS

    names = frozenset(str(tier) for tier in TIERS)
    offences = []
    for package in TIER_DECIDING_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in TIER_MODULES:
                continue
            for line in _tier_name_decisions(ast.parse(path.read_text(), filename=str(path)), names):
                offences.append(f"{rel}:{line}")
    assert not offences, "decisions by a tier's name outside the tier types:\n" + "\n".join(offences)
