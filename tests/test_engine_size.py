"""Line budgets: every module of the package and every benchmark reads in one sitting, and the engine keeps requests,
steps and outputs; the sampler, a request's text, failures and the prompt's checks live in modules of their own
(docs/modules.md). A file past its budget holds more than one concept: it splits along its seam. A line keeps to
pyproject.toml's line-length, in every .py file of the repository."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLM_ENGINE = ROOT / "tinyvllm" / "engine" / "llm_engine.py"
MAX_LINES = 300
MAX_FILE_LINES = 500  # any .py file under tinyvllm/ or benchmarks/
PYTHON_FOLDERS = ("tinyvllm", "benchmarks", "tests", "course", "docs")  # and main.py: every .py file of the repository


def test_llm_engine_stays_within_its_line_budget():
    lines = len(LLM_ENGINE.read_text().splitlines())
    assert lines <= MAX_LINES, (f"tinyvllm/engine/llm_engine.py has {lines} lines, more than {MAX_LINES}: move the new "
                                f"concept into the module where it belongs (sample/, engine/request_state.py, ...)")


def test_every_file_reads_in_one_sitting():
    lines = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
             for folder in ("tinyvllm", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))}
    assert len(lines) > 100, "the package and the benchmarks were not found"
    too_long = {path: n for path, n in lines.items() if n > MAX_FILE_LINES}
    assert not too_long, (f"more than {MAX_FILE_LINES} lines: {too_long}; split each along its seam into modules "
                          f"that do one job (and list them in docs/modules.md)")


def test_every_line_keeps_to_the_line_length():
    limit = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]["line-length"]
    paths = [ROOT / "main.py", *(path for folder in PYTHON_FOLDERS for path in sorted((ROOT / folder).rglob("*.py")))]
    assert len(paths) > 300, "the repository's .py files were not found"
    too_long = [f"{path.relative_to(ROOT)}:{number} ({len(line)})" for path in paths
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > limit]
    assert not too_long, (f"lines over pyproject.toml's line-length ({limit} characters): {', '.join(too_long)}; "
                          f"wrap each (implicit string concatenation in parentheses, a break after a comma, a long "
                          f"trailing comment on its own line above)")
