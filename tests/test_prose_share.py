"""Docstrings are contracts, not essays: prose (docstrings and comments) stays a small share of tinyvllm/.

The essays' content lives in the chapters (docs/phases/); a module keeps a few lines saying what it is, its diagram
if it has one, and the chapter that teaches it (STYLE.md habit 6). Measured by tests/prose_share.py.
"""

from __future__ import annotations

import pytest

from prose_share import PACKAGE, prose_share

MAX_PROSE_SHARE = 0.20  # vLLM v1's core files are about a quarter prose, tinygrad's `llm` a tenth

# The modules already trimmed to contracts; the rest of the package joins as it is rewritten.
TRIMMED = [PACKAGE / name for name in (
    "api", "attention", "serve", "distributed",
    "dashboard.py", "cli.py", "convert.py", "perplexity.py", "pooling_params.py", "platforms.py", "disk_cache.py",
    "gc_utils.py")]
TRIMMED += [p for p in sorted((PACKAGE / "model").glob("*.py"))
            if p.name not in ("quant.py", "quantization.py", "quantizer.py")]


def share(paths) -> float:
    prose, total = prose_share(paths)
    return prose / total


def test_trimmed_modules_are_lean():
    assert share(TRIMMED) <= MAX_PROSE_SHARE


def test_the_package_is_lean():
    assert share([PACKAGE]) <= MAX_PROSE_SHARE


def test_prose_share_counts_docstrings_and_comments(tmp_path):
    code = "x = 1\n"
    doc = '"""Mod."""\n'
    comment = "# why\n"
    fn = 'def f():\n    """F."""\n    return 2  # two\n'
    (tmp_path / "m.py").write_text(doc + comment + code + fn)
    prose = len('"""Mod."""') + len("# why") + len('"""F."""') + len("# two")
    assert prose_share([tmp_path]) == (prose, len(doc + comment + code + fn))
