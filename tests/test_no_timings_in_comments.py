"""Comments say what and why; measured numbers live in results files (benchmarks/results/*.json).

A time or a speed in a comment or a docstring is one machine's reading on the day it was written, and goes stale
when the code changes. This scans the comments and docstrings of tinyvllm/ and the kernel sources in kernels/ for
figures such as `25 us`, `13 ms`, `45 tok/s`, `16 GB/s`; a figure in quotes is a value the code handles, not a
measurement ('250ms' as a duration format). Sizes, counts and arithmetic stay (a layer's weights in bytes).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMING = re.compile(r"\d+(\.\d+)?\s*(ms|us|µs|ns|tok/s|tokens/s|GB/s|MB/s|s per)\b")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
KERNEL_SOURCES = ("*.c", "*.h", "*.cu", "*.cuh", "*.metal")


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    prose = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):
                prose += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return prose


def c_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every // and /* */ comment of a C, CUDA or Metal source."""
    prose = []
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", source, re.S):
        first = source.count("\n", 0, m.start()) + 1
        prose += [(first + i, line) for i, line in enumerate(m.group().splitlines())]
    return prose


def timings(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return [(line, text.strip()) for line, text in prose if TIMING.search(QUOTED.sub("", text))]


def test_no_machine_timings_in_comments():
    found = []
    for path in sorted((ROOT / "tinyvllm").rglob("*.py")):
        found += [(path, *hit) for hit in timings(python_prose(path.read_text(encoding="utf-8")))]
    for pattern in KERNEL_SOURCES:
        for path in sorted((ROOT / "kernels").rglob(pattern)):
            found += [(path, *hit) for hit in timings(c_prose(path.read_text(encoding="utf-8")))]
    assert not found, "measured figures in comments (say what and why; quote results files in docs):\n" + "\n".join(
        f"{path.relative_to(ROOT)}:{line}: {text}" for path, line, text in found)


def test_the_scan_finds_a_timing_and_leaves_values_alone():
    source = '"""Fast."""\nx = 1  # ~25 us per kernel on this machine\ndef f():\n    """\'250ms\' is a duration."""\n'
    assert [line for line, _ in timings(python_prose(source))] == [2]
    assert [line for line, _ in timings(c_prose("int a; /* one block\n * streams at 16 GB/s */\n"))] == [2]
    assert timings(python_prose("n = 2  # 538 MB of weights, read once per token\n")) == []
