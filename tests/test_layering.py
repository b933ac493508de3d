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
