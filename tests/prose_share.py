"""How much of tinyvllm/ is prose: the characters of its docstrings and `#` comments over all its characters.

A docstring (module, class or function: the string that is the first statement of its body) counts as its source
text, quotes included; a comment counts from its `#` to the end of the line. Blank lines, indentation and code count
toward the total only. The measure of STYLE.md habit 6 ("docstrings where the concepts live, lean elsewhere"):
vLLM v1's core files and tinygrad's `llm` package are the comparison.

    python tests/prose_share.py            # the share per package of tinyvllm/ and overall
    python tests/prose_share.py FILE...    # the share of the files and folders named
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tinyvllm"

DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_nodes(source: str) -> list[ast.Constant]:
    """The docstrings of `source`: each module's, class's or function's first statement when it is a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, DOCSTRING_OWNERS) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            found.append(first.value)
    return found


def source_prose(source: str) -> int:
    """The characters of `source` that are docstrings or comments."""
    comments = sum(len(tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                   if tok.type == tokenize.COMMENT)
    return comments + sum(len(ast.get_source_segment(source, node) or "") for node in docstring_nodes(source))


def python_files(paths: Iterable[Path]) -> list[Path]:
    """The .py files named, and those under the folders named; each once."""
    found: set[Path] = set()
    for path in map(Path, paths):
        found.update(path.rglob("*.py") if path.is_dir() else [path])
    return sorted(found)


def prose_share(paths: Iterable[Path]) -> tuple[int, int]:
    """(prose characters, all characters) over the Python files in `paths` (files or folders)."""
    prose = total = 0
    for path in python_files(paths):
        source = path.read_text(encoding="utf-8")
        prose += source_prose(source)
        total += len(source)
    return prose, total


def packages() -> dict[str, list[Path]]:
    """tinyvllm/'s subpackages by name, and its top-level modules together as 'tinyvllm/*.py'."""
    groups = {f"tinyvllm/{d.name}/": [d] for d in sorted(PACKAGE.iterdir()) if (d / "__init__.py").exists()}
    groups["tinyvllm/*.py"] = sorted(PACKAGE.glob("*.py"))
    return groups


def report(groups: dict[str, list[Path]]) -> str:
    rows = [(name, *prose_share(paths)) for name, paths in groups.items()]
    rows.append(("overall", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'prose':>9}  {'total':>9}  share"]
    lines += [f"{name:{width}}  {prose:9,}  {total:9,}  {prose / max(total, 1):5.1%}" for name, prose, total in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    print(report({a: [Path(a)] for a in args} if args else packages()))
