"""The package's layers: no two packages import each other (directly or around a loop), `core/` stays host-side
bookkeeping, and docs/modules.md's import graph is the one the code has.

Static: every module's top-level imports, read with `ast` (imports made inside a function, where a feature is
used, and `if TYPE_CHECKING:` ones do not count). A node is a subpackage of tinyvllm (`engine`, `model`, ...) or
a top-level module (`platforms`, `llm`, ...).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tinyvllm"
MODULE_MAP = ROOT / "docs" / "modules.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def node_of(module: str) -> str:
    """tinyvllm.engine.llm_engine -> 'engine'; tinyvllm.platforms -> 'platforms'; tinyvllm -> 'tinyvllm'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def top_level_imports(path: Path) -> set[str]:
    """The tinyvllm modules `path` imports when it is imported (its own body, try and if blocks included)."""
    tree, here = ast.parse(path.read_text(encoding="utf-8")), module_name(path)
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..a import b
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                submodules = {f"{base}.{a.name}" for a in node.names} & modules  # `from pkg import module`
                found.update(submodules or {base})
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.dump(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return {m for m in found if m in modules and m != here}


def package_graph() -> dict[str, set[str]]:
    """node -> the nodes its modules import at their top."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        node = node_of(module_name(path))
        graph.setdefault(node, set()).update(node_of(m) for m in top_level_imports(path))
        graph[node].discard(node)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every node that can reach itself, with one loop through it (depth-first search)."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def documented_graph() -> dict[str, set[str]]:
    """docs/modules.md's import graph: the lines `node -> a, b, c` of the fenced block under '## Import graph'."""
    section = MODULE_MAP.read_text(encoding="utf-8").split("## Import graph", 1)[1]
    block = section.split("```text", 1)[1].split("```", 1)[0]
    graph = {}
    for line in block.strip().splitlines():
        node, _, targets = line.partition("->")
        graph[node.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    return graph


def test_no_package_imports_itself_around_a_loop():
    loops = cycles(package_graph())
    assert not loops, "package-level import cycles: " + "; ".join(" -> ".join(loop) for loop in loops)


def test_the_cycle_check_finds_a_loop():
    assert cycles({"model": {"kernels"}, "kernels": {"model"}, "engine": {"model"}}) == [
        ["kernels", "model", "kernels"], ["model", "kernels", "model"]]
    assert cycles({"api": {"engine"}, "engine": {"model"}, "model": set()}) == []


def test_core_is_host_side_bookkeeping():
    """core/ (blocks, sequences, the scheduler) imports no tinygrad and no device code: the KV tensors live in
    tinyvllm/attention/kv_cache.py."""
    for path in (PACKAGE / "core").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^(from|import) tinygrad", text, re.M), f"{path.name} imports tinygrad"
        assert top_level_imports(path) <= {module_name(p) for p in (PACKAGE / "core").glob("*.py")} | {
            "tinyvllm.sampling_params"}, f"{path.name}: {sorted(top_level_imports(path))}"


def test_the_module_map_shows_the_import_graph():
    want = {node: targets for node, targets in package_graph().items() if targets}
    shown = "\n".join(f"{node} -> {', '.join(sorted(t))}" for node, t in sorted(want.items()))
    assert documented_graph() == want, f"docs/modules.md's import graph should read:\n{shown}"


# ---- tinygrad's internals stay in tinyvllm/tinygrad_ext/ ----

# what `import tinygrad` exports (tinygrad/__init__.py); `tinygrad.dtype.DType` is public for type hints
TINYGRAD_PUBLIC = {"Tensor", "TinyJit", "function", "UOp", "Variable", "dtypes", "GlobalCounters", "fetch", "Context",
                   "getenv", "Device"}
TINYGRAD_PUBLIC_SUBMODULE_NAMES = {"tinygrad.dtype": {"DType"}}


def tinygrad_private_names() -> set[str]:
    """The private names (`_x`) the installed tinygrad defines: functions, classes, attributes, module globals."""
    import tinygrad

    found: set[str] = set()
    definition = re.compile(r"(?:def |class |self\.|^\s*)(_[A-Za-z0-9]\w*)\b(?=\s*[:=(,]|$)", re.M)
    for path in Path(tinygrad.__file__).resolve().parent.rglob("*.py"):
        found.update(definition.findall(path.read_text(encoding="utf-8", errors="replace")))
    return found


def own_names(sources: list[str]) -> set[str]:
    """Every name tinyvllm defines itself: functions, classes, attributes it sets, variables, parameters."""
    found: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
    return found


def tinygrad_reach(source: str, private: set[str]) -> list[str]:
    """What `source` takes from tinygrad beyond its public API: an import from a submodule (but `DType`), a name
    tinygrad's top level does not export, a submodule read through `import tinygrad`, or one of tinygrad's private
    names (`private`) as an attribute or a string key (`x["_name"]`, `getattr(x, "_name")`)."""
    found, tinygrad_names = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("tinygrad.")]
            tinygrad_names.update(a.asname or a.name for a in node.names if a.name == "tinygrad")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tinygrad":
            allowed = (TINYGRAD_PUBLIC if node.module == "tinygrad"
                       else TINYGRAD_PUBLIC_SUBMODULE_NAMES.get(node.module, set()))
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name not in allowed]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f".{node.attr}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in private:
            found.append(f'["{node.slice.value}"]')
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr", "setattr") and \
                len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in private:
            found.append(f'{ast.unparse(node.func)}(..., "{node.args[1].value}")')
    for node in ast.walk(ast.parse(source)):  # `tinygrad.engine.jit` after `import tinygrad`
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in tinygrad_names \
                and node.attr not in TINYGRAD_PUBLIC and not node.attr.startswith("__"):
            found.append(f"tinygrad.{node.attr}")
    return found


def test_only_tinygrad_ext_reaches_into_tinygrad():
    """No module of tinyvllm outside tinyvllm/tinygrad_ext/ imports from a tinygrad submodule or names one of
    tinygrad's private attributes: an upgrade of tinygrad breaks only that package (its table: internals.py)."""
    paths = sorted(p for p in PACKAGE.rglob("*.py") if "tinygrad_ext" not in p.relative_to(PACKAGE).parts)
    sources = {p: p.read_text(encoding="utf-8") for p in paths}
    private = tinygrad_private_names() - own_names(list(sources.values()))
    reaches = [f"{p.relative_to(ROOT)}: {r}" for p, source in sources.items() for r in tinygrad_reach(source, private)]
    assert not reaches, "tinygrad's internals outside tinyvllm/tinygrad_ext/ (move them behind a function there):\n" + \
        "\n".join(reaches)


def test_the_reach_check_finds_each_kind():
    source = '''
import tinygrad
import tinygrad.engine.jit
from tinygrad import Tensor, UOp
from tinygrad import helpers
from tinygrad.dtype import DType, _to_np_dtype
from tinygrad.engine.jit import _TinyJit

def f(t: Tensor, buf):
    buf.allocator._copyin(buf._own, b"")
    tinygrad.Device.DEFAULT, tinygrad.helpers.DEBUG
    return Device.__dict__["_select_device"], getattr(buf, "_copyin")
'''
    assert tinygrad_reach(source, {"_copyin", "_select_device"}) == [
        "import tinygrad.engine.jit", "from tinygrad import helpers", "from tinygrad.dtype import _to_np_dtype",
        "from tinygrad.engine.jit import _TinyJit", "._copyin", '["_select_device"]', 'getattr(..., "_copyin")',
        "tinygrad.helpers"]
