"""The docs can't rot: the tutorials' code runs, and the module map matches the package.

Every ```python block of every `docs/phases/*.md` is executed, in order, in one fresh namespace per
document (one test per document, so a new phase's tutorial is picked up without touching this file).
Blocks fenced as ```text or ```bash are shown, not run. Each block is compiled with the document as
its file name and its own line numbers, so a traceback points at the line of the Markdown file.
"""

from __future__ import annotations

import json
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


# ---- numbers in prose come from results files ----
#
# A figure quoted from a benchmark carries, right after it, an HTML comment naming the results file
# (benchmarks/results/<name>.json, written by the bench script) and the key that holds it:
#
#     decode runs at 70.4 tok/s<!-- bench_generate: decode.tok_per_s -->
#     32 requests: 1.49x<!-- bench_throughput: concurrency=32.vs_llama_cpp --> llama.cpp's rate
#
# The key walks the JSON: `a.b` is a field, `3` an index, and `name=value` the element of a list whose
# field `name` equals `value`. `KEY*100` or `KEY/1000` scales the value (a fraction quoted as a percent).
# The figure is the last number before the comment on its line; it must equal the value rounded to the
# decimals quoted (commas as thousands separators are fine). The comment is invisible when rendered.

RESULTS = ROOT / "benchmarks" / "results"
FIGURE_DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *PHASE_DOCS]
REF = re.compile(r"<!--\s*(\w+):\s*([^\s*/>]+)(?:([*/])(\d+(?:\.\d+)?))?\s*-->")
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")
# figures that only a measurement can give: these need a reference to a results file
MEASURED = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:tok/s|tokens/s|GB/s|GFLOP/s|req/s|ms\b)"
                      r"|(?<![\w.])\d+(?:\.\d+)?x(?![\w])")
DERIVED = "<!-- derived -->"  # after a figure that is arithmetic on other figures or the model's shape


def lookup(data, key: str):
    for part in key.split("."):
        if isinstance(data, list) and "=" in part:
            field, want = part.split("=", 1)
            matches = [item for item in data if str(item.get(field)) == want]
            assert len(matches) == 1, f"{len(matches)} elements of the list have {field} = {want}"
            data = matches[0]
        elif isinstance(data, list):
            data = data[int(part)]
        else:
            assert part in data, f"no key {part!r} (there are: {', '.join(map(str, data))})"
            data = data[part]
    return data


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"^(`{3,})", line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and line.rstrip() == fence:
            fence = None
        elif fence is None:
            out.append((number, line))
    return out


def check_figures(text: str, name: str, results_dir: Path = RESULTS) -> list[str]:
    """Every quoted figure against its results file; returns the disagreements, one line each."""
    problems, files = [], {}
    for number, line in prose_lines(text):
        start = 0
        for ref in REF.finditer(line):
            quoted = NUMBER.findall(line[start:ref.start()])
            start = ref.end()
            where = f"{name}:{number}: {ref.group(0)}"
            if not quoted:
                problems.append(f"{where}: no number before the reference")
                continue
            path = results_dir / f"{ref.group(1)}.json"
            if path not in files:
                files[path] = json.loads(path.read_text()) if path.is_file() else None
            if files[path] is None:
                problems.append(f"{where}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} is missing")
                continue
            try:
                value = float(lookup(files[path], ref.group(2)))
            except (AssertionError, KeyError, IndexError, ValueError, TypeError) as e:
                problems.append(f"{where}: {e}")
                continue
            if ref.group(3):
                value = value * float(ref.group(4)) if ref.group(3) == "*" else value / float(ref.group(4))
            text_figure = quoted[-1].replace(",", "")
            decimals = len(text_figure.split(".")[1]) if "." in text_figure else 0
            if abs(value - float(text_figure)) > 0.5 * 10 ** -decimals + 1e-9:
                problems.append(f"{where}: the text says {quoted[-1]}, the results file says {value:.{decimals}f}")
    return problems


def unreferenced_figures(text: str, name: str) -> list[str]:
    """Measured-looking figures (tok/s, GB/s, ms, 1.5x, ...) with no results reference after them."""
    problems = []
    for number, line in prose_lines(text):
        for figure in MEASURED.finditer(line):
            rest = line[figure.end():]
            next_number = NUMBER.search(rest)
            comment = re.match(r"[^<]*?(<!--[^>]*-->)", rest)
            before_next = comment is not None and (next_number is None or comment.start(1) < next_number.start())
            if not (before_next and (REF.fullmatch(comment.group(1)) or comment.group(1) == DERIVED)):
                problems.append(f"{name}:{number}: {figure.group(0).strip()!r} names no results file")
    return problems


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
