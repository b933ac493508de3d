"""The docs can't rot: the tutorials' code runs, and the module map matches the package.

Every ```python block of every `docs/phases/*.md` is executed, in order, in one fresh namespace per
document (one test per document, so a new phase's tutorial is picked up without touching this file).
Blocks fenced as ```text or ```bash are shown, not run. Each block is compiled with the document as
its file name and its own line numbers, so a traceback points at the line of the Markdown file.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PHASE_DOCS = sorted((DOCS / "phases").glob("*.md"))
MODULE_MAP = DOCS / "modules.md"

# A repository path written in prose: starts at a known top-level folder, not inside a URL or a dotted name.
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tinyvllm|tests|docs|benchmarks|kernels)/[\w./-]*\w)")


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of its first code line, code) for each fenced block, in order.

    Fences start at column 0 (```lang ... ```); a fence inside another block's text is just text.
    """
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})\s*([\w+-]*)", lines[i])
        if opening is None:
            i += 1
            continue
        fence, language, start = opening.group(1), opening.group(2).lower(), i + 1
        end = start
        while end < len(lines) and lines[end].rstrip() != fence:
            end += 1
        assert end < len(lines), f"the block opened at line {i + 1} is never closed"
        blocks.append((language, start + 1, "\n".join(lines[start:end]) + "\n"))
        i = end + 1
    return blocks


def python_blocks(doc: Path) -> list[tuple[int, str]]:
    return [(line, code) for language, line, code in code_blocks(doc.read_text(encoding="utf-8"))
            if language == "python"]


def test_code_blocks_parser():
    text = "intro\n```python\nx = 1\n```\n```text\n```python\n```\n````bash\n```\n````\n```python\ny = x\n```\n"
    assert code_blocks(text) == [("python", 3, "x = 1\n"), ("text", 6, "```python\n"),
                                 ("bash", 9, "```\n"), ("python", 12, "y = x\n")]


def test_phase_docs_exist():
    assert PHASE_DOCS, "docs/phases/ holds no tutorial"


@pytest.mark.slow
@pytest.mark.parametrize("doc", PHASE_DOCS, ids=[doc.name for doc in PHASE_DOCS])
def test_phase_doc_code_runs(doc: Path):
    blocks = python_blocks(doc)
    assert blocks, f"{doc.name} has no ```python block: a tutorial's code should run in the tests"
    namespace: dict = {"__name__": f"docs.phases.{doc.stem}"}
    name = str(doc.relative_to(ROOT))
    for index, (line, code) in enumerate(blocks):
        # pad with newlines so that the compiled block's line numbers are the document's
        compiled = compile("\n" * (line - 1) + code, name, "exec")
        try:
            exec(compiled, namespace)
        except Exception as e:
            first_line = next((s for s in code.splitlines() if s.strip()), "")
            pytest.fail(f"{name}: python block {index} (line {line}, starting {first_line!r}) failed: "
                        f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}", pytrace=False)


def package_modules() -> list[str]:
    """Every module of the package as a repository path, leaving out `__init__.py` files."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tinyvllm").rglob("*.py") if p.name != "__init__.py")


def test_every_module_is_in_the_module_map():
    listed = MODULE_MAP.read_text(encoding="utf-8")
    missing = [m for m in package_modules() if f"`{m}`" not in listed]
    assert not missing, f"docs/modules.md lacks a line for: {', '.join(missing)}"


@pytest.mark.parametrize("doc", [MODULE_MAP, DOCS / "glossary.md", *PHASE_DOCS], ids=lambda p: p.name)
def test_docs_name_files_that_exist(doc: Path):
    named = sorted(set(REPO_PATH.findall(doc.read_text(encoding="utf-8"))))
    missing = [path for path in named if not (ROOT / path).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {', '.join(missing)}"
