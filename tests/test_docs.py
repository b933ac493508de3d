"""The docs can't rot: the tutorials' code runs, and the module map matches the package.

Every ```python block of every `docs/phases/*.md` is executed, in order, in one fresh namespace per
document (one test per document, so a new phase's tutorial is picked up without touching this file).
An ```output block right after a python block is what that block prints, checked. A block after the comment
`<!-- source: tinyvllm/path.py Qualified.name -->` is that function's source as it is now, checked. Each block
is compiled with the document as its file name and its own line numbers, so a traceback points at the line of
the Markdown file.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import re
import shlex
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

from phases import phase_of_chapter

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


SHOWN_SOURCE = re.compile(r"^<!-- source: (\S+\.py) ([\w.]+) -->\n`{3,}\w*\n", re.M)


def python_blocks(doc: Path) -> list[tuple[int, str]]:
    return [(line, code) for language, line, code in code_blocks(doc.read_text(encoding="utf-8"))
            if language == "python"]


def test_code_blocks_parser():
    text = "intro\n```python\nx = 1\n```\n```text\n```python\n```\n````bash\n```\n````\n```python\ny = x\n```\n"
    assert code_blocks(text) == [("python", 3, "x = 1\n"), ("text", 6, "```python\n"),
                                 ("bash", 9, "```\n"), ("python", 12, "y = x\n")]


def test_phase_docs_exist():
    assert PHASE_DOCS, "docs/phases/ holds no tutorial"


# ---- the course's shape: one chapter per phase, each read in one sitting ----

CHAPTER_LINES = 450  # a chapter longer than this moves material to an appendix of its own
CHAPTER = re.compile(r"(\d\d)([a-z]?)-(?!appendix-)[a-z0-9]+(?:-[a-z0-9]+)*\.md")
APPENDIX = re.compile(r"(\d\d)([a-z]?)-appendix-[a-z0-9]+(?:-[a-z0-9]+)*\.md")


def is_appendix(doc: Path) -> bool:
    return "appendix" in doc.name


def test_chapters_and_appendices_are_named_as_such():
    chapters = [doc for doc in PHASE_DOCS if not is_appendix(doc)]
    for doc in PHASE_DOCS:
        title = doc.read_text(encoding="utf-8").splitlines()[0]
        if is_appendix(doc):
            match = APPENDIX.fullmatch(doc.name)
            assert match, f"{doc.name}: an appendix is named NN-appendix-<topic>.md (lowercase words and dashes)"
            number, letter = match.groups()
            assert any(c.name.startswith(f"{number}{letter}-") for c in chapters), \
                f"{doc.name}: no chapter {number}{letter} for this appendix to belong to"
            assert title.startswith(f"# Phase {int(number)}{letter}, appendix: "), \
                f"{doc.name}: an appendix's title starts '# Phase {int(number)}{letter}, appendix: ', not {title!r}"
        else:
            match = CHAPTER.fullmatch(doc.name)
            assert match, f"{doc.name}: a chapter is named NN-<topic>.md or NNx-<topic>.md (lowercase, dashes)"
            number, letter = match.groups()
            assert title.startswith(f"# Phase {int(number)}{letter}: "), \
                f"{doc.name}: a chapter's title starts '# Phase {int(number)}{letter}: ', not {title!r}"
    assert sorted({phase_of_chapter(c.name) for c in chapters}) == list(range(1, 11)), \
        "docs/phases/ has one chapter (or sub-chapters) for each phase, 1 to 10"


def test_the_readme_table_links_every_chapter_once():
    rows = [line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("|") and "](docs/phases/" in line]
    linked = sorted(name for row in rows for name in re.findall(r"\]\(docs/phases/([\w.-]+\.md)\)", row))
    chapters = sorted(d.name for d in PHASE_DOCS if not is_appendix(d))
    assert linked == chapters, f"README.md's table of phases links {linked}; the chapters are {chapters}"


@pytest.mark.parametrize("doc", [d for d in PHASE_DOCS if not is_appendix(d)], ids=lambda p: p.name)
def test_a_chapter_reads_in_one_sitting(doc: Path):
    text = doc.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= CHAPTER_LINES, (f"{doc.name} has {lines} lines, more than {CHAPTER_LINES}: move material "
                                    f"to an appendix ({doc.name[:3].rstrip('-')}-appendix-<topic>.md)")


@pytest.mark.slow
@pytest.mark.parametrize("doc", PHASE_DOCS, ids=[doc.name for doc in PHASE_DOCS])
def test_phase_doc_code_runs(doc: Path):
    blocks = code_blocks(doc.read_text(encoding="utf-8"))
    if not any(language == "python" for language, _, _ in blocks) and is_appendix(doc):
        return  # an appendix of measurements may have no code; a chapter always runs some
    assert any(language == "python" for language, _, _ in blocks), \
        f"{doc.name} has no ```python block: a tutorial's code should run in the tests"
    namespace: dict = {"__name__": f"docs.phases.{doc.stem}"}
    name = str(doc.relative_to(ROOT))
    printed, previous = None, None
    for index, (language, line, code) in enumerate(blocks):
        if language == "output":
            assert previous == "python", f"{name}:{line}: an ```output block must follow a ```python block"
            assert printed == code, f"{name}:{line}: the block above prints\n{printed}\nnot the quoted\n{code}"
        previous = language
        if language != "python":
            continue
        # pad with newlines so that the compiled block's line numbers are the document's
        compiled = compile("\n" * (line - 1) + code, name, "exec")
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                exec(compiled, namespace)
        except Exception as e:
            first_line = next((s for s in code.splitlines() if s.strip()), "")
            pytest.fail(f"{name}: python block {index} (line {line}, starting {first_line!r}) failed: "
                        f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}", pytrace=False)
        printed = stdout.getvalue()
        sys.stdout.write(printed)


def test_output_blocks_are_checked():
    ok = "```python\nprint(1 + 1)\n```\n\n```output\n2\n```\n"
    assert [b[0] for b in code_blocks(ok)] == ["python", "output"]


@pytest.mark.parametrize("doc", PHASE_DOCS, ids=[doc.name for doc in PHASE_DOCS])
def test_shown_source_is_the_code(doc: Path):
    """A chapter that shows a function "as it runs" shows its source as it is."""
    text = doc.read_text(encoding="utf-8")
    for m in SHOWN_SOURCE.finditer(text):
        path, qualname = m.group(1), m.group(2)
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        obj = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
        shown = code_blocks(text[m.start():])[0][2]
        assert shown == textwrap.dedent(inspect.getsource(obj)), \
            f"{doc.name} shows {path} {qualname} as it no longer is: copy its source again"


def test_shown_sources_are_found():
    shown = [m.group(2) for doc in PHASE_DOCS for m in SHOWN_SOURCE.finditer(doc.read_text(encoding="utf-8"))]
    assert "generate" in shown and "EngineCore.step" in shown


def quoted_main_runs(docs: list[Path]) -> list[tuple[str, list[str], list[str]]]:
    """(where, main.py's arguments, the output quoted under it) for every `.venv/bin/python main.py ...` line of a
    bash block that is followed by `#` lines: the output a reader is told to expect."""
    runs = []
    for doc in docs:
        for language, line, code in code_blocks(doc.read_text(encoding="utf-8")):
            lines = code.splitlines()
            for i, text in enumerate(lines):
                if language != "bash" or not text.startswith(".venv/bin/python main.py "):
                    continue
                quoted = []
                for follow in lines[i + 1:]:
                    if follow != "#" and not follow.startswith("# "):
                        break
                    quoted.append(follow[2:])
                if quoted:
                    command = shlex.split(text.split("  #")[0])
                    runs.append((f"{doc.relative_to(ROOT)}:{line + i}", command[2:], quoted))
    return runs


QUOTED_MAIN_RUNS = quoted_main_runs([ROOT / "README.md", *PHASE_DOCS])


@pytest.mark.slow
@pytest.mark.parametrize("where, args, quoted", QUOTED_MAIN_RUNS, ids=[run[0] for run in QUOTED_MAIN_RUNS])
def test_quoted_output_is_what_main_prints(where: str, args: list[str], quoted: list[str]):
    assert "--temperature" in args, f"{where}: a quoted output must come from a greedy run (--temperature 0)"
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{where}: main.py failed:\n{done.stderr[-2000:]}"
    printed = done.stdout.rstrip("\n").split("\n")
    assert printed == quoted, f"{where} quotes {quoted}, main.py prints {printed}"


def test_quoted_main_runs_are_found():
    assert any(where.startswith("docs/phases/01-foundation.md") for where, _, _ in QUOTED_MAIN_RUNS)


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


# ---- numbers in prose come from results files ----
#
# A figure quoted from a benchmark carries, right after it, an HTML comment naming the results file
# (benchmarks/results/<name>.json, written by the bench script) and the key that holds it:
#
#     decode runs at 70.4 tok/s<!-- bench_generate: decode.tok_s -->
#
# The rules (keys, scaling, precision, `<!-- derived -->`) and the one implementation of the checks are in
# benchmarks/quote_figures.py, which also rewrites the figures from the newest results files.

sys.path.insert(0, str(ROOT / "benchmarks"))
from quote_figures import FIGURE_DOCS, check_figures, requote, unreferenced_figures  # noqa: E402


@pytest.mark.parametrize("doc", FIGURE_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_figures_equal_the_results_files(doc: Path):
    problems = check_figures(doc.read_text(encoding="utf-8"), str(doc.relative_to(ROOT)))
    assert not problems, "figures that disagree with benchmarks/results/:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", FIGURE_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_measured_figures_name_their_results_file(doc: Path):
    problems = unreferenced_figures(doc.read_text(encoding="utf-8"), str(doc.relative_to(ROOT)))
    assert not problems, ("measured figures must name the results file and key they come from "
                          "(see the top of this section):\n" + "\n".join(problems))


def test_the_figure_check_catches_a_wrong_value(tmp_path: Path):
    (tmp_path / "bench_x.json").write_text(json.dumps(
        {"decode": {"tok_per_s": 70.44}, "prefill": [{"prompt_tokens": 32, "tok_per_s": 1046.2}],
         "ceiling": {"fraction": 0.651}}))
    right = ("decode 70.4 tok/s<!-- bench_x: decode.tok_per_s -->, prefill 1,046 tok/s"
             "<!-- bench_x: prefill.prompt_tokens=32.tok_per_s --> (65%<!-- bench_x: ceiling.fraction*100 -->)")
    assert check_figures(right, "doc", tmp_path) == []
    assert unreferenced_figures(right, "doc") == []
    wrong = right.replace("70.4", "71.4").replace("1,046", "1,047")
    assert len(check_figures(wrong, "doc", tmp_path)) == 2
    assert check_figures("72 tok/s<!-- bench_x: decode.missing -->", "doc", tmp_path)
    assert check_figures("72 tok/s<!-- bench_none: decode.tok_per_s -->", "doc", tmp_path)
    assert unreferenced_figures("decode at 70.4 tok/s, 1.5x faster", "doc") == [
        "doc:1: '70.4 tok/s' names no results file", "doc:1: '1.5x' names no results file"]
    assert unreferenced_figures("538 MB / 58 GB/s<!-- derived --> and\n```\n9 ms\n```", "doc") == []


def test_requote_rewrites_figures_from_the_results_file(tmp_path: Path):
    (tmp_path / "bench_x.json").write_text(json.dumps(
        {"decode": {"tok_s": 45.2776}, "prefill": {"512": {"tok_s": 1504.99}}, "fraction": 0.7061,
         "rows": [{"batch": 1, "context": 128, "ms": 0.75}, {"batch": 1, "context": 8192, "ms": 3.8449},
                  {"batch": 8, "context": 8192, "ms": 32.19}]}))
    old = ("decode 48.7 tok/s<!-- bench_x: decode.tok_s --> (84%<!-- bench_x: fraction*100 -->), prefill 1,384 "
           "tok/s<!-- bench_x: prefill.512.tok_s -->\n```\n48.7 tok/s<!-- bench_x: decode.tok_s -->\n```\n"
           "kernel 3.1 ms<!-- bench_x: rows.batch=1,context=8192.ms --> and 9 ms<!-- bench_x: rows.nope -->")
    new, changes = requote(old, tmp_path)
    assert new == ("decode 45.3 tok/s<!-- bench_x: decode.tok_s --> (71%<!-- bench_x: fraction*100 -->), prefill "
                   "1,505 tok/s<!-- bench_x: prefill.512.tok_s -->\n```\n48.7 tok/s<!-- bench_x: decode.tok_s -->\n"
                   "```\nkernel 3.8 ms<!-- bench_x: rows.batch=1,context=8192.ms --> and "
                   "9 ms<!-- bench_x: rows.nope -->")
    assert [(line, before, after) for line, before, after, _ in changes] == [
        (1, "48.7", "45.3"), (1, "84", "71"), (1, "1,384", "1,505"), (5, "3.1", "3.8")]
    assert len(check_figures(new, "doc", tmp_path)) == 1     # rows.nope: left as it was, and reported
    assert requote(new, tmp_path)[1] == []                  # a second run changes nothing


LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))], ids=lambda d: d.name)
def test_relative_links_and_images_resolve(doc: Path):
    """`[text](other.md)` and `![figure](../images/x.svg)` point at files that exist."""
    missing = [target for target in LINK.findall(doc.read_text(encoding="utf-8"))
               if not (doc.parent / target).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"
