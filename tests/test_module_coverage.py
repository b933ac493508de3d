"""Every module of tinyvllm/ is imported by at least one test file: a module no test names is a module nothing checks
directly. The test files are read, not run (ast), so what counts is an import written in a test file
(`import tinyvllm.core.scheduler`, `from tinyvllm.core import scheduler`, `from tinyvllm.core.scheduler import X`),
at its top or inside a test; an import only through a helper (conftest.py, fake_engine.py) does not count. A
package's `__init__.py` is imported with any of its modules and is not listed."""

from __future__ import annotations

import ast
from pathlib import Path

from phases import paths_of_test_files

ROOT = Path(__file__).resolve().parents[1]


def package_modules() -> list[str]:
    """`tinyvllm.core.scheduler`, ...: every module of the package but its packages' `__init__.py`."""
    return sorted(str(p.relative_to(ROOT).with_suffix("")).replace("/", ".") for p in (ROOT / "tinyvllm").rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def imported_names(source: str) -> set[str]:
    """The dotted names a file imports: `from a.b import c` gives a.b and a.b.c (c may be a module or a name in a.b;
    only names that are modules are looked up later)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def untested_modules(modules: list[str], test_sources: list[str]) -> list[str]:
    imported = set().union(*(imported_names(source) for source in test_sources))
    return [m for m in modules if m not in imported]


def test_every_module_is_imported_by_a_test():
    sources = [path.read_text(encoding="utf-8") for path in paths_of_test_files().values()]
    missing = untested_modules(package_modules(), sources)
    assert not missing, ("no test file imports these modules: add a test of each to the tests/ folder that mirrors "
                         "its package (tests/core/ for tinyvllm/core/, tests/ for a top-level module):\n"
                         + "\n".join(missing))


def test_the_check_reads_each_form_of_import():
    modules = ["tinyvllm.core.scheduler", "tinyvllm.core.sequence", "tinyvllm.ops", "tinyvllm.jit"]
    sources = ["import tinyvllm.core.scheduler", "from tinyvllm.core import sequence as seq",
               "def test():\n    from tinyvllm.ops import matmul\n", "import tinyvllm\n# tinyvllm.jit\n"]
    assert untested_modules(modules, sources) == ["tinyvllm.jit"]  # a comment, or the package alone, is no import
    assert "tinyvllm.core.prefix_cache" in package_modules() and "tinyvllm.core" not in package_modules()
