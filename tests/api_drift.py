"""What a GPU test uses of the runtime and of other test modules, checked without a GPU.

[Note: GPU tests drift without a GPU]
CI has no GPU, so the tests marked `gpu` are collected and skipped there: a refactor that changes
what they call (a helper's arguments, a property that now returns a `Role` where it returned a
torch stream, a method that now returns a `DeviceEvent`) leaves them broken until a GPU runs them.
An H200 run of `pytest -m gpu` once found 11 such tests (3 kinds of drift). `drift(source)` reads a test module's syntax
tree and lists, without running it:
- names imported from runtime/, planner/ or a test module that the module no longer has;
- calls of such a function (or of one the test module defines) whose arguments its signature no
  longer takes;
- values passed to torch's CUDA stream and event calls (`torch.cuda.stream(x)`, `Event.record(x)`,
  `Stream.wait_event(x)`, `Stream.wait_stream(x)`) that runtime/ declares as something else than a
  torch stream or event: each value is followed to what produced it (an assignment in the test, a
  helper's return, a runtime attribute or method) and the runtime's annotation of that is read.
Values it cannot follow (a test's parameter, an unannotated helper) pass: the check is there to
catch drift of what the runtime declares, not to type-check the tests.
"""

from __future__ import annotations
import __future__

import ast
import copy
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TORCH_HANDLE_CALLS = ("record", "wait_event", "wait_stream")
"""Methods of torch.cuda.Event / torch.cuda.Stream whose first argument must be a torch handle."""
TORCH_HANDLE_TYPES = ("torch.cuda.Stream", "torch.cuda.Event", "torch.Stream", "torch.Event")


def _checked_module(name: str) -> bool:
    top = name.split(".")[0]
    return top in ("runtime", "planner") or (TESTS / f"{top}.py").exists()


def _runtime_declarations() -> dict[tuple[str, bool], list[ast.expr]]:
    """(member name, called) -> every annotation runtime/ gives it: a method's return (called), a
    property's return or an annotated class attribute (read)."""
    found: dict[tuple[str, bool], list[ast.expr]] = {}
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
                is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
                found.setdefault((node.name, not is_property), []).append(node.returns)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        found.setdefault((item.target.id, False), []).append(item.annotation)
    return found


def _element(annotation: ast.expr, index: int | None) -> ast.expr | None:
    """Element `index` of a `tuple[...]` annotation (the annotation itself when `index` is None)."""
    if index is None:
        return annotation
    if (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id == "tuple" and isinstance(annotation.slice, ast.Tuple)
            and index < len(annotation.slice.elts)):
        return annotation.slice.elts[index]
    return None


class _Module:
    """One test module's syntax tree, with what it imports resolved."""

    def __init__(self, source: str) -> None:
        self.tree = ast.parse(source)
        self.helpers = {n.name: n for n in self.tree.body if isinstance(n, ast.FunctionDef)}
        self.imported: dict[str, Any] = {}
        self.problems: list[str] = []
        self.declared = _runtime_declarations()

    def resolve_imports(self) -> None:
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and _checked_module(node.module)):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}")
                if not hasattr(module, alias.name) and not submodule:
                    self.problems.append(f"line {node.lineno}: {node.module} has no {alias.name}")
                elif hasattr(module, alias.name):
                    self.imported[alias.asname or alias.name] = getattr(module, alias.name)

    def check_call(self, call: ast.Call) -> None:
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            return
        target = None
        if isinstance(call.func, ast.Name):
            name = call.func.id
            target = self.imported.get(name)
            if target is None and name in self.helpers:
                target = self._helper_object(name)
        if target is None or not callable(target):
            return
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return
        try:
            signature.bind(*call.args, **{k.arg: k.value for k in call.keywords})
        except TypeError as err:
            self.problems.append(f"line {call.lineno}: {ast.unparse(call.func)}(...) {err}")

    def _helper_object(self, name: str) -> Any:
        """A function the test module defines, as an object with its signature (compiled alone)."""
        stub = copy.copy(self.helpers[name])
        stub.body, stub.decorator_list, stub.returns = [ast.Pass()], [], None
        scope: dict[str, Any] = {}
        try:  # the signature alone: the body is `pass`, annotations stay strings
            code = compile(ast.fix_missing_locations(ast.Module(body=[stub], type_ignores=[])), name, "exec",
                           flags=__future__.annotations.compiler_flag, dont_inherit=True)
            exec(code, scope)  # noqa: S102
        except Exception:  # noqa: BLE001 - defaults that need the module's names: not checked
            return None
        return scope[name]

    def check_handles(self, function: ast.FunctionDef) -> None:
        for call in ast.walk(function):
            if not (isinstance(call, ast.Call) and call.args):
                continue
            func = ast.unparse(call.func)
            if func != "torch.cuda.stream" and not (isinstance(call.func, ast.Attribute)
                                                    and call.func.attr in TORCH_HANDLE_CALLS):
                continue
            declared = sorted({ast.unparse(d) for d in self._declared(call.args[0], function, None, depth=0)})
            if declared and not any(t in d for d in declared for t in TORCH_HANDLE_TYPES):
                self.problems.append(f"line {call.lineno}: {func}({ast.unparse(call.args[0])}) passes what runtime/ "
                                     f"declares as {' or '.join(declared)}, not a torch stream or event")

    def _declared(self, expr: ast.expr, scope: ast.FunctionDef, index: int | None, depth: int) -> list[ast.expr]:
        """The runtime's annotations of what produced `expr` (element `index` of it) in `scope`."""
        if depth > 12:
            return []
        if isinstance(expr, ast.Tuple) and index is not None and index < len(expr.elts):
            return self._declared(expr.elts[index], scope, None, depth + 1)
        if isinstance(expr, ast.Name):
            return self._declared_name(expr.id, scope, index, depth)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in self.helpers:
            helper = self.helpers[expr.func.id]
            returns = [n.value for n in ast.walk(helper) if isinstance(n, ast.Return) and n.value is not None]
            return [d for r in returns for d in self._declared(r, helper, index, depth + 1)]
        called = isinstance(expr, ast.Call)
        member = expr.func if called else expr
        if not isinstance(member, ast.Attribute) or ast.unparse(member).startswith("torch."):
            return []
        annotations = [_element(a, index) for a in self.declared.get((member.attr, called), [])]
        return [a for a in annotations if a is not None]

    def _declared_name(self, name: str, scope: ast.FunctionDef, index: int | None, depth: int) -> list[ast.expr]:
        for node in sorted((n for n in ast.walk(scope) if isinstance(n, ast.Assign)), key=lambda n: -n.lineno):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == name:
                    return self._declared(node.value, scope, index, depth + 1)
                if isinstance(target, ast.Tuple):
                    names = [t.id if isinstance(t, ast.Name) else None for t in target.elts]
                    if name in names:
                        return self._declared(node.value, scope, names.index(name), depth + 1)
        return []


def drift(source: str) -> list[str]:
    """What `source` (a test module) uses of runtime/, planner/ and the test modules that no longer
    matches them ([Note: GPU tests drift without a GPU])."""
    module = _Module(source)
    module.resolve_imports()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Call):
            module.check_call(node)
        if isinstance(node, ast.FunctionDef):
            module.check_handles(node)
    return module.problems


def gpu_test_modules() -> list[Path]:
    """The test modules with tests marked `gpu`."""
    return sorted(p for p in TESTS.glob("test_*.py") if "pytest.mark.gpu" in p.read_text())
