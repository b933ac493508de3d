"""tinyvllm/tinygrad_ext: every tinygrad internal in its table exists in the installed tinygrad, a missing one is
reported by its name and the function that needs it, and the package uses each name only where the table says.

Which modules of tinyvllm may use tinygrad's internals at all is tests/test_layering.py's check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tinygrad

from tinyvllm.tinygrad_ext import internals
from tinyvllm.tinygrad_ext.internals import ATTRIBUTES, NAMES, Internal, missing

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tinyvllm" / "tinygrad_ext"
TINYGRAD = Path(tinygrad.__file__).resolve().parent
# what `import tinygrad` exports (tinygrad/__init__.py), and the dtype class type hints name
PUBLIC = {"Tensor", "TinyJit", "function", "UOp", "Variable", "dtypes", "GlobalCounters", "fetch", "Context", "getenv",
          "Device", "DType"}


def test_every_internal_in_the_table_exists():
    lines = missing()
    assert not lines, "the installed tinygrad lacks what tinyvllm/tinygrad_ext uses:\n" + "\n".join(lines)


def test_a_missing_name_is_reported_by_its_name(monkeypatch):
    """Taken away one at a time, a module's function, a class's private method and a parameter are each reported in
    a line that names them and the function of the package that needs them, not as an ImportError."""
    import tinygrad.device
    import tinygrad.engine.jit
    import tinygrad.engine.realize

    monkeypatch.delattr(tinygrad.engine.jit, "_prepare_jit_inputs")
    monkeypatch.delattr(tinygrad.device.Allocator, "_copyin")
    monkeypatch.setattr(tinygrad.engine.realize, "get_runtime", lambda dev, prg: None)  # its parameters renamed
    lines = missing()
    assert sorted(lines) == [
        "tinygrad.device.Allocator._copyin (used by tinyvllm.tinygrad_ext.buffers.copy_in): "
        "no Allocator._copyin in tinygrad.device",
        "tinygrad.engine.jit._prepare_jit_inputs (used by tinyvllm.tinygrad_ext.jit.jit_inputs): "
        "no _prepare_jit_inputs in tinygrad.engine.jit",
        "tinygrad.engine.realize.get_runtime (used by tinyvllm.tinygrad_ext.jit.loaded_program): "
        "get_runtime('dev', 'prg') lacks the parameters ('device', 'ast')"], lines
    gone = Internal("helper", "tinygrad.no_such_module", "jit.somewhere")
    assert missing((gone,)) == ["tinygrad.no_such_module.helper (used by tinyvllm.tinygrad_ext.jit.somewhere): "
                                "no module tinygrad.no_such_module"]


def test_an_instance_attribute_counts_as_present():
    """Attributes set in `__init__` (not on the class) are found in the class's code or dataclass fields."""
    assert internals.problem(Internal("_TinyJit.cnt", "tinygrad.engine.jit", "jit.JitBase")) is None
    assert internals.problem(Internal("ParamArg.slot", "tinygrad.uop.ops", "jit.input_of")) is None
    assert internals.problem(Internal("_TinyJit.no_such", "tinygrad.engine.jit", "jit.JitBase")) is not None


# ---- where the package uses each name ----

def tinygrad_module(dotted: str) -> bool:
    path = TINYGRAD.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def aliases(tree: ast.Module) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """({local name: tinygrad module}, {local name: (tinygrad module, name)}) from every import in a module."""
    modules, names = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tinygrad.") and a.asname:
                    modules[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tinygrad":
            for a in node.names:
                if node.module == "tinygrad" and a.name in PUBLIC or a.name == "DType":
                    continue
                target = (modules if tinygrad_module(f"{node.module}.{a.name}") else names)
                target[a.asname or a.name] = f"{node.module}.{a.name}" if target is modules else (node.module, a.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func) == "importlib.import_module":  # x = importlib.import_module("tinygrad.y")
            modules[node.targets[0].id] = node.value.args[0].value
    return modules, names


def package_defines() -> set[str]:
    """Every private name the package defines itself (its own `_x` attributes and functions are not tinygrad's)."""
    found = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found.add(node.attr)
    return found


def uses() -> list[tuple[tuple[str | None, str], str]]:
    """((tinygrad module, name), scope) for every use of a tinygrad internal in the package's code (annotations
    left out): a module attribute (`Ops.PROGRAM`, `DEV.target` kept with the attribute read from them), or a private
    attribute (module None); the scope is the module, function and class around it ("jit.JitBase.writes_inputs")."""
    own, found = package_defines(), []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name in ("internals.py", "__init__.py"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules, names = aliases(tree)

        def visit(node: ast.AST, scope: str, parent: ast.AST | None) -> None:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                return
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                scope = f"{scope}.{node.name}"
                children = [*node.decorator_list, *getattr(node, "bases", []), *node.body]
                if isinstance(node, ast.FunctionDef):
                    children += [d for d in node.args.defaults + node.args.kw_defaults if d is not None]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # the annotation left out; a module constant: its scope
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                children, target = targets + ([node.value] if node.value else []), targets[0]
                if scope == path.stem and isinstance(target, ast.Name):
                    scope = f"{scope}.{target.id}"
            else:
                children = list(ast.iter_child_nodes(node))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                if not node.attr.startswith("__"):
                    found.append(((modules[node.value.id], node.attr), scope))
            elif isinstance(node, ast.Name) and node.id in names:
                module, name = names[node.id]
                read = parent.attr if isinstance(parent, ast.Attribute) and parent.value is node else None
                found.append(((module, f"{name}.{read}" if read else name), scope))
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in own and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(((None, node.attr), scope))
            elif (name := named_attribute(node)) is not None and name.startswith("_") and \
                    not name.startswith("__") and name not in own:
                found.append(((None, name), scope))  # Device.__dict__["_select_device"]
            for child in children:
                visit(child, scope, node)

        visit(tree, path.stem, None)
    return found


def named_attribute(node: ast.AST) -> str | None:
    """The attribute a string names: `x["name"]`, `x.get("name")`, `getattr(x, "name")` (and hasattr, setattr)."""
    if isinstance(node, ast.Subscript):
        key = node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        key = node.args[0]
    elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr", "setattr")
          and len(node.args) > 1):
        key = node.args[1]
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def row_of(key: tuple[str | None, str]) -> Internal | None:
    module, name = key
    for row in NAMES:
        if (module is None and row.name.split(".")[-1] == name) or (row.module == module and row.name == name):
            return row
    if module is not None and "." in name:  # `DLL.findlib` listed as `DLL`
        return row_of((module, name.split(".")[0]))
    return None


def within(scope: str, used_by: str | tuple[str, ...]) -> bool:
    return any(scope == u or scope.startswith(u + ".") for u in ((used_by,) if isinstance(used_by, str) else used_by))


def test_every_internal_the_package_uses_is_in_the_table():
    unlisted = sorted({f"{module or '(private attribute)'}: {name} in {scope}" for (module, name), scope in uses()
                       if row_of((module, name)) is None})
    assert not unlisted, "tinygrad internals used but not in internals.NAMES:\n" + "\n".join(unlisted)


def test_each_name_is_used_by_the_function_the_table_names_and_no_other():
    scopes: dict[Internal, set[str]] = {}
    for key, scope in uses():
        if (row := row_of(key)) is not None:
            scopes.setdefault(row, set()).add(scope)
    problems = []
    for row in NAMES:
        if row.in_text:
            continue
        found = scopes.get(row, set())
        used_by = (row.used_by,) if isinstance(row.used_by, str) else row.used_by
        if elsewhere := sorted(s for s in found if not within(s, row.used_by)):
            problems.append(f"{row.where()} is also used in {', '.join(elsewhere)}")
        if unused := [u for u in used_by if not any(within(s, u) for s in found)]:
            problems.append(f"{row.where()} is not used in {', '.join(unused)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("row", [r for r in NAMES + ATTRIBUTES if r.in_text], ids=lambda r: r.name)
def test_a_name_in_text_is_in_the_text_of_its_user(row):
    module, _, constant = (row.used_by if isinstance(row.used_by, str) else row.used_by[0]).partition(".")
    source = (PACKAGE / f"{module}.py").read_text(encoding="utf-8")
    assert f'"{row.name}"' in source and constant in source


def test_the_use_scanner_sees_each_kind_of_use():
    found = {(key, scope) for key, scope in uses()}
    assert (("tinygrad.engine.jit", "_TinyJit"), "jit.JitBase") in found  # a base class
    assert (("tinygrad.uop.ops", "Ops.PROGRAM"), "programs.source_program.fxn") in found  # an enum member, nested
    assert (("tinygrad.helpers", "_db_connection"), "startup.share_kernel_cache_across_threads") in found  # rebound
    assert ((None, "_copyin"), "buffers.copy_in") in found  # a private attribute
    assert ((None, "_select_device"), "startup._cached_default_device") in found  # a private name in a string
    assert (("tinygrad.renderer.cstyle", "ClangRenderer.kernel_typedef"), "programs.CLANG_KERNEL_PREFIX") in found
