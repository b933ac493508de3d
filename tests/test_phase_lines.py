"""docs/modules.md's lines-per-phase table is what tests/phase_lines.py counts in the package as it is."""

from __future__ import annotations

from phase_lines import MODULE_MAP, code_lines, written


def test_the_module_map_counts_each_phases_lines():
    text = MODULE_MAP.read_text(encoding="utf-8")
    assert written(text) == text, "docs/modules.md's lines per phase are stale: run python tests/phase_lines.py --write"


def test_code_lines_leave_out_blanks_comments_and_docstrings():
    source = ('"""Module.\n\nMore."""\n\n# a comment\nx = 1  # counted\n\n\ndef f(\n    a,\n):\n'
              '    """F."""\n    return a\n')
    assert code_lines(source) == 5  # x = 1; "def f(", "a,", "):"; return a
